"""vfesim.run_dynamics for density-matrix agents: dispatch to the family's own dynamics (vfesim.quantum.
evolve) with the backend's per-agent stages, and errors naming the option."""

import numpy as np
import pytest

import vfesim
from vfesim.quantum import QuantumDynamics, evolve


@pytest.fixture(scope="module")
def system():
    cfg = vfesim.QuantumConfig(d=2, lambda_prior=0.5)
    return cfg, vfesim.random_state(cfg, n_agents=5, seed=4)


def test_run_dynamics_is_evolve(system):
    cfg, qs = system
    opts = dict(coupling_strength=0.3, dephasing_rate=0.2)
    final, hist = vfesim.run_dynamics(qs, cfg, "channels", dt=0.1, n_steps=3, **opts)
    ref_final, ref_hist = evolve(qs, cfg, QuantumDynamics(**opts), 0.1, 3)
    np.testing.assert_array_equal(final.rho.values, ref_final.rho.values)
    np.testing.assert_array_equal(hist.energy_total.values, ref_hist.energy_total.values)
    assert not np.allclose(final.rho.values, qs.rho.values)  # the state moved


def test_numba_stages_agree(system):
    cfg, qs = system
    a = vfesim.run_dynamics(qs, cfg, "mirror_descent", dt=0.1, n_steps=2, backend="numpy")[1]
    b = vfesim.run_dynamics(qs, cfg, "mirror_descent", dt=0.1, n_steps=2, backend="numba")[1]
    np.testing.assert_allclose(b.energy_total.values, a.energy_total.values, rtol=1e-10)
    assert a.energy_total.values[-1] < a.energy_total.values[0]  # mirror descent lowers F


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(method="leapfrog"), "method"),
        (dict(method="channels", friction=0.1), "friction"),
        (dict(method="channels", coupling_strenght=0.1), "coupling_strenght"),
        (dict(method="channels", backend="dask", neighbours="dense"), "neighbours"),
        (dict(method="channels", backend="torch"), "backend"),
    ],
)
def test_errors_name_the_option(system, kw, match):
    cfg, qs = system
    with pytest.raises(ValueError, match=match):
        vfesim.run_dynamics(qs, cfg, dt=0.1, n_steps=1, **kw)
