"""The float64 tensor-core pair kernels (kernels/cuda/pair_mma.py) and their warp primitives
(kernels/cuda/warp.py) under the CUDA simulator: the fragment layouts against NumPy; the kernels against
the SIMT kernels (an independent implementation of the same contract) and the all-pairs reference, over
receiver ranges, sender slices, partial tiles, padded feature chunks and both aggregators."""

import numpy as np
import pytest
from reference import fragments
from vfesim_kernels import cuda as kc
from vfesim_kernels.cuda import pair_mma
from vfesim_kernels.cuda import pairwise as kp

from vfesim.backends import cuda_backend as cb
from vfesim.pairwise.reference import pairwise_dense


@pytest.mark.parametrize("K", [8, 4])
def test_products_keep_the_ptx_fragment_layout(K):
    A, B, C, want = fragments.products(K)
    out = np.full((16, 8), np.nan)
    fragments.kernels()[K][1, 32](A, B, C, out)
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-14)


def test_quad_sum_and_max_cover_the_four_lanes_of_a_row():
    v = np.random.default_rng(3).normal(size=32)
    out = np.zeros((2, 32))
    fragments.kernels()["quads"][1, 32](v, out)
    quads = v.reshape(8, 4)
    sums = (quads[:, 0] + quads[:, 1]) + (quads[:, 2] + quads[:, 3])
    np.testing.assert_array_equal(out[0], np.repeat(sums, 4))
    np.testing.assert_array_equal(out[1], np.repeat(quads.max(axis=1), 4))


def test_float64_dense_pairs_take_the_tensor_core_kernels():
    k = kc.make_dense_kernels(16, "float64", "softmin")
    assert k["mma"] and (k["threads"], k["per_block"]) == kc.dense_layout(16, "float64")
    assert not kc.make_dense_kernels(16, "float32", "softmin")["mma"]
    assert pair_mma._chunks(16) == (2, 0, 2) and pair_mma._chunks(9) == (1, 1, 2)
    assert pair_mma._chunks(13) == (2, 0, 2)  # (a last chunk of 5 features pads to 8)
    with pytest.raises(ValueError, match="float64"):
        kc.make_dense_kernels(16, "float32", "softmin", mma=True)
    with pytest.raises(ValueError, match="register caps"):
        kc.make_dense_kernels(16, "float64", "softmin", registers=(80, 80))


def _features(N, D, seed):
    rng = np.random.default_rng(seed)
    A = 0.4 * rng.normal(size=(N, D))
    B = 0.4 * rng.normal(size=(N, D))
    c = rng.uniform(0.5, 2.0, N)
    return A, B, c


def _rows(A, c, B, r0, aggregator, mma):
    kp_mma = kp.DENSE_MMA
    try:
        kp.DENSE_MMA = frozenset({"float64"}) if mma else frozenset()
        return cb.pairwise_dense_rows(A, c, B, r0, 0.7, aggregator)
    finally:
        kp.DENSE_MMA = kp_mma


@pytest.mark.parametrize(
    "D, aggregator, r0, NR",
    [
        (16, "softmin", 0, 40),  # all receivers: 3 owner blocks (the last partial), 2 sender slices
        (9, "expected", 0, 40),  # an m16n8k4 chunk for the ninth feature
        (13, "softmin", 11, 21),  # a receiver range off the block grid: the pair i == j moves
    ],
)
def test_tensor_core_pairs_equal_the_simt_kernels_and_the_reference(D, aggregator, r0, NR):
    N = 40
    A, B, c = _features(N, D, seed=D)
    assert kc.dense_splits(NR, N, 0, *reversed(kc.dense_layout(D, "float64")))[0] == 2
    got = _rows(A[r0 : r0 + NR], c[r0 : r0 + NR], B, r0, aggregator, mma=True)
    simt = _rows(A[r0 : r0 + NR], c[r0 : r0 + NR], B, r0, aggregator, mma=False)
    for x, y in zip(got, simt, strict=True):
        assert np.isfinite(x).all()
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14 * np.abs(y).max())
    if NR == N:
        E, gA, gB, gc = pairwise_dense(A, B, c, 0.7, aggregator)
        erow, gA_r, gc_r, gB_c = got
        np.testing.assert_allclose(float(erow.sum()), E, rtol=1e-12)
        for x, y in [(gA_r, gA), (gc_r, gc), (gB_c, gB)]:
            np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-13 * np.abs(y).max())


def test_a_nan_feature_reaches_the_energies_it_touches():
    A, B, c = _features(20, 16, seed=5)
    B[7, 3] = np.nan  # sender 7: every receiver but 7 meets it
    erow, gA, gc, gB = _rows(A, c, B, 0, "softmin", mma=True)
    assert np.isnan(np.delete(erow, 7)).all() and np.isfinite(erow[7])


def test_expected_sums_follow_a_maximum_that_moves_past_underflowed_senders():
    """Senders 0 and 1 (one lane's pair of the first tile) sit 2000 below the others: their weights are 0,
    so that lane's own partial sum stays 0 while the row's maximum moves in the next tile; every lane
    still rescales its part of the row's sums (the SIMT kernels and the reference agree)."""
    N = 16
    A = np.zeros((N, 2))
    A[:, 0] = 1.0
    B = np.zeros((N, 2))
    B[:, 1] = np.linspace(0.1, 1.0, N)
    B[:2, 0] = 2000.0  # KL' = A . B / 2 + c: logit -1000 against the others'
    B[8:, 0] = -5.0  # the second tile of 8 senders: a larger logit, the maximum moves
    c = np.zeros(N)
    got = _rows(A, c, B, 0, "expected", mma=True)
    simt = _rows(A, c, B, 0, "expected", mma=False)
    E, gA, gB, gc = pairwise_dense(A, B, c, 0.7, "expected")
    for x, y in zip(got, simt, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14 * np.abs(y).max())
    np.testing.assert_allclose(got[1], gA, rtol=1e-11, atol=1e-13 * np.abs(gA).max())


def test_a_nan_logit_beside_a_large_maximum_stays_nan():
    """A NaN logit first in its lane's pair, in the tile where the row's maximum jumps by 800: the maximum
    ignores it (as the device's max does) and it reaches the energy as NaN, not an overflow."""
    N = 16
    A = np.zeros((N, 2))
    A[:, 0] = 1.0
    B = np.zeros((N, 2))
    B[:, 1] = 0.3
    B[8:, 0] = -1600.0
    B[8, 0] = np.nan
    got = _rows(A, np.zeros(N), B, 0, "softmin", mma=True)[0]
    assert np.isnan(np.delete(got, 8)).all() and np.isfinite(got[8])


def test_two_groups_and_two_warps_per_block(monkeypatch, request):
    """The device's layout in miniature: two groups of 16 owners per warp and two warps sharing each tile
    of senders (the simulator otherwise runs one of each); two owner blocks, two sender slices. With the
    ``expected`` aggregator, whose sums are a superset of softmin's (30 s of simulation per aggregator;
    both aggregators run the default layout above)."""
    aggregator = "expected"

    def clear():
        kc.make_dense_kernels.cache_clear()
        pair_mma.make_mma_kernels.cache_clear()

    monkeypatch.setattr(pair_mma, "_groups", lambda D: 2)
    monkeypatch.setattr(pair_mma, "MMA_WARPS", 2)
    clear()
    request.addfinalizer(clear)
    N, D = 80, 16
    assert kc.dense_layout(D, "float64") == (64, 64)
    assert kc.dense_splits(N, N, 0, 64, 64)[0] == 2
    A, B, c = _features(N, D, seed=3)
    got = _rows(A, c, B, 0, aggregator, mma=True)
    E, gA, gB, gc = pairwise_dense(A, B, c, 0.7, aggregator)
    erow, gA_r, gc_r, gB_c = got
    np.testing.assert_allclose(float(erow.sum()), E, rtol=1e-12)
    for x, y in [(gA_r, gA), (gc_r, gc), (gB_c, gB)]:
        np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-13 * np.abs(y).max())
