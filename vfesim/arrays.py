"""The array module of an array (NumPy or CuPy): the one place vfesim asks."""

from __future__ import annotations

import numpy as np

__all__ = [
    "array_module",
    "host_array",
    "is_host",
    "max_abs",
    "total",
    "lazy_total",
    "host_floats",
    "agent_minor",
    "empty_agent_minor",
    "memory_flat",
    "device_constant",
]


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


def max_abs(arrays) -> list[float]:
    """max |x| of each array as a host float, +inf for an array with a NaN or Inf entry (0 when empty).

    Device (CuPy) arrays: numba reduction kernels, two launches for up to six arrays of one dtype
    (:func:`vfesim_kernels.cuda.reduce.max_abs`), and a single device-to-host transfer for all of them,
    the cheap first pass of input and output checks (a failing array is then examined in detail).
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
            parts = (v.real, v.imag) if np.iscomplexobj(v) else (v,)
            m = max(float(np.abs(p).max(initial=0.0)) for p in parts)
            out.append(m if all(np.isfinite(p).all() for p in parts) else float("inf"))
        return out
    from vfesim_kernels.cuda import reduce  # numba kernels: no CUB program for NVRTC to compile

    return reduce.max_abs(arrays)


def total(a) -> float:
    """The float64 sum of an array's entries as a host float. Device (CuPy) arrays: the numba reduction
    kernels of :func:`vfesim_kernels.cuda.reduce.device_sum` (CuPy's own ``sum`` runs a CUB program that
    NVRTC compiles in a process's first call, seconds each)."""
    return float(lazy_total(a))


def lazy_total(a):
    """The float64 sum of an array's entries where the array lives: a NumPy float64, or a 0-d float64
    device array (no synchronisation; :func:`host_floats` brings several home in one transfer)."""
    if array_module(a) is np:
        return np.asarray(a).sum(dtype=np.float64)
    from vfesim_kernels.cuda import reduce

    return reduce.device_sum(a)


def host_floats(values: dict) -> dict:
    """The values of a dict of numbers and 0-d device arrays as host floats, with one device-to-host
    transfer (one synchronisation) for all the device ones."""
    lazy = [k for k, v in values.items() if array_module(v) is not np]
    out = {k: float(v) for k, v in values.items() if k not in lazy}
    if lazy:
        xp = array_module(values[lazy[0]])
        host = xp.stack([xp.asarray(values[k], np.float64).reshape(()) for k in lazy]).get()
        out |= dict(zip(lazy, map(float, host), strict=True))
    return {k: out[k] for k in values}


def agent_minor(a, axis: int = 0):
    """``a`` with its agent axis ``axis`` the fastest in memory (stride one element), as a strided array of
    the same shape; copied only when it is not laid out so already.

    With one GPU thread per agent, a warp then reads and writes consecutive addresses for each entry of
    its agents' matrices (coalesced), where the row-major layout puts the agents a whole matrix apart (at
    d = 4, complex128: 256 bytes, one cache line per thread and access). Elementwise NumPy and CuPy
    results keep an operand's layout (``order="K"``), so the arrays of a run stay in it."""
    if _is_agent_minor(a, axis):  # the usual case in a run (no array operations: a host-bound step's)
        return a
    xp = array_module(a)
    moved = xp.moveaxis(xp.asarray(a), axis, -1)
    if not moved.flags.c_contiguous:
        moved = xp.ascontiguousarray(moved)
    return xp.moveaxis(moved, -1, axis)


def _is_agent_minor(a, axis: int) -> bool:
    """Whether array ``a`` (NumPy or CuPy) is laid out as :func:`agent_minor` gives, from its shape and
    strides alone."""
    shape, strides = getattr(a, "shape", None), getattr(a, "strides", None)
    if shape is None or strides is None or not shape or not -len(shape) <= axis < len(shape):
        return False
    axis %= len(shape)
    step = a.itemsize
    if shape[axis] > 1 and strides[axis] != step:
        return False
    step *= shape[axis]
    for k in range(len(shape) - 1, -1, -1):
        if k == axis:
            continue
        if shape[k] > 1 and strides[k] != step:
            return False
        step *= shape[k]
    return True


def memory_flat(a):
    """(flat, strides): a 1-D view of the entries of ``a`` in memory order and ``a``'s strides in entries,
    so that ``a[i, j, ...]`` is ``flat[i * strides[0] + j * strides[1] + ...]``; None where ``a``'s entries
    do not fill one block in some order of its axes (C, F and agent-minor layouts do)."""
    xp = array_module(a)
    t = a.transpose(sorted(range(a.ndim), key=lambda k: -abs(a.strides[k])))
    if not t.flags.c_contiguous or any(s < 0 for s in a.strides):
        return None
    return xp.reshape(t, -1), tuple(s // a.itemsize for s in a.strides)


# (array module, device, key) -> a constant array (device_constant)
_CONSTANTS: dict = {}


def device_constant(xp, key, make):
    """The array ``make()`` of module ``xp`` on its current device, made once per (module, device, key) and
    kept: a constant that kernels read and never write (made writable: the CUDA simulator writes its
    arguments back)."""
    cuda = getattr(xp, "cuda", None)
    full = (xp.__name__, cuda.runtime.getDevice() if cuda is not None else -1, key)
    a = _CONSTANTS.get(full)
    if a is None:
        a = _CONSTANTS[full] = make()
    return a


def empty_agent_minor(xp, shape: tuple, dtype, axis: int = 0):
    """An uninitialised array of module ``xp`` laid out as :func:`agent_minor` gives (agent axis
    ``axis``)."""
    shape = tuple(shape)
    rest = shape[:axis] + shape[axis + 1 :]
    return xp.moveaxis(xp.empty((*rest, shape[axis]), dtype), -1, axis)
