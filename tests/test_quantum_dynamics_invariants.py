"""Invariants of the dynamics of density-matrix agents (spec/quantum.md §5) not covered by
test_quantum_channels.py / test_quantum_flows.py: gauge covariance of a whole step under local unitaries
W_i (states, Hamiltonians and frames transformed together), the limits eps0 -> 0 (agents decouple),
gamma -> 0 (pure unitary evolution), T -> infinity (maximally mixed priors), dt -> 0 (R1 -> the seed's
first-order rule), and the Newton–Schulz re-orthonormalisation of complex64 propagators (§3.1)."""

import numpy as np
import pytest
import scipy.linalg

import vfesim
from vfesim.quantum.channels import transports
from vfesim.quantum.energy import energy_and_gradient_arrays
from vfesim.quantum.evolve import QuantumDynamics, evolve, prepare, step
from vfesim.quantum.linalg import dagger
from vfesim.quantum.state import _haar_unitaries
from vfesim.quantum.unitary import hamiltonian_eig, newton_schulz, propagator, unitary_step_vjp


def _arrays(cfg, n, seed, **kw):
    st = vfesim.random_state(cfg, n, seed=seed, **kw)
    return st, {k: st[k].values for k in st.data_vars}


def _conj(W, X):
    return W @ X @ dagger(W)


@pytest.mark.parametrize("order", ["jacobi", "gauss_seidel"])
def test_step_is_gauge_covariant_under_local_unitaries(order):
    """rho_i -> W_i rho_i W_i^dag, H_i -> W_i H_i W_i^dag, U_i -> W_i U_i (so U_ij -> W_i U_ij W_j^dag):
    the step commutes with the gauge for C1 coupling, energy-basis dephasing, the thermalising channel
    and the soft gate; computational-basis dephasing (a fixed basis) breaks it."""
    cfg = vfesim.QuantumConfig(d=3)
    _, a = _arrays(cfg, 4, seed=1)
    W = _haar_unitaries(np.random.default_rng(7), 4, 3)
    b = {**a, "rho": _conj(W, a["rho"]), "hamiltonian": _conj(W, a["hamiltonian"])}
    dyn = QuantumDynamics(
        coupling_strength=0.5,
        order=order,
        dephasing_rate=[0.3, 0.6, 0.1, 0.9],
        dephasing_basis="energy",
        thermal_rate=0.4,
        gate="soft",
        gate_threshold=0.2,
        gate_width=0.5,
    )
    gaps = []
    for basis in ("energy", "computational"):
        d = dyn.replace(dephasing_basis=basis)
        P = prepare(a, cfg, d)
        Pw = prepare(b, cfg, d)
        Uw = W @ P.U
        Pw = Pw._replace(U=Uw, M=transports(Uw, np.asarray(P.index)))
        out = step(P, a["rho"], 0.4, d)[0]
        out_w = step(Pw, b["rho"], 0.4, d)[0]
        gaps.append(np.abs(out_w - _conj(W, out)).max())
    assert gaps[0] < 1e-13
    assert gaps[1] > 1e-3


def test_zero_coupling_decouples_agents():
    """eps0 = 0: every agent evolves alone (bitwise-level agreement with one-agent runs); the effect of the
    coupling on an agent is linear in eps0 as eps0 -> 0."""
    cfg = vfesim.QuantumConfig(d=2, lambda_belief=0.0)
    st, a = _arrays(cfg, 3, seed=2)
    dyn = QuantumDynamics(coupling_strength=0.0, dephasing_rate=0.4, thermal_rate=0.1, gate="soft")
    final, _ = evolve(st, cfg, dyn, 0.2, 5)
    for i in range(3):
        alone, _ = evolve(st.isel(agent=[i]), cfg, dyn, 0.2, 5)
        np.testing.assert_allclose(final.rho.values[i], alone.rho.values[0], atol=1e-15)
    effect = []
    for eps0 in (2e-3, 1e-3):
        coupled, _ = evolve(st, cfg, dyn.replace(coupling_strength=eps0), 0.2, 5)
        effect.append(np.abs(coupled.rho.values - final.rho.values).max())
    assert effect[1] > 1e-6
    assert effect[0] / effect[1] == pytest.approx(2.0, rel=0.01)


def test_zero_dephasing_is_pure_unitary_evolution():
    """gamma = 0 (no coupling, no thermalisation): rho(t) = e^{-iHt} rho e^{iHt} with scipy's expm, spectra
    and energies conserved; the deviation at small gamma is linear in gamma."""
    cfg = vfesim.QuantumConfig(d=4, lambda_belief=0.0)
    st, a = _arrays(cfg, 3, seed=3)
    dyn = QuantumDynamics(coupling="none", dephasing_rate=0.0)
    final, hist = evolve(st, cfg, dyn, 0.15, 20)
    rho = final.rho.values
    for i in range(3):
        U = scipy.linalg.expm(-1j * a["hamiltonian"][i] * 3.0)
        np.testing.assert_allclose(rho[i], _conj(U, a["rho"][i]), atol=1e-13)
    np.testing.assert_allclose(np.linalg.eigvalsh(rho), np.linalg.eigvalsh(a["rho"]), atol=1e-14)
    E = lambda r: np.einsum("nkl,nlk->n", a["hamiltonian"], r).real
    np.testing.assert_allclose(E(rho), E(a["rho"]), atol=1e-13)
    np.testing.assert_allclose(hist.agent_purity.values[-1], hist.agent_purity.values[0], atol=1e-14)
    dev = []
    for gamma in (2e-4, 1e-4):
        r, _ = evolve(st, cfg, dyn.replace(dephasing_rate=gamma), 0.15, 20)
        dev.append(np.abs(r.rho.values - rho).max())
    assert dev[1] > 1e-7
    assert dev[0] / dev[1] == pytest.approx(2.0, rel=0.01)


def test_infinite_temperature_gives_maximally_mixed_priors():
    """T -> infinity: sigma_i -> I/d with |sigma_i - I/d| = O(|H|/T); D(rho || sigma) -> log d - S(rho);
    a strong thermalising channel then drives every belief to I/d."""
    cfg = vfesim.QuantumConfig(d=3, lambda_belief=0.0)
    st, a = _arrays(cfg, 4, seed=4)
    errs = []
    for T in (1e4, 2e4):
        b = {**a, "temperature": np.full(4, T)}
        P = prepare(b, cfg, QuantumDynamics(coupling="none"))
        errs.append(np.abs(P.sigma - np.eye(3) / 3).max())
    assert errs[0] < 1e-3
    assert errs[0] / errs[1] == pytest.approx(2.0, rel=1e-3)
    b = {**a, "temperature": np.full(4, 1e9)}
    s = np.linalg.eigvalsh(a["rho"])
    entropy = -(s * np.log(s)).sum(axis=1)
    F = energy_and_gradient_arrays(b, cfg)[0]["self"]
    assert F == pytest.approx((np.log(3) - entropy).sum(), rel=1e-7)
    hot = st.assign(temperature=("agent", np.full(4, 1e9)))
    final, _ = evolve(hot, cfg, QuantumDynamics(coupling="none", thermal_rate=40.0), 1.0, 1)
    np.testing.assert_allclose(final.rho.values, np.broadcast_to(np.eye(3) / 3, (4, 3, 3)), atol=1e-8)


def test_small_dt_reduces_rule_r1_to_the_first_order_rule():
    """dt -> 0: H_bar of R1 -> dt C, C = i[G, rho] (the first-order rule), relative error O(|omega| dt)."""
    rng = np.random.default_rng(5)
    cfg = vfesim.QuantumConfig(d=4)
    _, a = _arrays(cfg, 3, seed=5)
    Z = rng.normal(size=(3, 4, 4)) + 1j * rng.normal(size=(3, 4, 4))
    G = 0.5 * (Z + dagger(Z))
    lam, V = hamiltonian_eig(a["hamiltonian"])
    rho = a["rho"]
    C = 1j * (G @ rho - rho @ G)
    rel = []
    for dt in (1e-2, 5e-3):
        U = propagator(lam, V, dt)
        out = U @ rho @ dagger(U)
        H_bar = unitary_step_vjp(G, rho, out, U, lam, V, dt)[1]
        rel.append(np.linalg.norm(H_bar - dt * C) / np.linalg.norm(dt * C))
    assert rel[0] < 0.05
    assert rel[0] / rel[1] == pytest.approx(2.0, rel=0.05)


def test_newton_schulz_restores_unitarity():
    """One step maps U^dag U = I + E to I + O(E^2) (complex128, E ~ 1e-3); complex64 propagators are
    unitary to 10 d u_32 (spec §5) even from eigenvectors that are orthonormal only to ~1e-4."""
    rng = np.random.default_rng(6)
    n, d = 50, 6
    U0 = _haar_unitaries(rng, n, d)
    Z = rng.normal(size=(n, d, d)) + 1j * rng.normal(size=(n, d, d))
    E = 1e-3 * 0.5 * (Z + dagger(Z)) / np.sqrt(d)
    U = U0 @ (np.eye(d) + E)
    res = lambda X: np.abs(dagger(X) @ X - np.eye(d)).max()
    before, after = res(U), res(newton_schulz(U))
    assert before > 1e-3
    assert after < 5 * before**2
    np.testing.assert_allclose(newton_schulz(U0), U0, atol=1e-14)

    cfg = vfesim.QuantumConfig(d=d)
    _, a = _arrays(cfg, n, seed=6, dtype="complex64")
    lam, V = hamiltonian_eig(a["hamiltonian"])
    Vp = (V + 1e-4 * (rng.normal(size=V.shape) + 1j * rng.normal(size=V.shape))).astype(np.complex64)
    ph = np.exp(-1j * lam * 0.7).astype(np.complex64)
    raw = (Vp * ph[:, None, :]) @ dagger(Vp)
    U32 = propagator(lam, Vp, 0.7)
    assert U32.dtype == np.complex64
    u32 = float(np.finfo(np.float32).eps)
    assert res(raw) > 1e-4
    assert res(U32) <= 10 * d * u32


def test_coupling_does_not_amplify_trace_round_off():
    """C1 with senders normalised to unit trace: complex64, w = 8, eps0 = 0.3, 100 steps keep |tr - 1| at
    round-off (an unnormalised sender multiplies the trace error by prod_k (1 + eps_ik) ~ 1.35 per step)."""
    from vfesim.quantum.channels import causal_window

    cfg = vfesim.QuantumConfig(d=2, lambda_belief=0.0)
    st = vfesim.random_state(cfg, 64, seed=8, dtype="complex64")
    dyn = QuantumDynamics(coupling_strength=0.3, neighbours=causal_window(64, 8), dephasing_rate=0.2)
    final, hist = evolve(st, cfg, dyn, 0.09, 100, record_every=100)
    assert float(hist.system_trace_residual.max()) < 1e-4  # 100 steps x ~1e-7 per step
