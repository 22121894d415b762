"""vfesim.arrays on NumPy arrays (the device path runs the reductions of vfesim_kernels.cuda.reduce:
tests/cudasim/test_reduce_sim.py, and on a GPU through every energy of tests/test_cuda_gpu.py)."""

import math

import numpy as np
import pytest

from vfesim import arrays


def test_total_sums_in_float64():
    x = np.full(10_000, 0.1, np.float32)
    assert arrays.total(x) == math.fsum(x.astype(np.float64).tolist())  # float32 accumulation would drift
    assert isinstance(arrays.total(x), float)
    assert arrays.total(np.zeros((3, 0))) == 0.0
    assert arrays.total(np.arange(6.0).reshape(2, 3)[:, ::2]) == 0 + 2 + 3 + 5


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_max_abs(bad):
    x = np.array([1.0, -3.0, 2.0])
    z = np.array([1 - 4j, 2 + 0j], np.complex64)
    y = x.copy()
    y[1] = bad
    assert arrays.max_abs([x, z, y, np.zeros(0)]) == [3.0, 4.0, math.inf, 0.0]
    assert arrays.max_abs([]) == []


def test_agent_minor_layout():
    """agent_minor: the same values, the agent axis of stride one element, copied only when needed;
    empty_agent_minor allocates so; elementwise results keep the layout; max_abs reads such arrays."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 2)) + 1j * rng.standard_normal((6, 3, 2))
    for axis in (0, 1, 2):
        m = arrays.agent_minor(x, axis)
        assert np.array_equal(m, x) and m.strides[axis] == x.itemsize
        assert arrays.agent_minor(m, axis) is m  # already laid out: returned as it is
        e = arrays.empty_agent_minor(np, x.shape, np.float32, axis)
        assert e.shape == x.shape and e.dtype == np.float32 and e.strides[axis] == 4
    m = arrays.agent_minor(x)
    assert (2 * m + 1).strides == m.strides
    assert arrays.max_abs([m]) == [max(np.abs(x.real).max(), np.abs(x.imag).max())]
    bad = m.copy(order="K")
    bad[4, 1, 0] = complex(0, np.nan)
    assert arrays.max_abs([bad]) == [math.inf]


def test_agent_minor_recognises_its_layout_from_strides():
    """agent_minor returns an array already in its layout as it is (a check of shape and strides, no array
    operation) and lays out every other one: C order, views with gaps, axes of length one."""
    rng = np.random.default_rng(1)
    for shape in ((5, 3, 3), (1, 3, 3), (5, 1, 3), (2, 5, 4, 4), (5,), (5, 2)):
        x = rng.standard_normal(shape)
        for axis in range(len(shape)):
            want = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, axis, -1)), -1, axis)
            m = arrays.agent_minor(x, axis)
            assert np.array_equal(m, want) and m.strides == want.strides
            assert arrays.agent_minor(m, axis) is m
            if x.strides != want.strides:  # C order is not this layout (unless the axis is the last)
                assert arrays.agent_minor(x, axis) is not x
        gapped = arrays.agent_minor(rng.standard_normal((2 * shape[0], *shape[1:])))[::2]  # stride 2 items
        m = arrays.agent_minor(gapped)
        assert np.array_equal(m, gapped) and m is not gapped and m.strides[0] == m.itemsize


def test_memory_flat_views_dense_blocks_only():
    """memory_flat: a view of the entries in memory order, indexed by the array's strides in entries, for
    C, F and agent-minor layouts; None for a strided view with gaps."""
    x = np.arange(60.0).reshape(5, 4, 3) * (1 + 2j)
    for a in (x, np.asfortranarray(x), arrays.agent_minor(x), arrays.agent_minor(x, 2)):
        flat, st = arrays.memory_flat(a)
        assert flat.ndim == 1 and np.shares_memory(flat, a) and flat.size == a.size
        for idx in ((0, 0, 0), (4, 3, 2), (2, 1, 0), (3, 0, 2)):
            assert flat[np.dot(idx, st)] == a[idx]
    assert arrays.memory_flat(x[::2]) is None and arrays.memory_flat(x[:, :, 1:]) is None
    assert arrays.memory_flat(x[::-1]) is None


def test_host_array_and_module():
    x = np.ones(3)
    assert arrays.host_array(x) is x and arrays.is_host(x) and arrays.array_module(x) is np
    assert arrays.array_module(1.0) is np


def test_lazy_totals_come_home_in_one_transfer():
    """lazy_total keeps a sum where its array lives (a NumPy float64 here, a 0-d device array on a GPU);
    host_floats turns numbers and such sums into floats, in the dict's order."""
    x = np.full(1000, 0.1, np.float32)
    s = arrays.lazy_total(x)
    assert isinstance(s, np.float64) and float(s) == arrays.total(x)
    got = arrays.host_floats({"b": s, "a": 2, "c": np.float32(0.5), "d": np.asarray(3.0)})
    assert got == {"b": arrays.total(x), "a": 2.0, "c": 0.5, "d": 3.0}
    assert list(got) == ["b", "a", "c", "d"] and all(type(v) is float for v in got.values())


def test_device_constants_are_made_once_per_key():
    made = []

    def make():
        made.append(1)
        return np.ones(2)

    a = arrays.device_constant(np, ("test constant", 1), make)
    assert arrays.device_constant(np, ("test constant", 1), make) is a and len(made) == 1
    assert arrays.device_constant(np, ("test constant", 2), make) is not a and len(made) == 2
