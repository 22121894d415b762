"""Integrators (SPEC §2.5): coordinates and adjoints, gradient flow, symplectic schemes, restore, kernels."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_config, random_sym

import vfesim
from vfesim.backends import energy_and_gradient_arrays
from vfesim.dynamics import run_dynamics
from vfesim.gaussian.geometry import (
    fisher_kinetic_theta_grad,
    fisher_metric_theta,
    gradient_flow_update,
    kick_drift,
    retract_spd,
    sigma_to_theta,
    theta_grad,
    theta_to_L,
    theta_to_sigma,
    wrap_phi,
)
from vfesim.groups import expm_so3, generators
from vfesim.integrators import DynamicsError, available, make_integrator

HAMILTONIAN = ("symplectic_euler", "verlet", "ruth3", "pefrl", "riemannian_leapfrog")
ORDER = {"symplectic_euler": 1, "verlet": 2, "ruth3": 3, "pefrl": 4, "riemannian_leapfrog": 2}


def numpy_energy(cfg):
    return lambda arrays: energy_and_gradient_arrays(arrays, cfg, "numpy")


def spd(rng, n, K):
    A = rng.standard_normal((n, K, K))
    return A @ np.swapaxes(A, 1, 2) + K * np.eye(K)


def smooth_system(n=3, seed=0, **kw):
    """A small smooth float64 system with all Gaussian terms on (moderate attention temperature)."""
    cfg = make_config(K=3, lambda_prior=0.5, kappa_beta=2.0, kappa_gamma=2.0, **kw)
    state = vfesim.random_state(cfg, n_agents=n, seed=seed, mu_scale=0.7, phi_radius=0.8)
    return cfg, state


# --- registry and options -----------------------------------------------------------------------
def test_registry_and_bad_options():
    cfg, state = smooth_system()
    assert set(available()) == {"gradient_flow", *HAMILTONIAN}
    with pytest.raises(ValueError, match="'leapfrog'"):
        make_integrator("leapfrog", cfg, 0.1)
    with pytest.raises(ValueError, match="bogus"):
        make_integrator("verlet", cfg, 0.1, bogus=1)
    with pytest.raises(ValueError, match="fixed_point_tol"):
        make_integrator("verlet", cfg, 0.1, fixed_point_tol=1e-9)  # riemannian_leapfrog only
    with pytest.raises(ValueError, match="rule"):
        make_integrator("gradient_flow", cfg, 0.1, rule="sgd")
    with pytest.raises(ValueError, match="friction"):
        make_integrator("gradient_flow", cfg, 0.1, friction=1.0)
    with pytest.raises(ValueError, match="friction"):
        make_integrator("verlet", cfg, 0.1, friction=-1.0)
    with pytest.raises(ValueError, match="mass"):
        make_integrator("verlet", cfg, 0.1, mass={"mu_q": 0.0})
    with pytest.raises(ValueError, match="sigma_x"):
        make_integrator("verlet", cfg, 0.1, mass={"sigma_x": 1.0})
    with pytest.raises(ValueError, match="momenta"):
        make_integrator("pefrl", cfg, 0.1, momenta="thermal")
    with pytest.raises(ValueError, match="step_scale"):
        make_integrator("gradient_flow", cfg, 0.1, step_scale={"phi": -1.0})
    with pytest.raises(ValueError, match="dt"):
        make_integrator("verlet", cfg, 0.0)
    with pytest.raises(ValueError, match="backend"):
        make_integrator("verlet", cfg, 0.1, backend="fortran")


# --- coordinates, retraction, adjoints (central finite differences) ------------------------------
def test_log_cholesky_roundtrip_and_chain_rule(rng):
    K, n = 4, 5
    S = spd(rng, n, K)
    theta = sigma_to_theta(S)
    np.testing.assert_allclose(theta_to_sigma(theta, K), S, rtol=1e-13, atol=1e-13)
    # F(Sigma) = tr(G Sigma) + 1/2 tr((Sigma C)^2) has the symmetric gradient G + C Sigma C.
    G0, C = random_sym(rng, (n, K, K)), random_sym(rng, (n, K, K))

    def F(th):
        Sg = theta_to_sigma(th, K)
        SC = Sg @ C
        return np.einsum("nkl,nkl->", G0, Sg) + 0.5 * np.einsum("nkl,nlk->", SC, SC)

    grad = theta_grad(G0 + C @ S @ C, theta_to_L(theta, K))
    v = rng.standard_normal(theta.shape)
    h = 1e-6
    fd = (F(theta + h * v) - F(theta - h * v)) / (2 * h)
    assert abs(fd - np.vdot(grad, v)) <= 1e-7 * max(1.0, abs(fd))


def test_fisher_metric_and_its_theta_derivative(rng):
    K, n = 3, 4
    theta = sigma_to_theta(spd(rng, n, K))
    v = rng.standard_normal(theta.shape)
    L = theta_to_L(theta, K)
    g = fisher_metric_theta(L)
    # v^T g v = 1/2 tr(S^-1 dS S^-1 dS), dS the derivative of Sigma(theta) along v (central FD).
    h = 1e-6
    dS = (theta_to_sigma(theta + h * v, K) - theta_to_sigma(theta - h * v, K)) / (2 * h)
    Si = np.linalg.inv(theta_to_sigma(theta, K))
    want = 0.5 * np.einsum("nab,nbc,ncd,nda->n", Si, dS, Si, dS)
    np.testing.assert_allclose(np.einsum("na,nab,nb->n", v, g, v), want, rtol=1e-8)
    # d/dtheta (v^T g(theta) v) at fixed v, along random directions.
    w = rng.standard_normal(theta.shape)

    def f(th):
        return np.einsum("na,nab,nb->", v, fisher_metric_theta(theta_to_L(th, K)), v)

    fd = (f(theta + h * w) - f(theta - h * w)) / (2 * h)
    got = np.vdot(fisher_kinetic_theta_grad(L, v), w)
    assert abs(fd - got) <= 1e-7 * max(1.0, abs(fd))


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_retraction_first_order_and_spd(rng, mode):
    n, K = 6, 3
    S, G = spd(rng, n, K), random_sym(rng, (n, K, K))
    dS = {0: -2 * S @ G @ S, 1: -G, 2: G}[mode]
    for eta in (1e-4, 1e-5):
        err = np.abs(retract_spd(S, G, eta, mode) - (S + eta * dS)).max()
        assert err <= 50 * eta**2 * np.abs(dS).max() ** 2 / np.abs(S).max() + 1e-12
    big = retract_spd(S, G, 0.2, mode)  # far outside the linear regime: still SPD
    np.linalg.cholesky(big)
    assert np.abs(big - S).max() > 0.1


def test_phi_principal_ball_keeps_every_irrep_rotation(rng):
    phi = rng.standard_normal((50, 3))
    phi *= (rng.uniform(0.1, 4.5 * np.pi, size=50) / np.linalg.norm(phi, axis=1))[:, None]
    w = wrap_phi(phi)
    assert np.all(np.linalg.norm(w, axis=1) <= np.pi + 1e-12)
    inside = np.linalg.norm(phi, axis=1) <= np.pi
    np.testing.assert_array_equal(w[inside], phi[inside])
    for irreps in ((1,), (0,), (2,), (3,), (4,), (1, 2, 0)):
        G = generators(irreps)
        lmax = max(irreps)
        np.testing.assert_allclose(expm_so3(w, G, lmax), expm_so3(phi, G, lmax), atol=1e-12)


# --- gradient flow -------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_flow_never_increases_F(aggregator, seed):
    cfg = make_config(K=3, lambda_prior=0.7, aggregator=aggregator)
    state = vfesim.random_state(cfg, n_agents=5, seed=seed)
    integ = make_integrator("gradient_flow", cfg, 2e-3)  # priors move by default
    c = integ.init(state)
    F = [c.terms["total"]]
    for _ in range(40):
        c = integ.step(c)
        F.append(c.terms["total"])
    F = np.array(F)
    assert np.all(np.diff(F) <= 1e-12 * np.abs(F[:-1]))
    assert F[-1] < F[0] - 1e-3
    assert not np.array_equal(c.state.mu_p.values, state.mu_p.values)


@pytest.mark.parametrize("rule", ["euclidean", "adam"])
def test_gradient_flow_other_rules_descend(rule):
    cfg, state = smooth_system(n=4, seed=3)
    integ = make_integrator("gradient_flow", cfg, 1e-3, rule=rule)
    c = integ.init(state)
    F0 = c.terms["total"]
    for _ in range(20):
        c2 = integ.step(c)
        assert c2.terms["total"] <= c.terms["total"] + 1e-12
        c = c2
    assert c.terms["total"] < F0


def _two_agents(mu1, mu2, Sigma, m1, m2, S):
    cfg = make_config(K=3, lambda_self=1.0, lambda_belief=0.8, lambda_prior=0.0)
    z = np.zeros((2, 3))
    st = vfesim.make_state(
        cfg, np.array([mu1, mu2]), np.array([Sigma, Sigma]), np.array([m1, m2]), np.array([S, S]), z
    )
    return cfg, st


def test_two_agent_consensus_closed_form(rng):
    """Two agents, identity frames (phi = 0, frozen), priors frozen, equal covariances.

    (a) Covariances frozen too (step_scale sigma_q = 0), Sigma_1 = Sigma_2 = Sigma, priors N(m_i, S):
        F = sum_i KL(q_i||p_i) + lam (KL_12 + KL_21), KL_12 = KL_21 = 1/2 d^T Sigma^-1 d (d = mu_1 - mu_2).
        Stationarity: S^-1 (mu_i - m_i) +- 2 lam Sigma^-1 d = 0, hence
        mu_1 + mu_2 = m_1 + m_2 and d = (I + 4 lam S Sigma^-1)^-1 (m_1 - m_2):
        mu_{1,2} = (m_1 + m_2)/2 +- d/2.
    (b) lambda_self = 0, covariances moving: the natural-gradient mean updates are equal and opposite
        while Sigma_1 = Sigma_2 (kept by the swap-and-reflect symmetry), so mu_1 + mu_2 is conserved and
        both means reach the midpoint (mu_1 + mu_2)/2 with F -> 0.
    """
    Sigma, S = spd(rng, 1, 3)[0] / 3, spd(rng, 1, 3)[0] / 3
    m1, m2 = rng.standard_normal(3), rng.standard_normal(3)
    mu1, mu2 = rng.standard_normal(3), rng.standard_normal(3)
    cfg, st = _two_agents(mu1, mu2, Sigma, m1, m2, S)
    lam = cfg.lambda_belief
    final, hist = run_dynamics(
        st, cfg, "gradient_flow", 0.15, 600, record_every=50,
        update_priors=False, update_frames=False, step_scale={"sigma_q": 0.0},
    )  # fmt: skip
    d = np.linalg.solve(np.eye(3) + 4 * lam * S @ np.linalg.inv(Sigma), m1 - m2)
    want = np.array([(m1 + m2 + d) / 2, (m1 + m2 - d) / 2])
    np.testing.assert_allclose(final.mu_q.values, want, atol=1e-9)
    assert np.all(np.diff(hist.energy_total.values) <= 1e-12)

    cfg0 = cfg.replace(lambda_self=0.0)
    final, hist = run_dynamics(
        st, cfg0, "gradient_flow", 0.1, 1000, record_every=1000,
        update_priors=False, update_frames=False,
    )  # fmt: skip
    mid = (mu1 + mu2) / 2
    np.testing.assert_allclose(final.mu_q.values, np.array([mid, mid]), atol=1e-8)
    np.testing.assert_allclose(final.sigma_q.values[0], final.sigma_q.values[1], atol=1e-10)
    np.testing.assert_array_equal(final.phi.values, 0.0)
    assert hist.energy_total.values[-1] < 1e-14


# --- Hamiltonian dynamics ------------------------------------------------------------------------
def _max_energy_error(method, dt, T, cfg, state, **kw):
    integ = make_integrator(method, cfg, dt, seed=3, **kw)
    c = integ.init(state)
    H0, err = c.terms["hamiltonian"], 0.0
    for _ in range(round(T / dt)):
        c = integ.step(c)
        err = max(err, abs(c.terms["hamiltonian"] - H0))
    return err


# dt ranges where the error is well above round-off (~1e-13 here) and in the asymptotic regime.
DTS = {
    "symplectic_euler": (0.04, 0.02, 0.01),
    "verlet": (0.08, 0.04, 0.02),
    "ruth3": (0.08, 0.04, 0.02),
    "pefrl": (0.1, 0.05, 0.025),
    "riemannian_leapfrog": (0.08, 0.04, 0.02),
}


@pytest.mark.parametrize("method", HAMILTONIAN)
def test_energy_error_order(method):
    cfg, state = smooth_system(n=3, seed=0)
    errs = [_max_energy_error(method, dt, 0.8, cfg, state, update_priors=True) for dt in DTS[method]]
    slope = np.polyfit(np.log(DTS[method]), np.log(errs), 1)[0]
    assert min(errs) > 1e-11, errs
    assert abs(slope - ORDER[method]) <= 0.35, (slope, errs)


def _negate_momenta(integ, c):
    aux = {k: (-v if k.startswith("p_") else v.copy()) for k, v in c.aux.items()}
    return integ.restore(c.state, c.step, aux, c.rng_state)


@pytest.mark.parametrize("method", ["verlet", "pefrl", "riemannian_leapfrog"])
def test_time_reversibility(method):
    cfg, state = smooth_system(n=3, seed=1)
    integ = make_integrator(method, cfg, 0.05, seed=1, update_priors=True)
    c0 = integ.init(state)
    c = c0
    for _ in range(20):
        c = integ.step(c)
    assert np.abs(c.state.mu_q.values - c0.state.mu_q.values).max() > 1e-2  # it moved
    c = _negate_momenta(integ, c)
    for _ in range(20):
        c = integ.step(c)
    c = _negate_momenta(integ, c)
    for k in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi"):
        np.testing.assert_allclose(c.state[k].values, c0.state[k].values, rtol=0, atol=1e-10)
    for k in c0.aux:
        np.testing.assert_allclose(c.aux[k], c0.aux[k], rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", HAMILTONIAN)
def test_step_map_is_symplectic(method):
    """Two agents, K = 3: central-FD Jacobian M of (x, p) -> step(x, p); ||M^T J M - J||_max <= 1e-6."""
    cfg = make_config(K=3, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=2, seed=4, mu_scale=0.7)
    kw = {"fixed_point_tol": 1e-15} if method == "riemannian_leapfrog" else {}
    integ = make_integrator(method, cfg, 0.1, seed=2, **kw)
    c0 = integ.init(state)
    keys_x = ("mu_q", "theta_sigma_q", "phi")
    keys_p = ("p_mu_q", "p_sigma_q", "p_phi")
    shapes = [c0.aux[k].shape if k in c0.aux else c0.state[k].shape for k in keys_x]
    sizes = [int(np.prod(s)) for s in shapes]

    def unpack(z):
        parts = np.split(z, np.cumsum(sizes * 2)[:-1])
        xs, ps = parts[:3], parts[3:]
        x = {k: v.reshape(s) for k, v, s in zip(keys_x, xs, shapes, strict=True)}
        aux = {k: v.reshape(s) for k, v, s in zip(keys_p, ps, shapes, strict=True)}
        aux["theta_sigma_q"] = x["theta_sigma_q"]
        st = vfesim.make_state(
            cfg, x["mu_q"], theta_to_sigma(x["theta_sigma_q"], 3), state.mu_p.values, state.sigma_p.values,
            x["phi"],
        )  # fmt: skip
        return st, aux

    def pack(c):
        xs = [c.state.mu_q.values, c.aux["theta_sigma_q"], c.state.phi.values]
        return np.concatenate([a.ravel() for a in xs] + [c.aux[k].ravel() for k in keys_p])

    def flow(z):
        st, aux = unpack(z)
        return pack(integ.step(integ.restore(st, 0, aux, None)))

    z0 = pack(c0)
    n = z0.size
    h = 1e-5
    M = np.empty((n, n))
    for j in range(n):
        e = np.zeros(n)
        e[j] = h
        M[:, j] = (flow(z0 + e) - flow(z0 - e)) / (2 * h)
    half = n // 2
    J = np.block([[np.zeros((half, half)), np.eye(half)], [-np.eye(half), np.zeros((half, half))]])
    assert np.abs(M - np.eye(n)).max() > 1e-3  # a non-trivial map
    assert np.abs(M.T @ J @ M - J).max() <= 1e-6


def test_friction_dissipates_hamiltonian():
    cfg, state = smooth_system(n=4, seed=2)
    integ = make_integrator("verlet", cfg, 0.02, friction=1.0, seed=5)
    c = integ.init(state)
    K0 = c.terms["kinetic"]
    H = [c.terms["hamiltonian"]]
    for _ in range(200):
        c = integ.step(c)
        H.append(c.terms["hamiltonian"])
    H = np.array(H)
    assert np.all(np.diff(H[::10]) < 0)
    assert H[-1] < H[0] - 0.5 * K0


def test_fisher_fixed_point_converges_and_errors_when_it_cannot():
    """The generalized leapfrog's implicit equations are solved: tightening the tolerance from 1e-9 to
    1e-14 changes the trajectory by no more than the looser tolerance allows."""
    cfg, state = smooth_system(n=3, seed=6)
    ends = []
    for tol in (1e-9, 1e-14):
        integ = make_integrator("riemannian_leapfrog", cfg, 0.05, seed=2, fixed_point_tol=tol)
        c = integ.init(state)
        for _ in range(10):
            c = integ.step(c)
        ends.append(c)
    for k in ends[0].aux:
        np.testing.assert_allclose(ends[0].aux[k], ends[1].aux[k], rtol=0, atol=1e-7)
    assert (
        np.abs(
            ends[1].aux["p_sigma_q"]
            - make_integrator("riemannian_leapfrog", cfg, 0.05, seed=2).init(state).aux["p_sigma_q"]
        ).max()
        > 1e-3
    )
    bad = make_integrator("riemannian_leapfrog", cfg, 0.05, seed=2, fixed_point_max_iter=1)
    with pytest.raises(DynamicsError, match="fixed point not converged"):
        bad.step(bad.init(state))


# --- bitwise restore -----------------------------------------------------------------------------
def _copy_carry_parts(c):
    return c.state.copy(deep=True), c.step, {k: v.copy() for k, v in c.aux.items()}, c.rng_state


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize(
    "method,opts",
    [
        ("gradient_flow", {}),
        ("gradient_flow", {"rule": "adam"}),
        ("verlet", {"friction": 0.3}),
        ("pefrl", {"update_priors": True}),
        ("riemannian_leapfrog", {}),
    ],
)
def test_restore_is_bitwise(method, opts, backend):
    cfg, state = smooth_system(n=4, seed=7)
    integ = make_integrator(method, cfg, 0.02, backend=backend, seed=11, **opts)  # the backend's own energy
    c = integ.init(state)
    for _ in range(3):
        c = integ.step(c)
    r = integ.restore(*_copy_carry_parts(c))
    assert r.terms == c.terms
    for _ in range(4):
        c, r = integ.step(c), integ.step(r)
    for k in c.state.data_vars:
        assert np.array_equal(c.state[k].values, r.state[k].values), k
    assert c.aux.keys() == r.aux.keys()
    for k in c.aux:
        assert np.array_equal(c.aux[k], r.aux[k]), k
    assert c.terms == r.terms and c.step == r.step == 7 and c.rng_state == r.rng_state


def test_init_momenta_follow_seed_and_zero_option():
    cfg, state = smooth_system()
    a = make_integrator("verlet", cfg, 0.1, seed=1).init(state)
    b = make_integrator("verlet", cfg, 0.1, seed=1).init(state)
    d = make_integrator("verlet", cfg, 0.1, seed=2).init(state)
    z = make_integrator("verlet", cfg, 0.1, momenta="zero").init(state)
    assert np.array_equal(a.aux["p_mu_q"], b.aux["p_mu_q"]) and a.rng_state == b.rng_state
    assert not np.array_equal(a.aux["p_mu_q"], d.aux["p_mu_q"])
    assert all(not np.any(v) for k, v in z.aux.items() if k.startswith("p_"))
    assert z.terms["kinetic"] == 0.0 and a.terms["kinetic"] > 0


# --- NaN guard -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method,bad_step", [("gradient_flow", 3), ("verlet", 2)])
def test_nan_guard_names_step_agent_variable(method, bad_step):
    cfg, state = smooth_system(n=4)
    base = numpy_energy(cfg)
    calls = {"n": 0}

    def poisoned(arrays):
        terms, grads = base(arrays)
        calls["n"] += 1
        if calls["n"] == 3:  # the force at the end of step 2 (verlet uses it in step 2's last kick)
            grads = dict(grads)
            g = grads["mu_q"].copy()
            g[2, 1] = np.nan
            grads["mu_q"] = g
        return terms, grads

    integ = make_integrator(method, cfg, 0.01, energy=poisoned)
    c = integ.step(integ.init(state))
    with pytest.raises(DynamicsError, match=rf"step {bad_step}: (mu_q|p_mu_q)\[agent=2\]") as e:
        integ.step(integ.step(c))
    assert e.value.step == bad_step and e.value.agent == 2


# --- numba kernel parity -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_numba_gradient_flow_kernel_matches_numpy(rng, mode):
    from vfesim_kernels.update_cpu import gradient_flow_update_cpu

    n, K = 7, 5
    arrays = {
        "mu_q": rng.standard_normal((n, K)), "sigma_q": spd(rng, n, K), "mu_p": rng.standard_normal((n, K)),
        "sigma_p": spd(rng, n, K), "phi": 3.0 * rng.standard_normal((n, 3)),
    }  # fmt: skip
    grads = {
        k: (random_sym(rng, v.shape) if v.ndim == 3 else rng.standard_normal(v.shape))
        for k, v in arrays.items()
    }
    eta = np.array([0.1, 0.05, 0.0, 0.02, 0.3])
    want = gradient_flow_update(arrays, grads, eta, mode)
    keys = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
    out = {k: np.empty_like(arrays[k]) for k in keys}
    gradient_flow_update_cpu(
        *(arrays[k] for k in keys), *(grads[k] for k in keys), eta, mode, *(out[k] for k in keys)
    )
    for k in keys:
        np.testing.assert_allclose(out[k], want[k], rtol=1e-12, atol=1e-13)


def test_numba_kick_drift_kernel_matches_numpy(rng):
    from vfesim_kernels.update_cpu import kick_drift_cpu

    n, K = 6, 4
    x_mu, S = rng.standard_normal((n, K)), spd(rng, n, K)
    theta = sigma_to_theta(S)
    p_mu, p_th = rng.standard_normal((n, K)), rng.standard_normal(theta.shape)
    x_phi, p_phi, g_phi = (rng.standard_normal((n, 3)) for _ in range(3))
    g_mu, g_S = rng.standard_normal((n, K)), random_sym(rng, (n, K, K))
    a = [v.copy() for v in (x_mu, theta, p_mu, p_th)]
    ap = [v.copy() for v in (x_phi, p_phi)]
    S_np = kick_drift(*a, g_mu, g_S, 0.03, 0.07, 0.5, 2.0, ap[0], ap[1], g_phi, 1.5, True)
    b = [v.copy() for v in (x_mu, theta, p_mu, p_th)]
    bp = [v.copy() for v in (x_phi, p_phi)]
    S_nb = np.empty_like(S)
    kick_drift_cpu(*b, g_mu, g_S, 0.03, 0.07, 0.5, 2.0, S_nb, bp[0], bp[1], g_phi, 1.5, True)
    for u, w in zip(a + ap + [S_np], b + bp + [S_nb], strict=True):
        np.testing.assert_allclose(w, u, rtol=1e-13, atol=1e-14)
    assert not np.allclose(a[1], theta)


@pytest.mark.parametrize(
    "method,opts",
    [
        ("gradient_flow", {}),
        ("gradient_flow", {"rule": "adam"}),
        ("symplectic_euler", {}),
        ("ruth3", {}),
        ("pefrl", {"update_priors": True}),
    ],
)
def test_numba_backend_matches_numpy_backend(method, opts):
    cfg, state = smooth_system(n=5, seed=8)
    runs = {}
    for backend in ("numpy", "numba"):
        integ = make_integrator(method, cfg, 0.02, backend=backend, energy=numpy_energy(cfg), **opts)
        c = integ.init(state)
        for _ in range(5):
            c = integ.step(c)
        runs[backend] = c
    a, b = runs["numpy"], runs["numba"]
    for k in a.state.data_vars:
        np.testing.assert_allclose(b.state[k].values, a.state[k].values, rtol=1e-11, atol=1e-12)
    for k in a.aux:
        np.testing.assert_allclose(b.aux[k], a.aux[k], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("K", [1, 2, 3, 5, 9])
def test_numba_jacobi_eigh_small_matrices(rng, K):
    from vfesim_kernels.update_cpu import _jacobi_eigh

    cases = [random_sym(rng, (K, K)), np.eye(K) * 2.0, np.diag(np.arange(K, dtype=float))]
    Q = np.linalg.qr(rng.standard_normal((K, K)))[0]
    cases.append(Q @ np.diag(np.r_[np.ones(K - K // 2), 3 * np.ones(K // 2)]) @ Q.T)  # repeated
    for A in cases:
        V, w = np.empty((K, K)), np.empty(K)
        _jacobi_eigh(A.copy(), V, w)
        np.testing.assert_allclose((V * w) @ V.T, A, atol=1e-13)
        np.testing.assert_allclose(V.T @ V, np.eye(K), atol=1e-13)
        np.testing.assert_allclose(np.sort(w), np.linalg.eigvalsh(A), atol=1e-13)
