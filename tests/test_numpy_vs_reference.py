"""The numpy backend against the slow per-pair loop oracle (tests/reference/loop.py), float64."""

import numpy as np
import pytest
from reference.loop import reference_attention, reference_energy

import vfesim
from vfesim.gaussian.energy import attention

NEIGHBOURS = {
    "dense": lambda n: "dense",
    "ring": lambda n: vfesim.SparseNeighbours.ring(n, 2),
    "ragged": lambda n: vfesim.SparseNeighbours.from_lists(
        [[(i + 3) % n, (i + 5) % n][: i % 3] for i in range(n)]
    ),
}


@pytest.mark.parametrize("neighbours", list(NEIGHBOURS))
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("irreps", [(1,), (3,), (0, 1, 2)])
def test_energy_terms_match_loop_reference(irreps, aggregator, neighbours):
    n = 11
    rng = np.random.default_rng(7)
    W = rng.normal(size=(2, sum(2 * l + 1 for l in irreps)))
    cfg = vfesim.ModelConfig(
        irreps=irreps,
        lambda_self=0.7,
        lambda_belief=1.3,
        lambda_prior=0.4,
        lambda_obs=0.6,
        kappa_beta=0.6,
        kappa_gamma=1.7,
        aggregator=aggregator,
        neighbours=NEIGHBOURS[neighbours](n),
        W=W,
        R=np.array([[1.0, 0.2], [0.2, 0.5]]),
        jitter=0.05,
    )
    st = vfesim.random_state(cfg, n, seed=3, mu_scale=1.5, phi_radius=2.5)
    ref = reference_energy(st, cfg)
    got, _ = vfesim.energy_and_gradient(st, cfg)
    for k in ref:
        assert got[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-12), k


@pytest.mark.parametrize("which", ["belief", "prior"])
def test_attention_matches_loop_reference(which):
    cfg = vfesim.ModelConfig(K=5, lambda_prior=1.0, kappa_beta=0.5, kappa_gamma=2.0)
    st = vfesim.random_state(cfg, 9, seed=1)
    beta = attention({k: st[k].values for k in st.data_vars}, cfg, which)
    np.testing.assert_allclose(beta, reference_attention(st, cfg, which), rtol=1e-12, atol=1e-15)
