"""Batched Hermitian eigensolver with eight threads per matrix: the ``eigh`` of the density-matrix kernels
at large d (:data:`COOP_MIN_D` and up), where one thread per matrix leaves the GPU nearly idle.

One thread per matrix (:func:`vfesim_kernels.quantum_math.eigh_agent`) runs a cyclic Jacobi sweep as one
serial chain over the matrix in local memory; at d = 8 the batch of an evaluation (3 x 16 384 matrices) is
about 12 warps per SM of an H100, and the chain's latency is the time. Here eight threads share a matrix
in shared memory. Each step of a sweep rotates ceil(d / 2) disjoint index pairs at once (the round-robin
ordering of :func:`round_robin_pair`: d - 1 steps cover every pair, d steps for odd d with a dummy index),
thread 2 k + h applying rotation k to its half h of the rows (columns): first A <- A G and V <- V G
(columns p, q of the rows in its half), then, after a barrier, A <- G^dagger A (rows p, q, the columns in
its half). Disjoint rotations commute, and each one's angle depends only on the 2 x 2 block it zeroes,
which the others leave alone: a step is the product of its rotations, each computed by
:func:`vfesim_kernels.quantum_math.jacobi_rotation`, the serial solver's formula.

Sweeps stop at the serial solver's test (squared off-diagonal norm at most ``tol2`` times the squared
Frobenius norm, summed in a fixed order), per matrix: a converged matrix takes no more rotations while its
warp's others go on, so every result is independent of its neighbours in the batch. Eigenvalues ascending
(ties in their diagonal order; NaN last), eigenvectors as columns, as the ``eigh`` kernel's contract.

Threads of one warp synchronise by ``syncwarp`` and stop together by a warp vote; the CUDA simulator has
neither, and runs one matrix per block with block barriers instead (the same schedule).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import complex64, complex128, float64

from .. import quantum_math as _qm
from .core import SIMULATOR, compile_kernels, cuda, device

__all__ = ["make_coop_eigh", "round_robin_pair", "COOP_LANES", "COOP_THREADS", "COOP_MIN_D", "COOP_MAX_D"]

# Threads per matrix (up to four rotations of two halves each), threads per block (the simulator: one
# matrix a block), and the sizes that take this solver. On an H100, the forward pass of an evaluation at
# N = 16 384 with its eigen-decompositions one thread a matrix against eight (benchmarks/results/
# quantum_bench_h100_stop38.txt, stages forward_1thr / forward): d = 8 4.67 -> 2.22 ms (complex128), 1.89 ->
# 1.38 ms (complex64); d = 6 1.54 -> 0.99 and 0.93 -> 0.76 ms. Below d = 6 one thread a matrix stays (its
# Jacobi chain is short; the kernel was not faster there when tried).
COOP_LANES = 8
COOP_THREADS = COOP_LANES if SIMULATOR else 128
COOP_MIN_D = 6
COOP_MAX_D = 8
# whole warps per block: the warp-wide barriers and votes take every lane of a warp
assert COOP_THREADS % COOP_LANES == 0 and (SIMULATOR or COOP_THREADS % 32 == 0)

_rotation = device(_qm.jacobi_rotation)
_COMPLEX = {np.dtype(np.complex64): complex64, np.dtype(np.complex128): complex128}

if SIMULATOR:

    @device
    def _sync():
        cuda.syncthreads()

    @device
    def _all(flag):
        return cuda.syncthreads_and(flag)

else:

    @device
    def _sync():
        cuda.syncwarp(0xFFFFFFFF)

    @device
    def _all(flag):
        return cuda.all_sync(0xFFFFFFFF, flag)


def round_robin_pair(m: int, step: int, k: int) -> tuple[int, int]:
    """(p, q), p < q: the k-th of the m / 2 disjoint index pairs of ``step`` (0 .. m - 2) of a sweep over
    m (even) indices, the circle method: index 0 stays, the others turn one place a step, so the m - 1
    steps pair every two indices exactly once."""
    a = 0 if k == 0 else (k + step - 1) % (m - 1) + 1
    b = (m - 2 - k + step) % (m - 1) + 1
    return (a, b) if a < b else (b, a)


_pair = device(round_robin_pair)


def _nan_last_less(a, b, i, j) -> bool:
    """Whether (a, i) comes before (b, j) in the order ascending by value, NaN after every number, ties
    by index: a total order, so the ranks it gives are a permutation."""
    if a != a:
        return b != b and i < j
    if b != b:
        return True
    return a < b or (a == b and i < j)


_before = device(_nan_last_less)


def _group_sum_py(red, g, k):
    """red[g, k, 0] + ... + red[g, k, L - 1], in that order (every thread of the group gets the same bits)."""
    acc = 0.0
    for i in range(red.shape[2]):
        acc += red[g, k, i]
    return acc


_group_sum = device(_group_sum_py)


@functools.cache
def make_coop_eigh(d: int, dtype: str) -> dict:
    """``{"eigh": kernel, "lanes": COOP_LANES}``: ``eigh(X, tol2, w_out, V_out)`` with the contract of the
    one-thread ``eigh`` (:func:`vfesim_kernels.cuda.quantum.make_quantum_kernels`) for matrices of size
    ``d`` in complex ``dtype``, launched with ``lanes`` threads per matrix in blocks of COOP_THREADS
    (``ceil(n lanes / COOP_THREADS)`` blocks for n matrices: no grid-stride loop)."""
    if not 2 <= d <= COOP_MAX_D:
        raise ValueError(f"d: the cooperative eigensolver takes 2 <= d <= {COOP_MAX_D}, got {d}")
    cdt = _COMPLEX[np.dtype(dtype)]
    rdt = np.finfo(np.dtype(dtype)).dtype.type
    L = COOP_LANES
    G = COOP_THREADS // L  # matrices per block
    m = d + d % 2  # indices of the ordering (a dummy one for odd d)
    P = m // 2  # rotations per step
    half = (d + 1) // 2  # rows (columns) of a thread's half
    sweeps = _qm.MAX_SWEEPS

    def eigh(X, tol2, w_out, V_out):
        As = cuda.shared.array((G, d, d), cdt)
        Vs = cuda.shared.array((G, d, d), cdt)
        red = cuda.shared.array((G, 2, L), float64)  # per thread: off-diagonal, diagonal sums
        tid = cuda.threadIdx.x
        g = tid // L
        lane = tid - g * L
        n = cuda.blockIdx.x * G + g
        live = n < X.shape[0]
        A = As[g]
        V = Vs[g]
        k = lane // 2
        r0 = (lane - 2 * k) * half
        r1 = min(d, r0 + half)
        one = rdt(1.0)
        if live and lane < d:
            for c in range(d):
                A[lane, c] = 0.5 * (X[n, lane, c] + X[n, c, lane].conjugate())
                V[lane, c] = 0.0
            V[lane, lane] = 1.0
        done = not live
        for sweep in range(sweeps + 1):
            off = 0.0
            dg = 0.0
            if not done and lane < d:
                dg = A[lane, lane].real * A[lane, lane].real
                for c in range(lane + 1, d):
                    off += A[lane, c].real * A[lane, c].real + A[lane, c].imag * A[lane, c].imag
            # (the last step's barrier ordered these reads after every write to A; the step loop's
            # barriers order the sums' reads of red before the next sweep's writes)
            red[g, 0, lane] = off
            red[g, 1, lane] = dg
            _sync()
            off = _group_sum(red, g, 0)
            dg = _group_sum(red, g, 1)
            if off <= tol2 * (dg + 2.0 * off) or sweep == sweeps:
                done = True
            if _all(done):
                break
            for step in range(m - 1):
                p, q = _pair(m, step, k)
                act = not done and k < P and q < d
                if act:
                    act = A[p, q].real != 0.0 or A[p, q].imag != 0.0
                c = one
                se = cdt(0.0)
                sec = cdt(0.0)
                if act:
                    c, se, sec = _rotation(A, p, q, one)
                _sync()
                if act:
                    for i in range(r0, r1):  # A <- A G, V <- V G (columns p, q of this half's rows)
                        aip = A[i, p]
                        aiq = A[i, q]
                        A[i, p] = c * aip - sec * aiq
                        A[i, q] = se * aip + c * aiq
                        vip = V[i, p]
                        viq = V[i, q]
                        V[i, p] = c * vip - sec * viq
                        V[i, q] = se * vip + c * viq
                _sync()
                if act:
                    for j in range(r0, r1):  # A <- G^dagger A (rows p, q of this half's columns)
                        apj = A[p, j]
                        aqj = A[q, j]
                        if j == p:
                            A[p, j] = (c * apj - se * aqj).real
                            A[q, j] = 0.0
                        elif j == q:
                            A[p, j] = 0.0
                            A[q, j] = (sec * apj + c * aqj).real
                        else:
                            A[p, j] = c * apj - se * aqj
                            A[q, j] = sec * apj + c * aqj
                _sync()
        if live and lane < d:
            wl = A[lane, lane].real
            rank = 0
            for i in range(d):
                if _before(A[i, i].real, wl, i, lane):
                    rank += 1
            w_out[n, rank] = wl
            for i in range(d):
                V_out[n, i, rank] = V[i, lane]

    return compile_kernels({"eigh": eigh}) | {"lanes": L}
