"""F-flows over beliefs (spec/quantum.md §3.4, §3.5) and evolve() runs (§3, §5 invariants)."""

import numpy as np
import pytest

import vfesim
from vfesim.quantum.channels import causal_window
from vfesim.quantum.energy import energy_and_gradient_arrays
from vfesim.quantum.evolve import QuantumDynamics, evolve
from vfesim.quantum.flows import lie_midpoint_step, mirror_descent_step
from vfesim.quantum.frames import frames, spin_generators


def _setup(n=4, d=3, seed=0, **kw):
    cfg = vfesim.QuantumConfig(d=d, **{"lambda_belief": 0.5, "kappa_beta": 0.7, **kw})
    st = vfesim.random_state(cfg, n, seed=seed)
    return cfg, st, {k: st[k].data for k in st.data_vars}


def _F(arrays, cfg, rho):
    return energy_and_gradient_arrays({**arrays, "rho": rho}, cfg)[0]["total"]


@pytest.mark.parametrize("eta0, backtracks", [(1.0, 30), (0.05, 0)])
def test_mirror_descent_is_monotone_and_stays_in_the_state_space(eta0, backtracks):
    cfg, _, a = _setup(lambda_prior=0.3)
    rho = a["rho"]
    Fs = [_F(a, cfg, rho)]
    for _ in range(15):
        rho, info = mirror_descent_step({**a, "rho": rho}, cfg, eta0=eta0, max_backtracks=backtracks)
        Fs.append(info["F_new"])
        assert info["F_new"] == pytest.approx(_F(a, cfg, rho), abs=1e-12)
        assert np.abs(np.trace(rho, axis1=1, axis2=2) - 1).max() < 1e-13
        assert np.linalg.eigvalsh(rho).min() > 0
    assert (np.diff(Fs) <= 1e-12).all()
    assert Fs[-1] < Fs[0] - 1e-3


def test_mirror_descent_self_term_lands_on_the_prior():
    """lambda_self = 1 alone: eta = 1 maps log rho to log sigma exactly (spec §3.4)."""
    cfg, _, a = _setup(lambda_belief=0.0)
    rho, info = mirror_descent_step(a, cfg, eta0=1.0, max_backtracks=0)
    assert info["eta"] == 1.0
    T = a["temperature"]
    for i in range(rho.shape[0]):
        w, V = np.linalg.eigh(a["hamiltonian"][i])
        p = np.exp(-w / T[i]) / np.exp(-w / T[i]).sum()
        np.testing.assert_allclose(rho[i], (V * p) @ V.conj().T, atol=1e-10)


def test_lie_midpoint_is_isospectral_with_second_order_energy_drift():
    cfg, _, a = _setup(n=3, d=3, seed=4)
    spec0 = np.linalg.eigvalsh(a["rho"])
    F0 = _F(a, cfg, a["rho"])
    drift = []
    for n in (8, 16, 32):
        rho = a["rho"]
        for _ in range(n):
            rho = lie_midpoint_step({**a, "rho": rho}, cfg, 0.8 / n)
        np.testing.assert_allclose(np.linalg.eigvalsh(rho), spec0, atol=1e-13)
        drift.append(abs(_F(a, cfg, rho) - F0))
    orders = np.log2(np.array(drift[:-1]) / np.array(drift[1:]))
    assert (orders >= 1.8).all(), (drift, orders)


def test_evolve_history_and_invariants():
    cfg, st, _ = _setup(n=4, d=3)
    dyn = QuantumDynamics(
        coupling_strength=0.3,
        dephasing_rate=0.5,
        thermal_rate=[0.1, 0.0, 0.2, 0.3],
        gate="soft",
        mirror_steps=1,
    )
    final, hist = evolve(st, cfg, dyn, 0.2, 6, record_every=4)
    assert hist.step.values.tolist() == [0, 4, 6]
    assert hist.agent_purity.dims == ("time", "agent")
    assert (hist.system_trace_residual <= 1e-13).all() and (hist.system_hermiticity_residual <= 1e-14).all()
    assert (hist.system_min_eigenvalue > 0).all() and np.isfinite(hist.system_mirror_eta[1:]).all()
    F = vfesim.quantum.energy.energy_and_gradient_arrays({k: final[k].data for k in final.data_vars}, cfg)[0]
    assert hist.energy_total.values[-1] == pytest.approx(F["total"], rel=1e-12)
    s = np.linalg.eigvalsh(final.rho.values)
    assert hist.agent_entropy.values[-1] == pytest.approx(-(s * np.log(s)).sum(axis=1), rel=1e-12)
    vfesim.validate_state(final, cfg)


def test_evolve_pure_dephasing_has_a_closed_form():
    """No coupling, H diagonal: populations stay, coherences decay as exp(-gamma t) (energy basis = comp.)."""
    cfg, st, a = _setup(n=3, d=3)
    H = np.zeros_like(a["hamiltonian"])
    H[:, [0, 1, 2], [0, 1, 2]] = [0.0, 1.0, 2.5]
    st = st.assign(hamiltonian=(st.hamiltonian.dims, H))
    dyn = QuantumDynamics(coupling="none", dephasing_rate=0.7, dephasing_basis="energy")
    final, _ = evolve(st, cfg, dyn, 0.1, 10)
    t = 1.0
    w = np.diag(H[0]).real
    expect = a["rho"] * np.exp(-1j * (w[:, None] - w[None, :]) * t)
    off = ~np.eye(3, dtype=bool)
    expect[:, off] *= np.exp(-0.7 * t)
    np.testing.assert_allclose(final.rho.values, expect, atol=1e-13)


def test_gauss_seidel_causal_reads_updated_senders():
    cfg, st, _ = _setup(n=3, d=2)
    # eps0 = 1, ell huge: full replacement by the transported nearest earlier sender; dt tiny (no H)
    dyn = QuantumDynamics(
        coupling_strength=1.0, coupling_length=1e12, neighbours=causal_window(3, 1), order="gauss_seidel"
    )
    final, _ = evolve(st, cfg, dyn, 1e-13, 1)
    # agent 2 takes agent 1's *new* state, which is agent 0's: U_21 U_10 rho_0 (..)^dag = U_20 rho_0 U_20^dag

    U = frames(st.phi.values, spin_generators(2), complex)[0]
    M = U[2] @ U[0].conj().T
    np.testing.assert_allclose(final.rho.values[2], M @ st.rho.values[0] @ M.conj().T, atol=1e-8)


def test_evolve_errors():
    cfg, st, _ = _setup(n=3, d=2)
    with pytest.raises(ValueError, match="n_steps"):
        evolve(st, cfg, QuantumDynamics(), 0.1, -1)
    with pytest.raises(ValueError, match="^dt:"):
        evolve(st, cfg, QuantumDynamics(), 0.0, 1)
    with pytest.raises(ValueError, match="dephasing_rate: has 2 rates for 3 agents"):
        evolve(st, cfg, QuantumDynamics(dephasing_rate=[0.1, 0.2]), 0.1, 1)
    bad = st.copy(deep=True)
    bad.rho.values[1, 0, 0] = np.nan
    with pytest.raises(vfesim.StateError, match=r"rho\[agent=1\]"):
        evolve(bad, cfg, QuantumDynamics(coupling="none"), 0.1, 1)
