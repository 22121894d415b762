"""Input checks on the device: one launch classifies every matrix of a batch, so validating a state on
the GPU costs a kernel and one small transfer instead of host-side work per agent.

spd[launch](S, tol, code): for S (n, K, K), code[i] = 0 when S[i] is finite, symmetric to
``tol * max|S[i]|`` and Cholesky-factorisable in the array's own precision (the verdict of NumPy's
``cholesky`` on the host, up to rounding), else 1 (NaN or Inf), 2 (not symmetric) or 3 (not positive
definite). Callers name the first agent with a nonzero code.

One source, two launch shapes (as the Gaussian kernels): one thread per matrix for small K, and one warp
per matrix from ``WARP_FROM_K`` on, where a thread's serial Cholesky would leave the GPU latency-bound
(N = 16 384 matrices are only 512 warps); the warp's threads own rows of a right-looking factorisation.
"""

from __future__ import annotations

import functools
import math

import numpy as np

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

    def spd(S, tol, code):
        if blockwise:
            i, t, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        else:
            i, t, nt = cuda.grid(1), 0, 1
        if i >= S.shape[0]:
            return
        L = cuda.shared.array((K, K), dt) if blockwise else cuda.local.array((K, K), dt)
        # red: max |S|, max |S - S^T|, 1 where an entry is not finite (maxima: any order, same result)
        red = cuda.shared.array(3, dt) if blockwise else cuda.local.array(3, dt)
        if t == 0:
            red[0] = zero
            red[1] = zero
            red[2] = zero
        barrier()
        scale = zero
        asym = zero
        bad = zero
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
        if blockwise:
            cuda.atomic.max(red, 0, scale)
            cuda.atomic.max(red, 1, asym)
            cuda.atomic.max(red, 2, bad)
        else:
            red[0], red[1], red[2] = scale, asym, bad
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
            for r in range(j + 1 + t, K, nt):
                lrj = L[r, j]
                for c in range(j + 1, r + 1):
                    L[r, c] -= lrj * L[c, j]
        if t == 0:
            code[i] = SPD_OK

    return compile_kernels({"spd": spd})


def spd_launch(n: int, K: int) -> tuple[bool, int, int]:
    """(blockwise, blocks, threads per block) of the ``spd`` kernel for n matrices of size K."""
    if K >= WARP_FROM_K:
        return True, n, WARP
    return False, -(-n // BLOCK), BLOCK


def spd_codes(S, tol: float):
    """Device int32 codes (n,) of the ``spd`` kernel for a device batch S (n, K, K)."""
    import cupy

    n, K, _ = S.shape
    code = cupy.empty(n, np.int32)
    if n:
        blockwise, blocks, threads = spd_launch(n, K)
        k = make_check_kernels(K, np.dtype(S.dtype).name, blockwise)["spd"]
        S = as_device_view(cupy.ascontiguousarray(S))
        k[blocks, threads](S, S.dtype.type(tol), as_device_view(code))
    return code
