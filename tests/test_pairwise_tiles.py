"""The streaming CPU pairwise kernels at tile boundaries: N around the receiver tile (32), the sender tile
(256) and the BLAS tile, with logits spread widely (so that online log-sum-exp merges rescale)."""

from __future__ import annotations

import numpy as np
import pytest
from vfesim_kernels import pairwise_cpu

from vfesim.pairwise import pairwise_dense, pairwise_sparse

NS = [31, 32, 33, 255, 256, 257, 513]


def _features(n, D, seed):
    rng = np.random.default_rng(seed)
    scale = np.geomspace(0.05, 3.0, n)[:, None]  # rows of very different logit spread
    return scale * rng.standard_normal((n, D)), rng.standard_normal((n, D)), 3.0 * rng.standard_normal(n)


@pytest.mark.parametrize("D", [10, 40], ids=["tiled", "blas"])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("n", NS)
def test_dense_kernels_at_tile_boundaries(n, aggregator, D):
    A, B, c = _features(n, D, n)
    ref = pairwise_dense(A, B, c, 0.3, aggregator)
    out = pairwise_cpu.pairwise_dense(A, B, c, 0.3, aggregator)
    assert out[0] == pytest.approx(ref[0], rel=1e-11)
    for a, b in zip(out[1:], ref[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11 * np.abs(b).max())


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("n", [33, 257])
def test_sparse_kernels_with_empty_and_full_rows(n, aggregator):
    A, B, c = _features(n, 10, 1)
    rng = np.random.default_rng(n)
    k = 9
    index = rng.integers(0, n, size=(n, k))
    own = index == np.arange(n)[:, None]
    index[own] = (np.nonzero(own)[0] + 1) % n  # no self-loops
    mask = rng.uniform(size=(n, k)) < 0.7
    mask[0] = False  # a receiver without neighbours
    mask[1] = True
    ref = pairwise_sparse(A, B, c, index, mask, 0.3, aggregator)
    out = pairwise_cpu.pairwise_sparse(A, B, c, index, mask, 0.3, aggregator)
    assert out[0] == pytest.approx(ref[0], rel=1e-11)
    for a, b in zip(out[1:], ref[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11 * np.abs(b).max())
