"""run_dynamics (SPEC §1): history layout, every method on both CPU backends, argument errors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from conftest import make_config

import vfesim
from vfesim.backends import energy_and_gradient_arrays
from vfesim.dynamics import run_dynamics
from vfesim.integrators import DynamicsError, available, is_hamiltonian

TERMS = ("self", "belief_align", "prior_align", "observation")
# Until the numba energy backend exists, "numba" runs the fused numba update with the numpy energy.
HAVE_NUMBA_ENERGY = importlib.util.find_spec("vfesim.backends.numba_backend") is not None


def _backend_options(backend, cfg):
    if backend == "numba" and not HAVE_NUMBA_ENERGY:
        return {"energy": lambda a: energy_and_gradient_arrays(a, cfg, "numpy")}
    return {}


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("method", available())
def test_history_layout_every_method(method, backend):
    cfg = make_config(K=3, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=5, seed=0)
    final, hist = run_dynamics(
        state, cfg, method, 0.01, 7, record_every=3, backend=backend, seed=1, **_backend_options(backend, cfg)
    )
    np.testing.assert_array_equal(hist.step.values, [0, 3, 6, 7])  # the last step is always kept
    names = {"energy_total", *(f"energy_{t}" for t in TERMS)}
    if is_hamiltonian(method):
        names |= {"energy_kinetic", "energy_hamiltonian"}
        np.testing.assert_allclose(
            hist.energy_hamiltonian, hist.energy_total + hist.energy_kinetic, rtol=1e-14
        )
    assert set(hist.data_vars) == names
    np.testing.assert_allclose(sum(hist[f"energy_{t}"] for t in TERMS), hist.energy_total, rtol=1e-12)
    terms0, _ = vfesim.energy_and_gradient(state, cfg)
    assert hist.energy_total.values[0] == pytest.approx(terms0["total"], rel=1e-12)
    terms, _ = vfesim.energy_and_gradient(final, cfg)
    assert set(final.data_vars) == set(state.data_vars) and final.attrs == state.attrs
    assert not np.array_equal(final.mu_q.values, state.mu_q.values)
    vfesim.validate_state(final, cfg)
    assert np.isfinite(terms["total"])


def test_zero_steps_and_float32():
    cfg = make_config(K=3)
    state = vfesim.random_state(cfg, n_agents=4, seed=2, dtype="float32")
    final, hist = run_dynamics(state, cfg, "verlet", 0.01, 0)
    assert hist.sizes["time"] == 1 and final.mu_q.dtype == np.float32
    final, hist = run_dynamics(state, cfg, "gradient_flow", 0.01, 5)
    assert final.mu_q.dtype == np.float32 and final.sigma_q.dtype == np.float32
    assert hist.energy_total.values[-1] < hist.energy_total.values[0]


def test_bad_arguments():
    cfg = make_config(K=3)
    state = vfesim.random_state(cfg, n_agents=3, seed=0)
    with pytest.raises(ValueError, match="'rk4'"):
        run_dynamics(state, cfg, "rk4", 0.01, 3)
    with pytest.raises(ValueError, match="nonsense"):
        run_dynamics(state, cfg, "verlet", 0.01, 3, nonsense=True)
    with pytest.raises(ValueError, match="record_every"):
        run_dynamics(state, cfg, "verlet", 0.01, 3, record_every=0)
    with pytest.raises(ValueError, match="n_steps"):
        run_dynamics(state, cfg, "verlet", 0.01, -1)


def test_blow_up_is_reported_with_step_agent_variable():
    """An absurd step size drives the Cholesky coordinates to overflow: a DynamicsError, not NaNs."""
    cfg = make_config(K=3, lambda_belief=50.0)
    state = vfesim.random_state(cfg, n_agents=3, seed=0, mu_scale=5.0)
    with pytest.raises(DynamicsError, match=r"step \d+: \w+(\[agent=\d\])?: ") as e:
        run_dynamics(state, cfg, "symplectic_euler", 50.0, 50)
    assert e.value.step >= 1


def test_blow_up_inside_the_energy_names_step_agent_and_variable():
    """A step so large that a covariance fails Cholesky (or its entries overflow: the guard then
    reports that before the energy runs) stops with a DynamicsError."""
    from vfesim.integrators import DynamicsError

    cfg = make_config(K=3, kappa_beta=0.1)
    state = vfesim.random_state(cfg, n_agents=6, seed=0, mu_scale=3.0)
    msg = r"step 1: sigma_q\[agent=\d+\]: (is not positive definite|has \|entry\| .* overflows float64)"
    with pytest.raises(DynamicsError, match=msg):
        run_dynamics(state, cfg, "verlet", 5.0, 20)
