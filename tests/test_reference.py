"""Sanity of the loop oracle itself (tests/reference/loop.py) on closed forms and invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
from conftest import make_obs_config
from reference.loop import (
    aggregate,
    frame,
    kl_gauss,
    reference_attention,
    reference_energy,
    so3_generators,
)

from vfesim import ModelConfig, SparseNeighbours, make_state, random_state
from vfesim.groups import generators

TERMS = ("self", "belief_align", "prior_align", "observation")


def spd(rng: np.random.Generator, K: int) -> np.ndarray:
    A = rng.standard_normal((K, K))
    return A @ A.T + 0.5 * np.eye(K)


def state_from(cfg, mu_q, sigma_q, mu_p=None, sigma_p=None, phi=None, obs=None):
    """A float64 state; priors default to the beliefs, frames to the identity."""
    n = len(mu_q)
    mu_p = mu_q if mu_p is None else mu_p
    sigma_p = sigma_q if sigma_p is None else sigma_p
    phi = np.zeros((n, 3)) if phi is None else phi
    f = lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.float64)
    return make_state(cfg, f(mu_q), f(sigma_q), f(mu_p), f(sigma_p), f(phi), f(obs))


def with_vars(st, **changes):
    """A copy of a state with some variables replaced (same dims)."""
    return st.assign({k: (st[k].dims, v) for k, v in changes.items()})


def test_oracle_generators_match_package_and_algebra():
    for irreps in [(0,), (1,), (4,), (2, 0, 1)]:
        G = so3_generators(irreps)
        np.testing.assert_allclose(G, generators(irreps), atol=1e-14)
        np.testing.assert_allclose(G[0] @ G[1] - G[1] @ G[0], G[2], atol=1e-13)


def test_kl_nonnegative_and_zero_at_equality(rng):
    for K in (1, 3, 6):
        for _ in range(20):
            mu_a, mu_b = rng.standard_normal(K), rng.standard_normal(K)
            S_a, S_b = spd(rng, K), spd(rng, K)
            assert kl_gauss(mu_a, S_a, mu_b, S_b) >= 0
            assert abs(kl_gauss(mu_a, S_a, mu_a, S_a)) < 1e-12


def test_kl_1d_closed_form():
    # KL(N(m1, s1^2) || N(m2, s2^2)) = ln(s2/s1) + (s1^2 + (m1-m2)^2)/(2 s2^2) - 1/2
    m1, s1, m2, s2 = 0.3, 0.7, -1.1, 1.9
    want = math.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5
    got = kl_gauss(np.array([m1]), np.array([[s1**2]]), np.array([m2]), np.array([[s2**2]]))
    assert got == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_two_agents_identity_frames(rng, aggregator):
    """phi = 0, Sigma_1 = Sigma_2 = Sigma: each KL is 1/2 d^T Sigma^-1 d (tests/README.md, system 1)."""
    K = 3
    cfg = ModelConfig(K=K, lambda_self=0.0, lambda_belief=1.7, aggregator=aggregator, kappa_beta=0.4)
    S = spd(rng, K)
    mu = rng.standard_normal((2, K))
    st = state_from(cfg, mu, np.stack([S, S]))
    d = mu[0] - mu[1]
    want = 1.7 * 2 * 0.5 * d @ np.linalg.solve(S, d)
    terms = reference_energy(st, cfg)
    assert terms["belief_align"] == pytest.approx(want, rel=1e-13)
    assert terms["self"] == 0.0 and terms["prior_align"] == 0.0 and terms["observation"] == 0.0
    assert terms["total"] == pytest.approx(want, rel=1e-13)
    np.testing.assert_array_equal(reference_attention(st, cfg), [[0.0, 1.0], [1.0, 0.0]])


def test_self_term_isotropic_closed_form():
    """q = N(m, a I), p = N(m, b I): KL = K/2 (a/b - 1 - ln(a/b)) per agent (system 2)."""
    K, n, a, b = 5, 3, 0.6, 1.5
    cfg = ModelConfig(K=K, lambda_self=2.0, lambda_belief=0.0)
    mu = np.arange(n * K, dtype=float).reshape(n, K)
    eye = np.broadcast_to(np.eye(K), (n, K, K))
    st = state_from(cfg, mu, a * eye, mu, b * eye)
    want = 2.0 * n * K / 2 * (a / b - 1 - math.log(a / b))
    assert reference_energy(st, cfg)["self"] == pytest.approx(want, rel=1e-13)


def test_observation_closed_form():
    """W = I, R = r I, Sigma = s I, o = mu + delta: 1/2[K ln 2 pi r + K s/r + |delta|^2/r] (system 3)."""
    K, r, s = 3, 0.8, 0.3
    cfg = ModelConfig(K=K, lambda_self=0.0, lambda_belief=0.0, lambda_obs=1.3, W=np.eye(K), R=r * np.eye(K))
    mu = np.array([[0.1, -0.2, 0.3], [1.0, 2.0, 3.0]])
    delta = np.array([[0.5, 0.0, -0.5], [0.0, 0.0, 0.0]])
    st = state_from(cfg, mu, s * np.broadcast_to(np.eye(K), (2, K, K)), obs=mu + delta)
    per = [0.5 * (K * math.log(2 * math.pi * r) + K * s / r + dd @ dd / r) for dd in delta]
    assert reference_energy(st, cfg)["observation"] == pytest.approx(1.3 * sum(per), rel=1e-13)


def test_identical_agents_uniform_attention():
    """All agents equal with equal frames: alignment 0 and beta_ij = 1/(N-1) (system 4)."""
    cfg = ModelConfig(K=3, lambda_prior=1.0)
    n = 4
    mu = np.tile([0.2, -0.1, 0.4], (n, 1))
    S = np.broadcast_to(np.diag([1.0, 2.0, 0.5]), (n, 3, 3))
    phi = np.tile([0.3, 0.1, -0.2], (n, 1))
    st = state_from(cfg, mu, S, phi=phi)
    terms = reference_energy(st, cfg)
    assert abs(terms["belief_align"]) < 1e-13 and abs(terms["prior_align"]) < 1e-13
    want = (np.ones((n, n)) - np.eye(n)) / (n - 1)
    np.testing.assert_allclose(reference_attention(st, cfg), want, atol=1e-15)
    np.testing.assert_allclose(reference_attention(st, cfg, which="prior"), want, atol=1e-15)


def phi_of_rotation(M: np.ndarray, G: np.ndarray) -> np.ndarray:
    """phi (3,) with expm(phi . G) = M for a rotation M (3, 3) by less than pi: project logm(M) on G."""
    L = scipy.linalg.logm(M)
    L = np.real(L)
    phi, *_ = np.linalg.lstsq(G.reshape(3, -1).T, L.ravel(), rcond=None)
    np.testing.assert_allclose(frame(phi, G), M, atol=1e-12)
    return phi


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_global_rotation_invariance(aggregator, side):
    """Left: beliefs and priors -> g (.) with R_i -> g R_i. Right: R_i -> R_i h alone. F unchanged.

    Uses irreps (1, 2): the new frames phi_i' are found from the l = 1 block with logm and, since the
    irreps are representations of SO(3), reproduce g R_i (or R_i h) in every block.
    """
    cfg = ModelConfig(irreps=(1, 2), lambda_prior=0.6, aggregator=aggregator, kappa_beta=0.7, kappa_gamma=1.3)
    st = random_state(cfg, n_agents=5, seed=4, phi_radius=1.0)
    G = so3_generators(cfg.irreps)
    G1 = G[:, :3, :3]
    psi = np.array([0.4, -0.9, 0.5])
    g = frame(psi, G)
    phi = st["phi"].values
    new_phi = []
    for p in phi:
        M = frame(psi, G1) @ frame(p, G1) if side == "left" else frame(p, G1) @ frame(psi, G1)
        new_phi.append(phi_of_rotation(M, G1))
    new_phi = np.array(new_phi)
    for p, q in zip(phi, new_phi, strict=True):
        want = g @ frame(p, G) if side == "left" else frame(p, G) @ g
        np.testing.assert_allclose(frame(q, G), want, atol=1e-12)
    if side == "left":
        rot = {
            "mu_q": st["mu_q"].values @ g.T,
            "mu_p": st["mu_p"].values @ g.T,
            "sigma_q": g @ st["sigma_q"].values @ g.T,
            "sigma_p": g @ st["sigma_p"].values @ g.T,
        }
        moved = with_vars(st, phi=new_phi, **rot)
    else:
        moved = with_vars(st, phi=new_phi)
    a, b = reference_energy(st, cfg), reference_energy(moved, cfg)
    for k in TERMS + ("total",):
        assert b[k] == pytest.approx(a[k], rel=1e-11, abs=1e-12), k
    np.testing.assert_allclose(reference_attention(moved, cfg), reference_attention(st, cfg), atol=1e-12)


def test_attention_rows_dense_and_sparse(small_config, small_state):
    n = small_state.sizes["agent"]
    for which in ("belief", "prior"):
        att = reference_attention(small_state, small_config, which=which)
        np.testing.assert_allclose(att.sum(axis=1), 1.0, rtol=1e-14)
        assert np.all(np.diag(att) == 0) and np.all(att[~np.eye(n, dtype=bool)] > 0)
    lists = [[1, 2], [0], [], [0, 1, 2, 4, 5], [3], [4, 0]]
    cfg = small_config.replace(neighbours=SparseNeighbours.from_lists(lists))
    att = reference_attention(small_state, cfg)
    for i, row in enumerate(lists):
        assert att[i].sum() == pytest.approx(1.0 if row else 0.0, rel=1e-14)
        others = np.setdiff1d(np.arange(n), row)
        assert np.all(att[i, others] == 0)


def test_agent_without_neighbours_contributes_zero(small_config, small_state):
    full = [[j for j in range(6) if j != i] for i in range(6)]
    cut = [row if i != 2 else [] for i, row in enumerate(full)]
    a = reference_energy(small_state, small_config.replace(neighbours=SparseNeighbours.from_lists(full)))
    b = reference_energy(small_state, small_config.replace(neighbours=SparseNeighbours.from_lists(cut)))
    dense = reference_energy(small_state, small_config)
    for k in TERMS + ("total",):
        assert a[k] == pytest.approx(dense[k], rel=1e-14), k
    only2 = [[] for _ in range(6)]
    only2[2] = full[2]
    c = reference_energy(small_state, small_config.replace(neighbours=SparseNeighbours.from_lists(only2)))
    for k in ("belief_align", "prior_align"):
        assert b[k] + c[k] == pytest.approx(a[k], rel=1e-13), k
    empty = small_config.replace(neighbours=SparseNeighbours.from_lists([[]] * 6))
    e = reference_energy(small_state, empty)
    assert e["belief_align"] == 0.0 and e["prior_align"] == 0.0


@pytest.mark.parametrize("kappa", [0.05, 1.0, 20.0])
def test_softmin_below_expected_by_entropy(kappa, rng):
    """sum_j beta_j KL_j - softmin = kappa H(beta) >= 0, per receiver and for the whole term."""
    for _ in range(10):
        kls = rng.exponential(2.0, size=rng.integers(1, 8))
        beta = np.exp(-(kls - kls.min()) / kappa)
        beta /= beta.sum()
        H = -np.sum(beta * np.log(beta))
        e, s = aggregate(kls, kappa, "expected"), aggregate(kls, kappa, "softmin")
        assert s <= e + 1e-14
        assert e - s == pytest.approx(kappa * H, rel=1e-10, abs=1e-13)
    cfg = ModelConfig(K=3, lambda_prior=1.0, kappa_beta=kappa, kappa_gamma=kappa)
    st = random_state(cfg, n_agents=5, seed=2)
    e = reference_energy(st, cfg)
    s = reference_energy(st, cfg.replace(aggregator="softmin"))
    assert s["belief_align"] <= e["belief_align"] and s["prior_align"] <= e["prior_align"]
    assert s["self"] == e["self"]


def test_large_kappa_is_mean_small_kappa_is_min(rng):
    kls = rng.exponential(1.0, size=6)
    assert aggregate(kls, 1e8, "expected") == pytest.approx(kls.mean(), rel=1e-7)
    assert aggregate(kls, 1e-4, "expected") == pytest.approx(kls.min(), rel=1e-9)
    assert aggregate(kls, 1e-4, "softmin") == pytest.approx(kls.min(), rel=1e-9)


def test_jitter_equals_shifted_covariances(small_config, small_state):
    eps = 0.05
    a = reference_energy(small_state, small_config.replace(jitter=eps))
    K = small_config.K
    shifted = with_vars(
        small_state,
        sigma_q=small_state["sigma_q"].values + eps * np.eye(K),
        sigma_p=small_state["sigma_p"].values + eps * np.eye(K),
    )
    b = reference_energy(shifted, small_config)
    for k in TERMS + ("total",):
        assert a[k] == pytest.approx(b[k], rel=1e-14), k


def test_total_and_lambdas(small_config, small_state):
    t = reference_energy(small_state, small_config)
    assert t["total"] == pytest.approx(sum(t[k] for k in TERMS), rel=1e-15)
    assert all(t[k] > 0 for k in TERMS)
    unit = small_config.replace(lambda_self=1.0, lambda_belief=1.0, lambda_prior=1.0, lambda_obs=1.0)
    u = reference_energy(small_state, unit)
    lam = {
        "self": small_config.lambda_self,
        "belief_align": small_config.lambda_belief,
        "prior_align": small_config.lambda_prior,
        "observation": small_config.lambda_obs,
    }
    for k in TERMS:
        assert t[k] == pytest.approx(lam[k] * u[k], rel=1e-14), k


def test_frame_free_form(rng):
    """KL(q_i || Omega_ij q_j) = KL(N(nu_i, Lambda_i) || N(nu_j, Lambda_j)), nu = R^T mu (SPEC §2.3)."""
    cfg = ModelConfig(K=5, lambda_self=0.0)
    st = random_state(cfg, n_agents=3, seed=9, phi_radius=2.5)
    G = so3_generators(cfg.irreps)
    R = [frame(p, G) for p in st["phi"].values]
    mu, S = st["mu_q"].values, st["sigma_q"].values
    nu = [R[i].T @ mu[i] for i in range(3)]
    Lam = [R[i].T @ S[i] @ R[i] for i in range(3)]
    kl = np.array([[kl_gauss(nu[i], Lam[i], nu[j], Lam[j]) for j in range(3)] for i in range(3)])
    beta = reference_attention(st, cfg)
    off = ~np.eye(3, dtype=bool)
    w = np.where(off, np.exp(-kl), 0.0)
    np.testing.assert_allclose(beta, w / w.sum(axis=1, keepdims=True), rtol=1e-12)
    want = np.sum(beta * np.where(off, kl, 0.0))
    assert reference_energy(st, cfg)["belief_align"] == pytest.approx(want, rel=1e-12)


def test_float32_state_is_upcast():
    cfg = make_obs_config(K=3, obs_dim=2, lambda_prior=0.3)
    s64 = random_state(cfg, n_agents=4, seed=5)
    s32 = random_state(cfg, n_agents=4, seed=5, dtype="float32")
    a, b = reference_energy(s64, cfg), reference_energy(s32, cfg)
    for k in TERMS + ("total",):
        assert b[k] == pytest.approx(a[k], rel=1e-5), k
    assert isinstance(b["total"], float)


def test_reference_attention_rejects_unknown_which(small_config, small_state):
    with pytest.raises(ValueError, match="which"):
        reference_attention(small_state, small_config, which="posterior")
