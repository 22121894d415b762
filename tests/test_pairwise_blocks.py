"""The block API of vfesim.pairwise: any split into receiver x sender blocks gives pairwise_dense's result."""

from __future__ import annotations

import numpy as np
import pytest

from vfesim.pairwise import blocks, pairwise_dense


def _features(rng, N, D, scale=1.0):
    A = scale * rng.standard_normal((N, D))
    B = scale * rng.standard_normal((N, D))
    c = rng.standard_normal(N)
    return A, B, c


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("N, block", [(1, 1), (2, 1), (7, 3), (16, 16), (17, 4), (33, 32), (40, 7)])
def test_blocked_equals_dense(rng, N, block, aggregator):
    A, B, c = _features(rng, N, 10)
    ref = pairwise_dense(A, B, c, 0.7, aggregator)
    out = blocks.pairwise_blocked(A, B, c, 0.7, aggregator, block)
    assert out[0] == pytest.approx(ref[0], rel=1e-12, abs=1e-12)
    for a, b in zip(out[1:], ref[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_merge_is_order_independent(rng):
    """Merging sender blocks in any order gives the same statistics (to rounding), large logits too."""
    A, B, c = _features(rng, 12, 6, scale=8.0)
    parts = [blocks.block_stats(A[:5], c[:5], B[s : s + 3], 0.05, 0, s) for s in range(0, 12, 3)]
    fwd = blocks.empty_stats(5, A.dtype)
    for p in parts:
        fwd = blocks.merge_stats(fwd, p)
    rev = blocks.empty_stats(5, A.dtype)
    for p in reversed(parts):
        rev = blocks.merge_stats(p, rev)
    np.testing.assert_array_equal(fwd.m, rev.m)
    np.testing.assert_allclose(fwd.s, rev.s, rtol=1e-13)
    np.testing.assert_allclose(fwd.t, rev.t, rtol=1e-12)
    assert np.isfinite(fwd.s).all() and (fwd.s >= 1.0).all()  # the row max contributes exp(0) = 1


def test_diagonal_block_excludes_self_pairs(rng):
    """A one-agent receiver block against itself has no pair: empty statistics, zero energy and weights."""
    A, B, c = _features(rng, 3, 4)
    st = blocks.block_stats(A[1:2], c[1:2], B[1:2], 1.0, 1, 1)
    assert st.s[0] == 0.0 and st.m[0] == -np.inf
    rows = blocks.finish_rows(st, 1.0, "softmin")
    assert rows.energy[0] == 0.0 and rows.inv_s[0] == 0.0
    gA, gc, gB = blocks.block_grads(A[1:2], c[1:2], B[1:2], rows, 1.0, "softmin", 1, 1)
    assert not gA.any() and not gc.any() and not gB.any()


def test_unknown_aggregator_names_it(rng):
    A, B, c = _features(rng, 4, 3)
    with pytest.raises(ValueError, match="aggregator"):
        blocks.pairwise_blocked(A, B, c, 1.0, "mean", 2)
