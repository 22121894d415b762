"""Kernel launches that keep each argument's kernel form: numba's launcher re-derives it at every launch.

A numba.cuda kernel takes an array as a run of scalar parameters (meminfo, parent, size, itemsize, data
pointer, shape, strides: numba's ``_Kernel._prepare_args``) and types its arguments (``typeof``) to pick
the compiled overload. Per launch that costs tens of microseconds per array argument: a density-matrix
adjoint step (about thirty arguments) spent more host time launching than its kernel ran (rollouts of
the cuda backend were host-bound). :func:`launch` keeps, per array (by data pointer, shape, strides and
dtype, as :func:`.core.launch_view` keys its views), the numba type and the parameter run, and per
kernel and argument types the compiled function, then launches it through the same ``cuda.core`` call
numba makes. Anything it does not know (a new array, an argument type it does not pack, a kernel not yet
compiled for these types) goes through numba's own launch first, so the results are numba's.

Under the simulator, or where this numba-cuda lacks the pieces it uses, :func:`launch` is numba's launch.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .core import SIMULATOR, _DeviceNDArray, launch_view

__all__ = ["launch", "FAST_LAUNCH", "AVAILABLE"]

try:  # numba-cuda >= 0.2x on cuda.core: the pieces numba's own launcher uses
    from cuda.core import LaunchConfig as _LaunchConfig
    from cuda.core import launch as _core_launch
    from numba.cuda._compat import CUDA_CORE_GE_1_0 as _GE_1_0
    from numba.cuda.cudadrv.driver import _to_core_stream
    from numba.cuda.typing.typeof import Purpose as _Purpose
    from numba.cuda.typing.typeof import typeof as _typeof

    AVAILABLE = True
except ImportError:  # the simulator, or another numba-cuda: numba's launch
    AVAILABLE = False
FAST_LAUNCH = AVAILABLE and not SIMULATOR

# Scalars the fast path packs: Python type -> the ctypes type numba packs its numba type in (None: as is).
_SCALARS = {
    bool: None,
    int: ctypes.c_int64,
    float: ctypes.c_double,
    np.float64: ctypes.c_double,
    np.float32: ctypes.c_float,
    np.int64: ctypes.c_int64,
    np.int32: ctypes.c_int32,
}
_SCALAR_TYPES: dict = {}  # Python type -> numba type (filled on first use, from numba's typeof)

# (data pointer, shape, strides, dtype char) -> (numba type, parameter run, type token) of device arrays;
# CuPy's pool hands the same blocks out step after step. Bounded like core's launch views.
_ARRAYS: dict = {}
_ARRAYS_MAX = 4096
# Types of device arrays seen (CuPy's ndarray): later instances skip the interface checks.
_ARRAY_KINDS: set = set()
# numba type -> a small integer: kernel keys hash these (a numba type hashes in Python, microseconds each).
_TOKENS: dict = {}
# (dispatcher id, device, argument type tokens) -> (dispatcher, its compiled cuda.core Kernel; None: numba's
# path)
_KERNELS: dict = {}
_CONFIGS: dict = {}
_STREAM: list = []


def _device_id() -> int:
    """The current device's number (CuPy's, a cheap call; numba's where CuPy is missing)."""
    try:
        import cupy
    except ImportError:  # pragma: no cover - the cuda backend needs CuPy
        from .core import cuda

        return cuda.get_current_device().id
    return cupy.cuda.runtime.getDevice()


def _token(ty) -> int:
    tok = _TOKENS.get(ty)
    if tok is None:
        tok = _TOKENS[ty] = len(_TOKENS)
    return tok


def _array(a):
    """(numba type, parameter run, type token) of a CuPy array or numba device array of at least one
    dimension, or None (not such an array)."""
    kind = type(a)
    if kind in _ARRAY_KINDS:
        ptr = a.data.ptr
    elif isinstance(a, _DeviceNDArray):
        ptr = a.device_ctypes_pointer.value or 0
    elif hasattr(a, "data") and hasattr(a.data, "ptr") and hasattr(a, "__cuda_array_interface__"):
        _ARRAY_KINDS.add(kind)
        ptr = a.data.ptr
    else:
        return None
    shape = a.shape
    if not shape:
        return None
    key = (ptr, shape, a.strides, a.dtype.char)
    rec = _ARRAYS.get(key)
    if rec is None:
        view = launch_view(a)
        ty = _typeof(view, _Purpose.argument)
        rec = (ty, (0, 0, view.size, view.dtype.itemsize, ptr, *view.shape, *view.strides), _token(ty))
        if len(_ARRAYS) >= _ARRAYS_MAX:
            _ARRAYS.clear()
        _ARRAYS[key] = rec
    return rec


def _scalar(v):
    """(numba type, parameter run, type token) of a scalar the fast path packs, or None."""
    kind = type(v)
    if kind not in _SCALARS:
        return None
    ty = _SCALAR_TYPES.get(kind)
    if ty is None:
        ty = _SCALAR_TYPES[kind] = _typeof(v, _Purpose.argument)
    pack = _SCALARS[kind]
    return ty, ((v,) if pack is None else (pack(v),)), _token(ty)


def _views(args) -> list:
    """numba's launch arguments: arrays as :func:`.core.launch_view` gives them, scalars (NumPy's too) as
    they are."""
    return [a if isinstance(a, np.generic) or not hasattr(a, "shape") else launch_view(a) for a in args]


def _config(griddim, blockdim):
    key = (griddim, blockdim)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        if _GE_1_0:
            cfg = _LaunchConfig(grid=griddim, block=blockdim, shmem_size=0, is_cooperative=False)
        else:  # pragma: no cover - older cuda.core
            cfg = _LaunchConfig(grid=griddim, block=blockdim, shmem_size=0, cooperative_launch=False)
        _CONFIGS[key] = cfg
    return cfg


def _compiled(dispatcher, types: tuple):
    """The cuda.core Kernel numba launches for ``types`` on this device, or None (not compiled for exactly
    these types, or a kernel numba launches specially: debug, cooperative, argument extensions)."""
    kernel = dispatcher.overloads.get(types)
    if kernel is None or kernel.debug or kernel.cooperative or kernel.extensions:
        return None
    return kernel._codelibrary.get_cufunc().kernel


def launch(dispatcher, griddim, blockdim, *args) -> None:
    """``dispatcher[griddim, blockdim](*args)`` on the default stream, no dynamic shared memory: the
    arguments are CuPy arrays, numba device arrays and scalars (the kernels' own; NumPy arrays under the
    simulator). Same kernel, same parameters as numba's launch (module docstring)."""
    if not FAST_LAUNCH:
        return dispatcher[griddim, blockdim](*_views(args))
    recs = []
    for a in args:
        rec = _scalar(a) if type(a) in _SCALARS else _array(a)
        if rec is None:
            return dispatcher[griddim, blockdim](*_views(args))
        recs.append(rec)
    key = (id(dispatcher), _device_id(), tuple([r[2] for r in recs]))
    entry = _KERNELS.get(key)
    if entry is None or entry[0] is not dispatcher:  # numba's launch compiles (or loads) the overload
        dispatcher[griddim, blockdim](*_views(args))
        _KERNELS[key] = (dispatcher, _compiled(dispatcher, tuple(r[0] for r in recs)))
        return None
    kernel = entry[1]
    if kernel is None:
        return dispatcher[griddim, blockdim](*_views(args))
    if not _STREAM:
        _STREAM.append(_to_core_stream(0))
    params = [p for r in recs for p in r[1]]
    _core_launch(_STREAM[0], _config(griddim, blockdim), kernel, *params)
    return None
