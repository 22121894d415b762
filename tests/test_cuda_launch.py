"""vfesim_kernels.cuda.launch on the CPU: the scalars the cached launches pack (numba's types and ctypes
kinds, as numba's own launcher packs them), what falls back to numba's launch, and that launch. The
launches themselves run on a GPU (tests/test_cuda_gpu.py::test_fast_launches_give_numba_launch_bits)."""

import ctypes

import numpy as np
import pytest
from numba import types
from numba.cuda.typing.typeof import Purpose, typeof
from vfesim_kernels.cuda import launch as L

# numba's _Kernel._prepare_args: integers as ctypes.c_<type>, float64 c_double, float32 c_float, booleans
# as they are
NUMBA_CTYPES = {types.int64: ctypes.c_int64, types.int32: ctypes.c_int32, types.float64: ctypes.c_double}
NUMBA_CTYPES[types.float32] = ctypes.c_float


needs_pieces = pytest.mark.skipif(
    not L.AVAILABLE, reason="the simulator's numba.cuda has no cuda.core launcher"
)


@needs_pieces
@pytest.mark.parametrize(
    "v", [3, -7, 2.5, True, False, np.float64(1.25), np.float32(0.5), np.int64(9), np.int32(-4)]
)
def test_scalars_pack_as_numba_packs_them(v):
    ty, params, token = L._scalar(v)
    assert ty == typeof(v, Purpose.argument) and L._TOKENS[ty] == token
    (p,) = params
    if ty == types.boolean:
        assert p is v
    else:
        assert type(p) is NUMBA_CTYPES[ty] and p.value == v


@needs_pieces
@pytest.mark.parametrize("v", [np.bool_(True), 1 + 2j, np.int16(3), np.complex64(1), "x", None])
def test_other_scalars_take_numbas_launch(v):
    assert L._scalar(v) is None


class _Dispatcher:
    """Records numba-style launches ``d[grid, block](*args)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, config):
        return lambda *args: self.calls.append((config, args))


def test_numbas_launch_where_the_fast_path_is_off(monkeypatch):
    monkeypatch.setattr(L, "FAST_LAUNCH", False)
    k = _Dispatcher()
    x = np.arange(4.0)
    L.launch(k, (3, 2), 128, x, 1.5, 7)
    ((config, args),) = k.calls
    assert config == ((3, 2), 128) and args[0] is x and args[1:] == (1.5, 7)


def test_the_fast_path_is_on_where_numba_cuda_has_its_pieces():
    assert L.FAST_LAUNCH == (L.AVAILABLE and not L.SIMULATOR)
    assert L.AVAILABLE or L.SIMULATOR  # the CPU path (no simulator) checks the pieces import


def test_unknown_arguments_take_numbas_launch(monkeypatch):
    """An argument the fast path does not pack (a NumPy array: no device pointer; a complex scalar) sends
    the whole launch through numba's, arguments as core.launch_view gives them."""
    monkeypatch.setattr(L, "FAST_LAUNCH", True)
    for odd in (np.zeros(3), 1j):
        k = _Dispatcher()
        L.launch(k, 4, 32, odd, 2.0, np.float32(0.5))
        ((config, args),) = k.calls
        assert config == (4, 32) and args[0] is odd and args[1:] == (2.0, np.float32(0.5))
        assert type(args[2]) is np.float32


class _Pointer:
    ptr = 4096


class _ZeroDim:
    """A device array as the fast path detects one (data pointer, CUDA array interface), of no dimension."""

    data = _Pointer()
    shape = ()
    strides = ()
    __cuda_array_interface__ = {"shape": (), "typestr": "<f8", "data": (4096, False), "version": 3}


@needs_pieces
def test_only_device_arrays_of_some_dimension_get_records():
    """Host arrays and NumPy scalars (a buffer, no device pointer) and 0-d device arrays get no record
    (numba's launch takes them); a device array type, once seen, is remembered without its interface
    checks."""
    assert L._array(np.zeros(3)) is None and L._array(np.float64(1.0)) is None and L._array("x") is None
    assert L._array(_ZeroDim()) is None
    assert _ZeroDim in L._ARRAY_KINDS
