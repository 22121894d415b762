"""Input checks on the device: one launch checks a whole Gaussian state, so validating it on the GPU costs
one kernel and one small transfer instead of host-side work per agent.

state[launch](V1, V2, V3, V4, S1, S2, tol, code, bound, out) checks, for every agent i, the rows V_v[i]
of up to four vector variables (n, m_v) (m_v = 0 for an absent one) and two batches of K x K matrices
S_c[i]. For the matrices: code[c, i] = 0 when S_c[i] is finite, symmetric to ``tol * max|S_c[i]|`` and
Cholesky-factorisable in the array's own precision (the verdict of NumPy's ``cholesky`` on the host, up to
rounding), else 1 (NaN or Inf), 2 (not symmetric) or 3 (not positive definite); bound[c, i] (float64) is
an upper bound of the 2-norm condition number, ||S||_F ||L^-1||_F^2 >= ||S|| ||S^-1|| (S = L L^T), at
most about K^1.5 times too large (+inf for a failing matrix), computed for S scaled to max |S| = 1 so that
no square underflows or overflows: callers compute exact condition numbers only where it exceeds a limit.
``out`` (float64, OUT_SIZE entries, initialised by :func:`state_checks`) receives, by atomics: max |x| of
V1..V4, S1, S2 (+inf where an entry is not finite), the first failing agent of S1 and S2 (+inf when none)
and the largest bound of S1 and S2.

One source, two launch shapes: one thread per agent, and from ``WARP_FROM_K`` on one warp per agent (the
warp's threads own rows of a right-looking factorisation). Measured on an H100 (float32, GPU time of
launches in a row): a thread per agent 67 / 252 / 1018 us at K = 3 / 9 / 21 (N = 65 536 / 65 536 /
16 384), a warp per agent 524 / 1328 / 1047 us. But inside the energy's sequence of launches a thread per
agent at K = 21 cost 6.6 ms (likely cause: its K x K local arrays need ~0.5 GB of local memory over the
GPU's resident threads, reserved again after other kernels ran). Warps from K = 9 keep local memory small.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import float64

from .core import _NB, BLOCK, SIMULATOR, compile_kernels, cuda, device
from .launch import launch

__all__ = [
    "SPD_OK",
    "SPD_NONFINITE",
    "SPD_ASYMMETRIC",
    "SPD_INDEFINITE",
    "WARP_FROM_K",
    "OUT_SIZE",
    "PEAKS",
    "FIRSTS",
    "WORSTS",
    "make_check_kernels",
    "CHECK_BLOCKS",
    "check_launch",
    "out_initial",
    "state_checks",
]

SPD_OK, SPD_NONFINITE, SPD_ASYMMETRIC, SPD_INDEFINITE = 0, 1, 2, 3
WARP_FROM_K = 9
WARP = 4 if SIMULATOR else 32  # the simulator runs a Python thread per CUDA thread
# out: peaks of V1..V4, S1, S2; first failing agent of S1, S2; largest bound of S1, S2
PEAKS, FIRSTS, WORSTS, OUT_SIZE = 0, 6, 8, 10


@functools.cache
def make_check_kernels(K: int, dtype: str, blockwise: bool = False) -> dict:
    """The ``state`` kernel for K x K matrices of ``dtype``: one thread per agent, or (``blockwise``)
    one block of ``WARP`` threads per agent at a time, each block striding over the agents (launch:
    :func:`check_launch`)."""
    dt = _NB[np.dtype(dtype)]
    zero = np.dtype(dtype).type(0.0)  # typed: a float literal would promote float32 to float64
    one = np.dtype(dtype).type(1.0)
    KK = K * K

    @device
    def barrier():
        if blockwise:
            cuda.syncthreads()

    @device
    def row_peak(V, i, t, nt):
        """max |V[i, e]| over this thread's entries, +inf when one is not finite (float64)."""
        m = 0.0
        for e in range(t, V.shape[1], nt):
            v = float64(V[i, e])
            m = max(m, abs(v)) if math.isfinite(v) else math.inf
        return m

    @device
    def block_reduce(part, t, nt):
        """Tree reduction over the block's threads (nt a power of two) into part[:, 0]: rows 0-1 by max,
        rows 2-3 by sum (fixed pairs: the same result run to run). A no-op for one thread per agent."""
        s = nt // 2
        while s > 0:
            barrier()
            if t < s:
                part[0, t] = max(part[0, t], part[0, t + s])
                part[1, t] = max(part[1, t], part[1, t + s])
                part[2, t] += part[2, t + s]
                part[3, t] += part[3, t + s]
            s //= 2
        barrier()

    @device
    def matrix(S, i, t, nt, tol, L, part):
        """(code, condition-number bound, max |S[i]| or +inf) of S[i], the same in every thread of the
        block. Thread t reads entries t, t + nt, ... and owns rows t, t + nt, ... of the factorisation."""
        # part[:, t]: this thread's max |S| and max |S - S^T| (maxima: any order, same result), and the
        # count of its entries that are not finite
        scale = zero
        asym = zero
        bad = zero
        barrier()  # the previous matrix's readers of L and part are done
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            v = S[i, a, b]
            L[a, b] = v
            if not math.isfinite(v):
                bad += one
            else:
                scale = max(scale, abs(v))
                asym = max(asym, abs(v - S[i, b, a]))
        part[0, t], part[1, t], part[2, t], part[3, t] = scale, asym, bad, 0.0
        block_reduce(part, t, nt)
        if part[2, 0] > 0.0:
            return SPD_NONFINITE, math.inf, math.inf
        peak = part[0, 0]
        if dt(part[1, 0]) > tol * dt(peak):  # in the array's precision, as the host check
            return SPD_ASYMMETRIC, math.inf, peak
        # The bound is computed for S / peak (L / sqrt(peak)): it does not depend on the scale, and the
        # squares below would underflow to a bound of 0 for float64 entries under ~1e-154 (or overflow
        # above ~1e154). ||S / peak||_F^2 from this thread's own entries of L (no barrier needed); a zero
        # matrix fails the factorisation below.
        fro = 0.0
        if peak > 0.0:
            for e in range(t, KK, nt):
                a = e // K
                w = float64(L[a, e - a * K]) / float64(peak)
                fro += w * w
        # Right-looking Cholesky of the lower triangle. A pivot that is not > 0 fails (every thread reads
        # the same pivot, so all leave together).
        for j in range(K):
            barrier()
            d = L[j, j]
            if not d > zero:
                return SPD_INDEFINITE, math.inf, peak
            ljj = math.sqrt(d)
            for r in range(j + 1 + t, K, nt):
                L[r, j] = L[r, j] / ljj
            barrier()
            if t == 0:
                L[j, j] = ljj  # read by nobody before the next barrier
            for r in range(j + 1 + t, K, nt):
                lrj = L[r, j]
                for c in range(j + 1, r + 1):
                    L[r, c] -= lrj * L[c, j]
        barrier()
        # ||sqrt(peak) L^-1||_F^2: column c of sqrt(peak) L^-1 by forward substitution (threads own
        # columns); ||S / peak||_F^2 summed with it (sums: fixed pairs, the same result run to run).
        y = cuda.local.array(K, float64)
        root = math.sqrt(float64(peak))
        inv = 0.0
        for c in range(t, K, nt):
            for r in range(c, K):
                v = root if r == c else 0.0
                for k in range(c, r):
                    v -= float64(L[r, k]) * y[k]
                y[r] = v / float64(L[r, r])
                inv += y[r] * y[r]
        part[0, t], part[1, t], part[2, t], part[3, t] = 0.0, 0.0, fro, inv
        block_reduce(part, t, nt)
        return SPD_OK, math.sqrt(part[2, 0]) * part[3, 0], peak

    @device
    def record(acc, c, i, code, bound, peak):
        """One matrix's verdict into the block's accumulators (one thread per agent)."""
        cuda.atomic.max(acc, PEAKS + 4 + c, peak)
        if code != SPD_OK:
            cuda.atomic.min(acc, FIRSTS + c, float64(i))
        else:
            cuda.atomic.max(acc, WORSTS + c, bound)

    def state(V1, V2, V3, V4, S1, S2, tol, code, bound, out):
        n = S1.shape[0]
        if blockwise:  # a block per agent, striding over the agents (few blocks: few atomics on out)
            i0, step, t, nt = cuda.blockIdx.x, cuda.gridDim.x, cuda.threadIdx.x, cuda.blockDim.x
        else:
            i0, step, t, nt = cuda.grid(1), n, 0, 1
        tid, threads = cuda.threadIdx.x, cuda.blockDim.x
        # The block's accumulators (initial values: out's), pushed to out by one atomic each at the end.
        acc = cuda.shared.array(OUT_SIZE, float64)
        for e in range(tid, OUT_SIZE, threads):
            acc[e] = out[e]
        cuda.syncthreads()
        L = cuda.shared.array((K, K), dt) if blockwise else cuda.local.array((K, K), dt)
        part = cuda.shared.array((4, WARP), float64) if blockwise else cuda.local.array((4, 1), float64)
        for i in range(i0, n, step):  # the same agents in every thread of a block
            # each thread its share of the rows
            cuda.atomic.max(acc, PEAKS, row_peak(V1, i, t, nt))
            cuda.atomic.max(acc, PEAKS + 1, row_peak(V2, i, t, nt))
            cuda.atomic.max(acc, PEAKS + 2, row_peak(V3, i, t, nt))
            cuda.atomic.max(acc, PEAKS + 3, row_peak(V4, i, t, nt))
            c1, b1, p1 = matrix(S1, i, t, nt, tol, L, part)
            c2, b2, p2 = matrix(S2, i, t, nt, tol, L, part)
            if t == 0:
                code[0, i], code[1, i] = c1, c2
                bound[0, i], bound[1, i] = b1, b2
                record(acc, 0, i, c1, b1, p1)
                record(acc, 1, i, c2, b2, p2)
        cuda.syncthreads()
        for e in range(tid, OUT_SIZE, threads):
            if FIRSTS <= e < WORSTS:
                cuda.atomic.min(out, e, acc[e])
            else:
                cuda.atomic.max(out, e, acc[e])

    return compile_kernels({"state": state})


# Blocks of a blockwise launch (each strides over the agents): enough to fill an H100 or H200 several
# times over, few enough that the blocks' atomics on ``out`` stay negligible.
CHECK_BLOCKS = 4096


def check_launch(n: int, K: int) -> tuple[bool, int, int]:
    """(blockwise, blocks, threads per block) of the ``state`` kernel for n agents of size K."""
    if K >= WARP_FROM_K:
        return True, min(n, CHECK_BLOCKS), WARP
    return False, -(-n // BLOCK), BLOCK


def out_initial() -> np.ndarray:
    """``out``'s initial values: peaks and largest bounds 0, first failing agents +inf."""
    out = np.zeros(OUT_SIZE)
    out[FIRSTS:WORSTS] = np.inf
    return out


def state_checks(vectors, S1, S2, tol: float):
    """Launch the ``state`` kernel on device arrays: up to four vector variables (each (n, ...), reshaped to
    rows) and two covariance batches (n, K, K) (pass one twice to check one). Returns (out (host float64,
    OUT_SIZE: see the module docstring), code (2, n) int32 and bound (2, n) float64 on the device); the
    launch and ``out``'s transfer are the only device work."""
    import cupy

    n, K, _ = S1.shape
    if len(vectors) > 4:
        raise ValueError(f"state_checks: at most 4 vector variables, got {len(vectors)}")
    rows = [cupy.ascontiguousarray(v).reshape(n, -1) for v in vectors]
    rows += [cupy.empty((n, 0), S1.dtype)] * (4 - len(rows))
    mats = [cupy.ascontiguousarray(S) for S in (S1, S2)]
    code = cupy.empty((2, n), np.int32)
    bound = cupy.empty((2, n), np.float64)
    if n == 0:  # no launch of an empty grid
        return out_initial(), code, bound
    out = cupy.asarray(out_initial())
    blockwise, blocks, threads = check_launch(n, K)
    k = make_check_kernels(K, np.dtype(S1.dtype).name, blockwise)["state"]
    launch(k, blocks, threads, *rows, *mats, S1.dtype.type(tol), code, bound, out)
    return out.get(), code, bound
