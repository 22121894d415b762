"""Fitting parameters of density-matrix agents to rollout losses (vfesim.quantum.fit): the chain rule of
every parameter map against central differences in theta, recovery of a known Hamiltonian from sampled
Born outcomes (L-BFGS with the exact gradient), Adam, and the errors."""

import numpy as np
import pytest

import vfesim
from vfesim.config import ConfigError
from vfesim.quantum import QuantumDynamics, Schedule, fit, rollout
from vfesim.quantum.evolve import prepare, step
from vfesim.quantum.fit import PARAMETERS, objective


def _traceless(H):
    d = H.shape[-1]
    return H - np.trace(H, axis1=-2, axis2=-1)[..., None, None] / d * np.eye(d)


def test_every_parameter_map_has_the_exact_gradient():
    """dL/dtheta of all maps (hvec, P1 log-coordinates, log, logit, per-step log dt, shared H) vs central
    differences in theta (h = 1e-6, 1e-7 relative)."""
    cfg = vfesim.QuantumConfig(d=2, lambda_belief=0.4)
    st = vfesim.random_state(cfg, 3, seed=3)
    rng = np.random.default_rng(1)
    dyn = QuantumDynamics(
        coupling_strength=0.4,
        coupling_length=1.2,
        dephasing_rate=[0.2, 0.5, 0.3],
        thermal_rate=0.3,
        gate="soft",
        gate_threshold=0.1,
        gate_width=0.6,
    )
    sched = Schedule(dyn, [0.2, 0.3, 0.25], 3, rng.integers(-1, 2, size=(3, 3)))
    cases = [
        (tuple(p for p in PARAMETERS if p != "hamiltonian"), ()),
        (("hamiltonian", "temperature", "phi"), ("hamiltonian", "temperature", "phi")),
    ]
    for params, shared in cases:
        obj = objective(st, cfg, sched, params, shared=shared, loss={"born": 1.0, "free_energy": 0.2})
        L0, g = obj.fun(obj.theta0)
        for _ in range(2):
            E = rng.normal(size=obj.theta0.shape)
            E /= np.linalg.norm(E)
            h = 1e-6
            fd = (obj.fun(obj.theta0 + h * E)[0] - obj.fun(obj.theta0 - h * E)[0]) / (2 * h)
            assert abs(fd - g @ E) <= 1e-7 * np.linalg.norm(g), (params, fd, g @ E)
    # unpack(theta0) is the starting point
    state, sched0 = obj.unpack(obj.theta0)
    np.testing.assert_allclose(
        state.hamiltonian.values, np.broadcast_to(st.hamiltonian.values.mean(0), (3, 2, 2))
    )


def _synthetic(T=100, dt=0.05, seed=0):
    """Three agents with one known H (d = 2) and different initial states; one Born outcome per agent and
    step sampled from the states of the true rollout."""
    cfg = vfesim.QuantumConfig(d=2, lambda_belief=0.0)
    st = vfesim.random_state(cfg, 3, seed=11)
    H_true = st.hamiltonian.values[0]
    st = st.assign(hamiltonian=(st.hamiltonian.dims, np.broadcast_to(H_true, (3, 2, 2)).copy()))
    dyn = QuantumDynamics(coupling="none")
    P = prepare({k: st[k].values for k in st.data_vars}, cfg, dyn)
    rng = np.random.default_rng(seed)
    rho, ys = st.rho.values, []
    for _ in range(T):
        rho = step(P, rho, dt, dyn)[0]
        p1 = rho[:, 1, 1].real
        ys.append((rng.uniform(size=3) < p1).astype(np.int64))
    return cfg, st, H_true, Schedule(dyn, dt, T, np.array(ys))


def test_fit_recovers_a_known_hamiltonian_with_lbfgs():
    """300 outcomes (T = 100, dt = 0.05, N = 3), start 0.57 away (Frobenius, traceless part): L-BFGS with the
    exact gradient converges to the maximum-likelihood H (loss below the true H's), within 0.3 of H_true
    (the statistical error of 300 outcomes: 0.09 ... 0.27 over data seeds 0-5; the trace of H is not
    identifiable, it only adds a phase). Longer horizons make the likelihood oscillatory in the
    frequencies (basins ~ 2 pi / (T dt) wide): starts this far away then end in other basins."""
    cfg, st, H_true, sched = _synthetic()
    pert = 0.4 * _traceless(vfesim.random_state(cfg, 1, seed=99).hamiltonian.values[0])
    start = st.assign(hamiltonian=(st.hamiltonian.dims, np.broadcast_to(H_true + pert, (3, 2, 2)).copy()))
    res = fit(start, cfg, sched, ("hamiltonian",), "lbfgs", shared=("hamiltonian",), n_iter=60)
    assert res.converged, res.message
    H_fit = res.state.hamiltonian.values
    np.testing.assert_allclose(H_fit, np.broadcast_to(H_fit[0], H_fit.shape), atol=0)  # shared
    err0 = np.linalg.norm(_traceless(pert))
    err = np.linalg.norm(_traceless(H_fit[0] - H_true))
    assert err0 > 0.5 and err < 0.3, (err0, err)
    assert res.loss <= rollout(st, cfg, sched, grad=False).loss
    assert res.loss == pytest.approx(rollout(res.state, cfg, res.schedule, grad=False).loss, rel=1e-14)
    assert res.history.loss.values[0] > res.loss and res.history.attrs["method"] == "lbfgs"


def test_fit_adam_decreases_the_loss():
    cfg, st, H_true, sched = _synthetic(T=30)
    pert = 0.4 * _traceless(vfesim.random_state(cfg, 1, seed=99).hamiltonian.values[0])
    start = st.assign(hamiltonian=(st.hamiltonian.dims, np.broadcast_to(H_true + pert, (3, 2, 2)).copy()))
    res = fit(start, cfg, sched, "hamiltonian", "adam", shared="hamiltonian", n_iter=25, lr=0.05)
    loss = res.history.loss.values
    assert res.n_iter == 25 and not res.converged and loss.size == 26
    assert res.loss < loss[0] - 0.5
    # the first bias-corrected Adam step is theta0 - lr g / (|g| + eps) elementwise
    obj = objective(start, cfg, sched, "hamiltonian", shared="hamiltonian")
    _, g = obj.fun(obj.theta0)
    one = fit(start, cfg, sched, "hamiltonian", "adam", shared="hamiltonian", n_iter=1, lr=0.05)
    expect = obj.unpack(obj.theta0 - 0.05 * g / (np.abs(g) + 1e-8))[0]
    np.testing.assert_allclose(one.state.hamiltonian.values, expect.hamiltonian.values, atol=1e-14)


def test_fit_errors_name_the_key():
    cfg, st, _, sched = _synthetic(T=2)
    with pytest.raises(ConfigError, match="^params:"):
        fit(st, cfg, sched, ("mass",))
    with pytest.raises(ConfigError, match="^method:"):
        fit(st, cfg, sched, method="sgd")
    with pytest.raises(ConfigError, match="^shared:"):
        fit(st, cfg, sched, ("hamiltonian",), shared=("temperature",))
    with pytest.raises(ConfigError, match="^dephasing_rate:"):
        fit(st, cfg, sched, ("dephasing_rate",))  # 0: no log coordinate
    with pytest.raises(ConfigError, match="^coupling_strength:"):
        fit(st, cfg, sched, ("coupling_strength",))
    with pytest.raises(ConfigError, match="^n_iter:"):
        fit(st, cfg, sched, n_iter=0)
