"""The array module of an array (NumPy or CuPy): the one place vfesim asks."""

from __future__ import annotations

import numpy as np

__all__ = ["array_module", "host_array", "is_host", "max_abs"]


def array_module(a):
    """``numpy`` for NumPy arrays (and scalars), ``cupy`` for CuPy arrays (imported only then)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def host_array(a) -> np.ndarray:
    """A NumPy array of a NumPy, CuPy (copied to the host) or Dask (computed) array; NumPy ones as they
    are."""
    if isinstance(a, np.ndarray):
        return a
    return a.get() if array_module(a) is not np else np.asarray(a)


def is_host(a) -> bool:
    """True for NumPy arrays."""
    return isinstance(a, np.ndarray)


_MAX_ABS_KERNEL = None


def _max_abs_kernel():
    """A CuPy reduction: max |x| over an array, +inf where any entry is NaN or Inf (one pass)."""
    global _MAX_ABS_KERNEL
    if _MAX_ABS_KERNEL is None:
        import cupy

        _MAX_ABS_KERNEL = cupy.ReductionKernel(
            "T x",
            "float64 y",
            "isfinite((double)x) ? fabs((double)x) : CUDART_INF",
            "max(a, b)",
            "y = a",
            "0.0",
            "vfesim_max_abs",
        )
    return _MAX_ABS_KERNEL


def max_abs(arrays) -> list[float]:
    """max |x| of each array as a host float, +inf for an array with a NaN or Inf entry (0 when empty).

    Device (CuPy) arrays: one reduction kernel per array and a single device-to-host transfer for all
    of them, the cheap first pass of input and output checks (a failing array is then examined in detail).
    Complex arrays are reduced over their real and imaginary parts.
    """
    arrays = list(arrays)
    if not arrays:
        return []
    xp = array_module(arrays[0])
    if xp is np:
        out = []
        for a in arrays:
            v = np.asarray(a)
            v = v.view(v.real.dtype) if np.iscomplexobj(v) else v
            m = float(np.abs(v).max(initial=0.0))
            out.append(m if np.isfinite(v).all() else float("inf"))
        return out
    k = _max_abs_kernel()
    parts = []
    for a in arrays:
        v = xp.ascontiguousarray(a)
        v = v.view(v.real.dtype) if xp.iscomplexobj(v) else v
        parts.append(k(v.ravel()) if v.size else xp.zeros((), np.float64))
    return [float(x) for x in xp.stack(parts).tolist()]
