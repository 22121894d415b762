"""Gaussian free energy (numpy backend): finite-difference adjoint checks and invariants."""

import numpy as np
import pytest
import xarray as xr

import vfesim
from vfesim.backends import energy_and_gradient_arrays
from vfesim.gaussian.energy import attention
from vfesim.groups import expm_so3, generators

W_OBS = np.array([[0.9, -0.3, 0.2], [0.1, 0.5, -0.7]])
R_OBS = np.array([[0.8, 0.1], [0.1, 0.6]])

# One configuration per energy term: only that term's lambda is non-zero.
TERM_CONFIGS = {
    "self": dict(lambda_self=1.3, lambda_belief=0.0),
    "belief_align": dict(lambda_self=0.0, lambda_belief=0.9, kappa_beta=0.7),
    "prior_align": dict(lambda_self=0.0, lambda_belief=0.0, lambda_prior=1.1, kappa_gamma=1.4),
    "observation": dict(lambda_self=0.0, lambda_belief=0.0, lambda_obs=0.8, W=W_OBS, R=R_OBS),
}
VARIABLES = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi", "obs")


def _arrays(state):
    return {k: state[k].values.copy() for k in state.data_vars}


def _fd_check(cfg, arrays, var, rng, eps=1e-5):
    """Relative error of <grad, d> against a central difference along a random direction d."""
    _, grads = energy_and_gradient_arrays(arrays, cfg)
    d = rng.standard_normal(arrays[var].shape)
    if var.startswith("sigma"):
        d = d + np.swapaxes(d, 1, 2)
    f = lambda s: energy_and_gradient_arrays({**arrays, var: arrays[var] + s * d}, cfg)[0]["total"]
    fd = (f(eps) - f(-eps)) / (2 * eps)
    an = float((grads[var] * d).sum())
    return abs(fd - an) / max(abs(fd), abs(an), 1e-300), fd


@pytest.mark.parametrize("neighbours", ["dense", "ring", "ragged"])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("term", list(TERM_CONFIGS))
def test_gradient_matches_finite_differences(term, aggregator, neighbours):
    n = 7
    nb = {
        "dense": "dense",
        "ring": vfesim.SparseNeighbours.ring(n, 2),
        "ragged": vfesim.SparseNeighbours.from_lists([[1, 2], [0], [], [1, 2, 4], [5, 6], [0, 3], [2]]),
    }[neighbours]
    cfg = vfesim.ModelConfig(K=3, aggregator=aggregator, neighbours=nb, **TERM_CONFIGS[term])
    arrays = _arrays(vfesim.random_state(cfg, n, seed=11, mu_scale=0.8))
    rng = np.random.default_rng(5)
    for var in VARIABLES:
        if var not in arrays:
            continue
        for _ in range(2):
            err, fd = _fd_check(cfg, arrays, var, rng)
            assert err <= 1e-6, (term, var, err, fd)


@pytest.mark.parametrize("irreps", [(2,), (0, 1), (1, 1, 2)])
def test_gradient_multi_irrep_all_terms(irreps):
    cfg = vfesim.ModelConfig(irreps=irreps, lambda_prior=0.6, kappa_beta=0.5, kappa_gamma=2.0)
    arrays = _arrays(vfesim.random_state(cfg, 5, seed=2, phi_radius=3.0))
    rng = np.random.default_rng(1)
    for var in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi"):
        err, _ = _fd_check(cfg, arrays, var, rng)
        assert err <= 1e-6, (var, err)


def test_gradient_is_symmetric_and_dataset_shaped():
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5)
    state = vfesim.random_state(cfg, 6, seed=0)
    terms, grads = vfesim.energy_and_gradient(state, cfg)
    assert isinstance(grads, xr.Dataset)
    assert set(grads.data_vars) == set(state.data_vars)
    for k in state.data_vars:
        assert grads[k].dims == state[k].dims and grads[k].dtype == state[k].dtype
    for k in ("sigma_q", "sigma_p"):
        g = grads[k].values
        np.testing.assert_array_equal(g, np.swapaxes(g, 1, 2))
    assert terms["total"] == pytest.approx(sum(terms[k] for k in vfesim.gaussian.energy.TERMS))
    assert set(terms) == {"self", "belief_align", "prior_align", "observation", "total"}


def test_kl_zero_at_equality_and_nonnegative():
    cfg = vfesim.ModelConfig(K=5, lambda_belief=0.0)
    st = vfesim.random_state(cfg, 8, seed=3)
    st = st.assign(mu_p=st.mu_q, sigma_p=st.sigma_q)
    terms, grads = vfesim.energy_and_gradient(st, cfg)
    assert abs(terms["self"]) < 1e-12
    assert np.abs(grads.mu_q.values).max() < 1e-12
    st2 = vfesim.random_state(cfg, 8, seed=4)
    assert vfesim.energy_and_gradient(st2, cfg)[0]["self"] > 0


def test_alignment_zero_when_all_agents_agree_after_transport():
    """q_j = Omega_ji q_i for a common base belief: every transported KL vanishes, so F_align = 0."""
    cfg = vfesim.ModelConfig(K=5, lambda_self=0.0)
    st = vfesim.random_state(cfg, 6, seed=1)
    R = expm_so3(st.phi.values, generators(cfg.irreps), 2)
    mu0 = np.array([0.3, -1.0, 0.5, 0.2, 0.9])
    S0 = st.sigma_q.values[0]
    mu = np.einsum("nkl,l->nk", R, mu0)
    S = R @ S0 @ np.swapaxes(R, 1, 2)
    st = st.assign(mu_q=(st.mu_q.dims, mu), sigma_q=(st.sigma_q.dims, 0.5 * (S + np.swapaxes(S, 1, 2))))
    terms, _ = vfesim.energy_and_gradient(st, cfg)
    assert abs(terms["belief_align"]) < 1e-12


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_global_gauge_invariance(aggregator):
    """Rotating every frame and belief by one global g (R_i -> g R_i) leaves F unchanged."""
    cfg = vfesim.ModelConfig(irreps=(1, 2), lambda_prior=0.7, aggregator=aggregator)
    st = vfesim.random_state(cfg, 6, seed=9, phi_radius=1.0)
    G = generators(cfg.irreps)
    rng = np.random.default_rng(3)
    g = expm_so3(rng.normal(size=(1, 3)) * 0.7, G, 2)[0]
    # exp(phi'.G) = g exp(phi.G) has a closed form on the l=1 block (rotation composition); solve for
    # phi' there via the 3x3 matrix logarithm, then check it reproduces g R on every block.
    R = expm_so3(st.phi.values, G, 2)
    gR = g @ R
    from scipy.linalg import logm

    new_phi = []
    G1 = G[:, 0:3, 0:3]  # the l=1 block of irreps (1, 2)
    for M in gR[:, 0:3, 0:3]:
        X = np.real(logm(M))
        new_phi.append([np.sum(X * Ga) / np.sum(Ga * Ga) for Ga in G1])
    new_phi = np.array(new_phi)
    np.testing.assert_allclose(expm_so3(new_phi, G, 2), gR, atol=1e-10)
    rot = lambda m: np.einsum("kl,nl->nk", g, m)
    conj = lambda S: g @ S @ g.T
    st2 = st.assign(
        mu_q=(st.mu_q.dims, rot(st.mu_q.values)),
        mu_p=(st.mu_p.dims, rot(st.mu_p.values)),
        sigma_q=(st.sigma_q.dims, conj(st.sigma_q.values)),
        sigma_p=(st.sigma_p.dims, conj(st.sigma_p.values)),
        phi=(st.phi.dims, new_phi),
    )
    t1, _ = vfesim.energy_and_gradient(st, cfg)
    t2, _ = vfesim.energy_and_gradient(st2, cfg, validate=False)
    for k in t1:
        assert t2[k] == pytest.approx(t1[k], rel=1e-11, abs=1e-11), k


@pytest.mark.parametrize("nb", ["dense", "ring"])
def test_attention_rows_sum_to_one_and_softmin_below_expected(nb):
    neighbours = vfesim.SparseNeighbours.ring(9, 3) if nb == "ring" else "dense"
    cfg = vfesim.ModelConfig(K=3, lambda_self=0.0, neighbours=neighbours)
    st = vfesim.random_state(cfg, 9, seed=6)
    beta = attention(_arrays(st), cfg)
    np.testing.assert_allclose(beta.sum(axis=1), 1.0, rtol=1e-13)
    if nb == "dense":
        np.testing.assert_array_equal(np.diag(beta), 0.0)
    e_exp = vfesim.energy_and_gradient(st, cfg)[0]["belief_align"]
    e_soft = vfesim.energy_and_gradient(st, cfg.replace(aggregator="softmin"))[0]["belief_align"]
    assert e_soft <= e_exp


def test_agent_without_neighbours_contributes_nothing():
    nb = vfesim.SparseNeighbours.from_lists([[1], [], [0, 1]])
    cfg = vfesim.ModelConfig(K=3, lambda_self=0.0, neighbours=nb)
    st = vfesim.random_state(cfg, 3, seed=0)
    terms, grads = vfesim.energy_and_gradient(st, cfg)
    assert np.isfinite(terms["total"])
    # agent 1 receives nothing and sends to agents 0 and 2, so only its own receiver terms vanish
    single = vfesim.ModelConfig(K=3, lambda_self=0.0)
    one = vfesim.random_state(single, 1, seed=0)
    t1, g1 = vfesim.energy_and_gradient(one, single)
    assert t1["total"] == 0.0 and not np.any(g1.mu_q.values)


def test_jitter_is_explicit_and_adds_identity():
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5)
    st = vfesim.random_state(cfg, 4, seed=0)
    eps = 0.25
    shifted = st.assign(sigma_q=st.sigma_q + eps * np.eye(3), sigma_p=st.sigma_p + eps * np.eye(3))
    t_j, g_j = vfesim.energy_and_gradient(st, cfg.replace(jitter=eps))
    t_s, g_s = vfesim.energy_and_gradient(shifted, cfg)
    assert t_j["total"] == pytest.approx(t_s["total"], rel=1e-13)
    np.testing.assert_allclose(g_j.sigma_q.values, g_s.sigma_q.values, rtol=1e-12, atol=1e-14)


def test_float32_matches_float64():
    cfg = vfesim.ModelConfig(K=5, lambda_prior=0.5)
    s64 = vfesim.random_state(cfg, 16, seed=1)
    s32 = s64.astype(np.float32)
    t64, g64 = vfesim.energy_and_gradient(s64, cfg)
    t32, g32 = vfesim.energy_and_gradient(s32, cfg)
    assert g32.mu_q.dtype == np.float32
    assert t32["total"] == pytest.approx(t64["total"], rel=1e-4)
    for k in g64.data_vars:
        scale = np.abs(g64[k].values).max()
        assert np.abs(g32[k].values - g64[k].values).max() <= 1e-3 * scale, k


def test_large_common_offset_keeps_precision():
    """Centring the means removes the cancellation of |nu|^2 terms: a far-away population loses no digits."""
    cfg = vfesim.ModelConfig(K=3, lambda_self=0.0)
    st = vfesim.random_state(cfg, 5, seed=2, phi_radius=0.0)
    far = st.assign(mu_q=st.mu_q + 1e4)
    a = vfesim.energy_and_gradient(st, cfg)[0]["belief_align"]
    b = vfesim.energy_and_gradient(far, cfg)[0]["belief_align"]
    assert b == pytest.approx(a, rel=1e-12)


def _not_spd(s):
    return s.assign(sigma_q=s.sigma_q * 0 - np.eye(3))


def _nan_at_agent_2(s):
    mu_p = s.mu_p.values.copy()
    mu_p[2, 1] = np.nan
    return s.assign(mu_p=(s.mu_p.dims, mu_p))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_not_spd, r"sigma_q\[agent=0\].*positive definite"),
        (_nan_at_agent_2, r"mu_p\[agent=2\].*NaN"),
        (lambda s: s.rename_dims(latent="z"), r"dims"),
        (lambda s: s.drop_vars("phi"), r"phi.*missing"),
    ],
)
def test_bad_state_is_rejected_with_agent_and_variable(mutate, match):
    cfg = vfesim.ModelConfig(K=3)
    st = vfesim.random_state(cfg, 4, seed=0)
    with pytest.raises(vfesim.StateError, match=match):
        vfesim.energy_and_gradient(mutate(st), cfg)


def test_unknown_backend_is_rejected():
    cfg = vfesim.ModelConfig(K=3)
    st = vfesim.random_state(cfg, 3, seed=0)
    with pytest.raises(ValueError, match="backend.*'fortran'"):
        vfesim.energy_and_gradient(st, cfg, backend="fortran")


def test_sparse_config_for_wrong_population_size_is_rejected():
    cfg = vfesim.ModelConfig(K=3, neighbours=vfesim.SparseNeighbours.ring(5, 1))
    st = vfesim.random_state(vfesim.ModelConfig(K=3), 6, seed=0)
    with pytest.raises(vfesim.StateError, match="sparse neighbours for 5"):
        vfesim.energy_and_gradient(st, cfg)
