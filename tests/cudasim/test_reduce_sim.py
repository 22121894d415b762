"""The device reductions (vfesim_kernels.cuda.reduce) under the Numba CUDA simulator: float64 sums and
max |x| against NumPy, for lengths below, at and past one block and the grid's stride."""

import math

import numpy as np
import pytest
from vfesim_kernels.cuda import reduce as red

pytestmark = pytest.mark.cudasim

STRIDE = red.REDUCE_THREADS * red.REDUCE_BLOCKS  # elements per sweep of the first pass


@pytest.mark.parametrize("n", [1, 5, red.REDUCE_THREADS, STRIDE, STRIDE + 3, 7 * STRIDE + 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sum_is_the_float64_sum(n, dtype):
    x = np.random.default_rng(n).standard_normal(n).astype(dtype) * 10.0 ** np.arange(n) % 7
    s = red.device_sum(x)
    assert s.shape == () and s.dtype == np.float64
    exact = math.fsum(x.astype(np.float64))
    assert abs(float(s) - exact) <= 1e-14 * np.abs(x).astype(np.float64).sum()
    assert float(red.device_sum(x)) == float(s)  # the same bits run to run


def test_sum_of_empty_and_of_matrices():
    assert float(red.device_sum(np.zeros((3, 0)))) == 0.0
    m = np.arange(12.0).reshape(3, 4)[:, ::2]  # not contiguous
    assert float(red.device_sum(m)) == m.sum()


@pytest.mark.parametrize("n", [1, 9, STRIDE + 5])
def test_max_abs_matches_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n)
    z = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    x32 = x.astype(np.float32)[::-1]  # not contiguous
    got = red.max_abs([x, z, x32])
    assert got == [np.abs(x).max(), max(np.abs(z.real).max(), np.abs(z.imag).max()), np.abs(x32).max()]


def test_max_abs_of_agent_minor_arrays():
    """Arrays laid out agent-minor (vfesim.arrays.agent_minor: a strided view over one block) and a
    transposed one reduce over their memory, no copy needed; the results are numpy's."""
    from vfesim.arrays import agent_minor

    rng = np.random.default_rng(3)
    z = rng.standard_normal((7, 3, 3)) + 1j * rng.standard_normal((7, 3, 3))
    zm = agent_minor(z)
    assert not zm.flags.c_contiguous and np.array_equal(zm, z)
    assert np.shares_memory(red._memory_flat(zm, np), zm)
    x = rng.standard_normal((5, 4)).T
    got = red.max_abs([zm, x, agent_minor(z.real, axis=1)])
    assert got == [max(np.abs(z.real).max(), np.abs(z.imag).max()), np.abs(x).max(), np.abs(z.real).max()]


def test_max_abs_of_many_arrays_of_mixed_dtypes_and_lengths():
    # runs of one dtype share launches (at most MAX_ABS_ARRAYS arrays each); every result lands in place
    rng = np.random.default_rng(5)
    dtypes = ["float64"] * 8 + ["float32", "float64", "float32", "float32"]
    xs = [
        rng.standard_normal(int(n)).astype(t) * (i + 1)
        for i, (n, t) in enumerate(zip(rng.integers(0, 3 * STRIDE, len(dtypes)), dtypes, strict=True))
    ]
    xs[3] = np.zeros(0)
    xs[9] = np.zeros((4, 0))
    xs[10][-1] = np.nan
    want = [float(np.abs(x).max(initial=0.0)) for x in xs]
    want[10] = math.inf
    assert red.max_abs(xs) == want


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [0, 17, -1])
def test_max_abs_is_inf_for_any_non_finite_entry(bad, at):
    x = np.linspace(-3.0, 2.0, 2 * STRIDE + 1)
    x[at] = bad
    ok = np.ones(4)
    assert red.max_abs([ok, x, np.zeros((2, 0))]) == [1.0, math.inf, 0.0]
    assert red.max_abs([]) == []


def test_sum_refuses_complex_arrays():
    with pytest.raises(TypeError, match="complex128"):
        red.device_sum(np.ones(3, np.complex128))


@pytest.mark.parametrize("S", [1, 2, 5])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fold_slices_adds_in_slice_order(S, dtype):
    """fold_slices: parts[0] + parts[1] + ... per element, the bits of that loop (a fixed order), in place
    into slice 0; other slices untouched."""
    rng = np.random.default_rng(S)
    parts = rng.standard_normal((S, 3, red.REDUCE_THREADS + 3)) * 10.0 ** rng.integers(-8, 8, (S, 1, 1))
    parts = parts.astype(dtype)
    want = parts[0].copy()
    for s in range(1, S):
        want = want + parts[s]
    rest = parts[1:].copy()
    got = red.fold_slices(parts)
    assert np.shares_memory(got, parts)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(parts[0], want)
    np.testing.assert_array_equal(parts[1:], rest)
