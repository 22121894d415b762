"""Input checks on the device: one launch classifies every matrix of a batch, so validating a state on
the GPU costs a kernel and one small transfer instead of host-side work per agent.

spd[blocks, BLOCK](S, tol, code): for S (n, K, K), code[i] = 0 when S[i] is finite, symmetric to
``tol * max|S[i]|`` and Cholesky-factorisable in the array's own precision (the verdict of NumPy's
``cholesky`` on the host, up to rounding), else 1 (NaN or Inf), 2 (not symmetric) or 3 (not positive
definite). Callers name the first agent with a nonzero code.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .core import _NB, BLOCK, as_device_view, compile_kernels, cuda

__all__ = ["SPD_OK", "SPD_NONFINITE", "SPD_ASYMMETRIC", "SPD_INDEFINITE", "make_check_kernels", "spd_codes"]

SPD_OK, SPD_NONFINITE, SPD_ASYMMETRIC, SPD_INDEFINITE = 0, 1, 2, 3


@functools.cache
def make_check_kernels(K: int, dtype: str) -> dict:
    """The ``spd`` kernel for K x K matrices of ``dtype`` (one thread per matrix)."""
    dt = _NB[np.dtype(dtype)]
    zero = np.dtype(dtype).type(0.0)  # typed: a float literal would promote float32 to float64

    def spd(S, tol, code):
        i = cuda.grid(1)
        if i >= S.shape[0]:
            return
        scale = zero
        for a in range(K):
            for b in range(K):
                v = S[i, a, b]
                if not math.isfinite(v):
                    code[i] = SPD_NONFINITE
                    return
                scale = max(scale, abs(v))
        asym = zero
        for a in range(K):
            for b in range(a + 1, K):
                asym = max(asym, abs(S[i, a, b] - S[i, b, a]))
        if asym > tol * scale:
            code[i] = SPD_ASYMMETRIC
            return
        # Cholesky of the lower triangle, column by column; a pivot that is not > 0 (or NaN) fails.
        L = cuda.local.array((K, K), dt)
        for j in range(K):
            d = S[i, j, j]
            for k in range(j):
                d -= L[j, k] * L[j, k]
            if not d > zero:
                code[i] = SPD_INDEFINITE
                return
            L[j, j] = math.sqrt(d)
            for r in range(j + 1, K):
                v = S[i, r, j]
                for k in range(j):
                    v -= L[r, k] * L[j, k]
                L[r, j] = v / L[j, j]
        code[i] = SPD_OK

    return compile_kernels({"spd": spd})


def spd_codes(S, tol: float):
    """Device int32 codes (n,) of the ``spd`` kernel for a C-contiguous device batch S (n, K, K)."""
    import cupy

    n, K, _ = S.shape
    code = cupy.empty(n, np.int32)
    if n:
        k = make_check_kernels(K, np.dtype(S.dtype).name)["spd"]
        S = as_device_view(cupy.ascontiguousarray(S))
        k[-(-n // BLOCK), BLOCK](S, S.dtype.type(tol), as_device_view(code))
    return code
