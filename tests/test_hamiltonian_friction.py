"""The friction rate of the Hamiltonian schemes: at small dt, dH/dt = -2 gamma KE (SPEC §2.5).

Friction scales the momenta by exp(-gamma t), so the kinetic energy decays at rate 2 gamma while the
conservative part of a step changes H only at O(dt^(order+1)). A test that only checked that H falls
would pass with any damping factor."""

from __future__ import annotations

import pytest

import vfesim
from vfesim.integrators import make_integrator


@pytest.mark.parametrize("gamma", [0.3, 2.0])
@pytest.mark.parametrize("method", ["symplectic_euler", "verlet", "pefrl"])
def test_energy_decays_at_twice_gamma_times_kinetic(method, gamma):
    cfg = vfesim.ModelConfig(K=3, lambda_belief=0.8, lambda_prior=0.3)
    state = vfesim.random_state(cfg, 8, seed=4)
    dt = 1e-5 if method == "symplectic_euler" else 1e-4
    integ = make_integrator(method, cfg, dt, friction=gamma, seed=1, update_priors=True)
    c0 = integ.init(state)
    c1 = integ.step(c0)
    rate = (c1.terms["hamiltonian"] - c0.terms["hamiltonian"]) / dt
    expected = -2.0 * gamma * 0.5 * (c0.terms["kinetic"] + c1.terms["kinetic"])
    assert rate == pytest.approx(expected, rel=1e-3)


def test_zero_friction_conserves_to_the_scheme_order():
    """The same measurement without friction: the change of H per unit time vanishes as dt^2 (Verlet)."""
    cfg = vfesim.ModelConfig(K=3, lambda_belief=0.8)
    state = vfesim.random_state(cfg, 8, seed=4)
    rates = []
    for dt in (1e-3, 5e-4):
        integ = make_integrator("verlet", cfg, dt, seed=1)
        c0 = integ.init(state)
        rates.append(abs(integ.step(c0).terms["hamiltonian"] - c0.terms["hamiltonian"]) / dt)
    assert rates[1] < 0.3 * rates[0] and rates[0] < 1e-3 * c0.terms["kinetic"]
