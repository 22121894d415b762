"""The per-pair math of kernels/pair_math.py, as plain Python and as compiled by Numba, against the NumPy
row softmax of vfesim.pairwise.row_weights."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from vfesim_kernels import pair_math as pm

from vfesim.pairwise import row_weights

NAMES = [n for n in pm.__all__ if n not in ("AGG_EXPECTED", "AGG_SOFTMIN", "aggregator_code")]
COMPILED = {n: numba.njit(getattr(pm, n)) for n in NAMES}


def _impl(compiled: bool):
    return (lambda n: COMPILED[n]) if compiled else (lambda n: getattr(pm, n))


def _row_stats(f, L, kappa):
    m, s, t = -np.inf, 0.0, 0.0
    for kl in L:
        m, s, t = f("lse_push")(m, s, t, f("pair_logit")(kl, kappa), kl)
    return m, s, t


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_row_matches_numpy(compiled, aggregator, rng):
    f = _impl(compiled)
    kappa = 0.7
    agg = pm.aggregator_code(aggregator)
    L = rng.uniform(0.0, 30.0, 13)
    m, s, t = _row_stats(f, L, kappa)
    energy, beta, W = row_weights(L[None], np.ones((1, L.size), bool), kappa, aggregator)
    np.testing.assert_allclose(f("row_energy")(m, s, t, kappa, agg), energy[0], rtol=1e-13)
    abar = f("row_abar")(s, t)
    np.testing.assert_allclose(abar, (beta * L).sum(), rtol=1e-13)
    Wk = [f("pair_weight")(kl, m, 1.0 / s, abar, kappa, agg) for kl in L]
    np.testing.assert_allclose(Wk, W[0], rtol=1e-12, atol=1e-15)
    We = [f("pair_weight_e")(math.exp(-kl / kappa - m), kl, 1.0 / s, abar, kappa, agg) for kl in L]
    assert We == Wk


@pytest.mark.parametrize("compiled", [False, True])
def test_merge_equals_one_pass(compiled, rng):
    f = _impl(compiled)
    L = rng.uniform(-5.0, 50.0, 20)
    whole = _row_stats(f, L, 0.3)
    left, right = _row_stats(f, L[:7], 0.3), _row_stats(f, L[7:], 0.3)
    merged = f("lse_merge")(*left, *right)
    np.testing.assert_allclose(merged, whole, rtol=1e-13)
    empty = (-np.inf, 0.0, 0.0)
    assert f("lse_merge")(*empty, *left) == left
    assert f("lse_merge")(*left, *empty) == left


@pytest.mark.parametrize("compiled", [False, True])
def test_empty_row_is_zero(compiled):
    f = _impl(compiled)
    for agg in (pm.AGG_EXPECTED, pm.AGG_SOFTMIN):
        assert f("row_energy")(-np.inf, 0.0, 0.0, 1.0, agg) == 0.0
    assert f("row_abar")(0.0, 0.0) == 0.0


@pytest.mark.parametrize("compiled", [False, True])
def test_pair_kl_and_accumulate(compiled, rng):
    f = _impl(compiled)
    A, B = rng.standard_normal((3, 10)), rng.standard_normal((4, 10))
    c = rng.standard_normal(3)
    kl = f("pair_kl")(0.5 * A, 2, B, 1, 0.5 * c)
    assert kl == pytest.approx(0.5 * (A[2] @ B[1] + c[2]), rel=1e-14)
    assert f("feature_dot")(A, 0, B, 3) == pytest.approx(A[0] @ B[3], rel=1e-14)
    out = np.zeros((2, 10))
    f("accumulate_row")(out, 1, 0.25, B, 2)
    np.testing.assert_array_equal(out, np.stack([np.zeros(10), 0.25 * B[2]]))


def test_compiled_float32_stays_float32():
    """Numba types Python float literals as float64: no function may promote float32 inputs."""
    x = np.float32(0.7)
    A = np.ones((2, 5), np.float32)
    c = np.ones(2, np.float32)
    args = {
        "feature_dot": (A, 0, A, 1),
        "pair_kl": (A, 0, A, 1, c),
        "pair_logit": (x, x),
        "lse_push": (np.float32(-np.inf), x, x, x, x),
        "lse_merge": (x, x, x, x, x, x),
        "row_abar": (x, x),
        "row_energy": (x, x, x, x, pm.AGG_SOFTMIN),
        "pair_weight": (x, x, x, x, x, pm.AGG_EXPECTED),
        "pair_weight_e": (x, x, x, x, x, pm.AGG_EXPECTED),
    }
    for name, a in args.items():
        fn = numba.njit(getattr(pm, name))
        fn(*a)
        (sig,) = fn.nopython_signatures
        rt = sig.return_type
        types = rt.types if isinstance(rt, numba.types.BaseTuple) else (rt,)
        assert all(t == numba.float32 for t in types), (name, rt)


def test_lse_push_first_element_exact():
    m, s, t = pm.lse_push(-math.inf, 0.0, 0.0, -3.5, 7.0)
    assert (m, s, t) == (-3.5, 1.0, 7.0)


def test_unknown_aggregator():
    with pytest.raises(ValueError, match="aggregator"):
        pm.aggregator_code("mean")


def test_lse_push_e_equals_lse_push():
    """With e = exp(-|x - m|) supplied (the CUDA kernels' one exponential per pair), the row statistics
    are those of lse_push, bitwise, from the empty row on."""
    rng = np.random.default_rng(3)
    a = b = (-math.inf, 0.0, 0.0)
    for x, kl in zip(-5 * rng.random(200), 5 * rng.random(200), strict=True):
        a = pm.lse_push(*a, float(x), float(kl))
        b = pm.lse_push_e(*b, float(x), float(kl), math.exp(-abs(float(x) - b[0])), 1.0)
        assert a == b
