"""Field agents under the shared integrators (issue 14 "Dynamics"): F decreases under gradient flow, the
symplectic schemes' energy-error orders, points outside the supports stay put, the one-point grid moves
as the point agents do, numba = numpy, and restore is bitwise."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOL

import vfesim
from vfesim.fields import FieldConfig
from vfesim.integrators import make_integrator

VARS = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
HAMILTONIAN = ("symplectic_euler", "verlet", "ruth3", "pefrl", "riemannian_leapfrog")
ORDER = {"symplectic_euler": 1, "verlet": 2, "ruth3": 3, "pefrl": 4, "riemannian_leapfrog": 2}


def _system(grid=(4, 3), n=4, seed=0, support="bump", **kw):
    """A small smooth float64 field system with every term on (gauge smoothness included)."""
    cfg = FieldConfig(K=3, grid=grid, lambda_prior=0.5, kappa_beta=2.0, kappa_gamma=2.0, lambda_phi=0.3, **kw)
    extent = cfg.n_points * cfg.spacing**cfg.ndim
    opts = {"radius": 1.6} if support == "disc" else {"area": 0.6 * extent}
    st = vfesim.random_state(cfg, n, seed=seed, support=support, mu_scale=0.7, phi_radius=0.8, **opts)
    return cfg, st


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("rule", ["natural", "euclidean"])
def test_gradient_flow_never_increases_F(aggregator, rule):
    cfg, st = _system(aggregator=aggregator, support="disc")
    assert (st.support.values == 0).any()
    _, hist = vfesim.run_dynamics(st, cfg, "gradient_flow", dt=0.01, n_steps=25, rule=rule)
    F = hist.energy_total.values
    assert np.all(np.diff(F) <= 1e-12 * abs(F[0])), F
    assert F[-1] < 0.7 * F[0]
    assert hist.energy_gauge_smoothness.values[0] > 0


def _max_energy_error(method, dt, T, cfg, state):
    integ = make_integrator(method, cfg, dt, seed=3, update_priors=True)
    c = integ.init(state)
    H0, err = c.terms["hamiltonian"], 0.0
    for _ in range(round(T / dt)):
        c = integ.step(c)
        err = max(err, abs(c.terms["hamiltonian"] - H0))
    return err


DTS = {
    "symplectic_euler": (0.02, 0.01, 0.005),
    "verlet": (0.04, 0.02, 0.01),
    "ruth3": (0.04, 0.02, 0.01),
    "pefrl": (0.08, 0.04, 0.02),
    "riemannian_leapfrog": (0.04, 0.02, 0.01),
}


@pytest.mark.parametrize("method", HAMILTONIAN)
def test_symplectic_energy_error_order(method):
    cfg, st = _system(grid=(2, 2), n=3, seed=1)
    errs = [_max_energy_error(method, dt, 0.32, cfg, st) for dt in DTS[method]]
    slope = np.polyfit(np.log(DTS[method]), np.log(errs), 1)[0]
    assert min(errs) > 1e-11, errs
    assert abs(slope - ORDER[method]) <= 0.35, (slope, errs)


@pytest.mark.parametrize(
    "method, opts",
    [
        ("gradient_flow", {}),
        ("gradient_flow", {"rule": "adam"}),
        ("verlet", {"update_priors": True}),
        ("pefrl", {}),
        ("riemannian_leapfrog", {"update_priors": True}),
    ],
)
def test_points_outside_the_supports_do_not_move(method, opts):
    cfg, st = _system(grid=(5, 4), support="disc", seed=2)
    out = st.support.values == 0
    assert out.any() and not out.all()
    integ = make_integrator(method, cfg, 0.02, seed=4, **opts)
    c0 = integ.init(st)
    c = c0
    for _ in range(6):
        c = integ.step(c)
    np.testing.assert_array_equal(c.state.support.values, st.support.values)  # chi is not moved
    for k in VARS:
        a = c.state[k].values
        moving = k not in ("mu_p", "sigma_p") or method == "gradient_flow" or bool(opts.get("update_priors"))
        assert (np.abs(a[~out] - st[k].values[~out]).max() > 1e-6) == moving, k  # covered points moved
        np.testing.assert_array_equal(a[out], c0.state[k].values[out], err_msg=k)
        if k in ("mu_q", "mu_p", "phi") or method == "gradient_flow":
            np.testing.assert_array_equal(a[out], st[k].values[out], err_msg=k)
        else:  # the Cholesky chart re-expresses covariances once, at init
            np.testing.assert_allclose(a[out], st[k].values[out], rtol=1e-14, atol=0, err_msg=k)
    for k, p in c.aux.items():
        if k.startswith("p_"):  # momenta start (and stay) at rest outside the supports
            assert not p[out].any() and p[~out].any(), k


def _one_point(grid=(1,)):
    """A point-agent system and the same agents as fields on a one-point grid (chi = 1)."""
    kw = dict(K=3, lambda_prior=0.5, kappa_beta=2.0, kappa_gamma=2.0)
    pcfg = vfesim.ModelConfig(**kw)
    pst = vfesim.random_state(pcfg, n_agents=4, seed=5, mu_scale=0.7, phi_radius=0.8)
    fcfg = FieldConfig(grid=grid, lambda_phi=1.0, **kw)
    arrays = {k: pst[k].values.reshape(4, *grid, *pst[k].shape[1:]) for k in VARS}
    fst = vfesim.make_state(fcfg, *(arrays[k] for k in VARS), np.ones((4, *grid)))
    return pcfg, pst, fcfg, fst


@pytest.mark.parametrize(
    "method, opts, backend",
    [
        ("gradient_flow", {}, "numpy"),
        ("gradient_flow", {"rule": "adam"}, "numba"),
        ("verlet", {"update_priors": True}, "numpy"),
        ("pefrl", {}, "numba"),
        ("riemannian_leapfrog", {}, "numpy"),
    ],
)
def test_one_point_grid_moves_as_point_agents(method, opts, backend):
    pcfg, pst, fcfg, fst = _one_point()
    run = dict(dt=0.03, n_steps=8, backend=backend, seed=6, **opts)
    pf, ph = vfesim.run_dynamics(pst, pcfg, method, **run)
    ff, fh = vfesim.run_dynamics(fst, fcfg, method, **run)
    for k in VARS:
        np.testing.assert_allclose(ff[k].values[:, 0], pf[k].values, rtol=1e-12, atol=1e-12, err_msg=k)
    for k in ph.data_vars:
        np.testing.assert_allclose(fh[k].values, ph[k].values, rtol=1e-12, atol=1e-12, err_msg=k)
    assert float(np.abs(ff.mu_q.values[:, 0] - pst.mu_q.values).max()) > 1e-3  # it moved


@pytest.mark.parametrize("method", ["gradient_flow", "verlet"])
def test_numba_matches_numpy(method):
    cfg, st = _system(support="disc", seed=3)
    a, ha = vfesim.run_dynamics(st, cfg, method, dt=0.02, n_steps=4, backend="numpy", seed=1)
    b, hb = vfesim.run_dynamics(st, cfg, method, dt=0.02, n_steps=4, backend="numba", seed=1)
    for k in VARS:
        np.testing.assert_allclose(b[k].values, a[k].values, **TOL["float64"], err_msg=k)
    np.testing.assert_allclose(hb.energy_total.values, ha.energy_total.values, **TOL["float64"])
    assert a.x.values.tolist() == st.x.values.tolist() and a.mu_q.dims == st.mu_q.dims  # grid kept


@pytest.mark.parametrize("method", ["gradient_flow", "pefrl"])
def test_restore_is_bitwise(method):
    cfg, st = _system(grid=(6,), support="disc", seed=4)
    opts = {"rule": "adam"} if method == "gradient_flow" else {}
    integ = make_integrator(method, cfg, 0.02, seed=2, **opts)
    c = integ.init(st)
    for _ in range(3):
        c = integ.step(c)
    aux = {k: v.copy() for k, v in c.aux.items()}
    r = integ.restore(c.state.copy(deep=True), c.step, aux, c.rng_state)
    for _ in range(3):
        c, r = integ.step(c), integ.step(r)
    for k in VARS:
        np.testing.assert_array_equal(r.state[k].values, c.state[k].values, err_msg=k)
    assert r.terms == c.terms


def test_float32_fields_move():
    cfg, st = _system(grid=(3, 3))
    st32 = st.astype(np.float32)
    f32, h32 = vfesim.run_dynamics(st32, cfg, "verlet", dt=0.02, n_steps=3, seed=1)
    f64, h64 = vfesim.run_dynamics(st, cfg, "verlet", dt=0.02, n_steps=3, seed=1)
    assert f32.mu_q.dtype == np.float32
    np.testing.assert_allclose(f32.mu_q.values, f64.mu_q.values, **TOL["float32"])


def test_nan_guard_names_step_agent_and_grid_point():
    cfg, st = _system(grid=(3, 2))

    def spoiled(arrays):
        terms, grads = vfesim.backends.energy_and_gradient_arrays(arrays, cfg, "numpy")
        grads["mu_q"] = grads["mu_q"].copy()
        grads["mu_q"][2, 1, 0, 1] = np.nan
        return terms, grads

    with pytest.raises(vfesim.integrators.DynamicsError, match=r"step 1: mu_q\[agent=2\].*x=1, y=0"):
        vfesim.run_dynamics(st, cfg, "gradient_flow", dt=0.01, n_steps=2, energy=spoiled)
