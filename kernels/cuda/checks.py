"""Input checks on the device: one launch classifies every matrix of a batch, so validating a state on
the GPU costs a kernel and one small transfer instead of host-side work per agent.

spd[launch](S, tol, code, bound): for S (n, K, K), code[i] = 0 when S[i] is finite, symmetric to
``tol * max|S[i]|`` and Cholesky-factorisable in the array's own precision (the verdict of NumPy's
``cholesky`` on the host, up to rounding), else 1 (NaN or Inf), 2 (not symmetric) or 3 (not positive
definite). Callers name the first agent with a nonzero code. For code 0, bound[i] (float64) is an upper
bound of the 2-norm condition number, ||S||_F ||L^-1||_F^2 >= ||S|| ||S^-1|| (S = L L^T), at most
about K^1.5 times too large: callers compute exact condition numbers only where it exceeds a limit.

One source, two launch shapes (as the Gaussian kernels): one thread per matrix for small K, and one warp
per matrix from ``WARP_FROM_K`` on, where a thread's serial Cholesky would leave the GPU latency-bound
(N = 16 384 matrices are only 512 warps); the warp's threads own rows of a right-looking factorisation.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import float64

from .core import _NB, BLOCK, SIMULATOR, as_device_view, compile_kernels, cuda, device

__all__ = [
    "SPD_OK",
    "SPD_NONFINITE",
    "SPD_ASYMMETRIC",
    "SPD_INDEFINITE",
    "WARP_FROM_K",
    "make_check_kernels",
    "spd_launch",
    "spd_codes",
]

SPD_OK, SPD_NONFINITE, SPD_ASYMMETRIC, SPD_INDEFINITE = 0, 1, 2, 3
WARP_FROM_K = 9
WARP = 4 if SIMULATOR else 32  # the simulator runs a Python thread per CUDA thread


@functools.cache
def make_check_kernels(K: int, dtype: str, blockwise: bool = False) -> dict:
    """The ``spd`` kernel for K x K matrices of ``dtype``: one thread per matrix, or (``blockwise``)
    one block per matrix (launch: :func:`spd_launch`)."""
    dt = _NB[np.dtype(dtype)]
    zero = np.dtype(dtype).type(0.0)  # typed: a float literal would promote float32 to float64
    one = np.dtype(dtype).type(1.0)
    KK = K * K

    @device
    def barrier():
        if blockwise:
            cuda.syncthreads()

    def spd(S, tol, code, bound):
        if blockwise:
            i, t, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        else:
            i, t, nt = cuda.grid(1), 0, 1
        if i >= S.shape[0]:
            return
        L = cuda.shared.array((K, K), dt) if blockwise else cuda.local.array((K, K), dt)
        # red: max |S|, max |S - S^T|, 1 where an entry is not finite (maxima: any order, same result);
        # sums: ||S||_F^2 and ||L^-1||_F^2 in float64 (bounds only: their summation order does not matter)
        red = cuda.shared.array(3, dt) if blockwise else cuda.local.array(3, dt)
        sums = cuda.shared.array(2, float64) if blockwise else cuda.local.array(2, float64)
        if t == 0:
            red[0] = zero
            red[1] = zero
            red[2] = zero
            sums[0] = 0.0
            sums[1] = 0.0
        barrier()
        scale = zero
        asym = zero
        bad = zero
        fro = 0.0
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            v = S[i, a, b]
            L[a, b] = v
            if not math.isfinite(v):
                bad = one
            else:
                scale = max(scale, abs(v))
                asym = max(asym, abs(v - S[i, b, a]))
                fro += float64(v) * float64(v)
        if blockwise:
            cuda.atomic.max(red, 0, scale)
            cuda.atomic.max(red, 1, asym)
            cuda.atomic.max(red, 2, bad)
            cuda.atomic.add(sums, 0, fro)
        else:
            red[0], red[1], red[2] = scale, asym, bad
            sums[0] = fro
        barrier()
        if red[2] > zero or red[1] > tol * red[0]:
            if t == 0:
                code[i] = SPD_NONFINITE if red[2] > zero else SPD_ASYMMETRIC
            return
        # Right-looking Cholesky of the lower triangle; thread t owns rows t, t + nt, ... A pivot that is
        # not > 0 fails (every thread reads the same pivot, so all leave together).
        for j in range(K):
            barrier()
            d = L[j, j]
            if not d > zero:
                if t == 0:
                    code[i] = SPD_INDEFINITE
                return
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
        # ||L^-1||_F^2: column c of L^-1 by forward substitution (threads own columns).
        y = cuda.local.array(K, float64)
        inv = 0.0
        for c in range(t, K, nt):
            for r in range(c, K):
                v = 1.0 if r == c else 0.0
                for k in range(c, r):
                    v -= float64(L[r, k]) * y[k]
                y[r] = v / float64(L[r, r])
                inv += y[r] * y[r]
        if blockwise:
            cuda.atomic.add(sums, 1, inv)
        else:
            sums[1] = inv
        barrier()
        if t == 0:
            code[i] = SPD_OK
            bound[i] = math.sqrt(sums[0]) * sums[1]

    return compile_kernels({"spd": spd})


def spd_launch(n: int, K: int) -> tuple[bool, int, int]:
    """(blockwise, blocks, threads per block) of the ``spd`` kernel for n matrices of size K."""
    if K >= WARP_FROM_K:
        return True, n, WARP
    return False, -(-n // BLOCK), BLOCK


def spd_codes(S, tol: float):
    """Device arrays (code int32 (n,), condition-number bound float64 (n,)) of the ``spd`` kernel for a
    device batch S (n, K, K)."""
    import cupy

    n, K, _ = S.shape
    code = cupy.empty(n, np.int32)
    bound = cupy.full(n, np.inf)
    if n:
        blockwise, blocks, threads = spd_launch(n, K)
        k = make_check_kernels(K, np.dtype(S.dtype).name, blockwise)["spd"]
        S = as_device_view(cupy.ascontiguousarray(S))
        k[blocks, threads](S, S.dtype.type(tol), as_device_view(code), as_device_view(bound))
    return code, bound
