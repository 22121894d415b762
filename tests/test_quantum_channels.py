"""Channels, unitary steps and their adjoints (spec/quantum.md §3.1, §3.2, §3.6, §4.1, §5).

CPTP by the Choi matrix (PSD, Tr_out Choi = I) for d <= 6; data processing; Gibbs-preserving monotonicity
(with the documented counterexample for computational-basis dephasing under non-diagonal H); unitarity,
energy, spectrum and Gibbs invariance under exp(-iH t); central finite differences (spec §4.3) of every
rule against its own forward map.
"""

import numpy as np
import pytest
from reference.quantum_dynamics import choi, gibbs_state, relative_entropy
from reference.quantum_dynamics import dephase as ref_dephase

from vfesim.config import ConfigError, SparseNeighbours
from vfesim.quantum import channels as ch
from vfesim.quantum import unitary as un
from vfesim.quantum.evolve import QuantumDynamics
from vfesim.quantum.frames import frames, frames_vjp, spin_generators
from vfesim.quantum.lindblad import exact_propagator, jump_operators, kraus_operators, lindblad_evolve

H_STEP = 1e-6
FD_TOL = 1e-7


def _herm(rng, n, d, traceless=False):
    Z = rng.normal(size=(n, d, d)) + 1j * rng.normal(size=(n, d, d))
    E = 0.5 * (Z + Z.conj().swapaxes(1, 2))
    if traceless:
        E -= (np.trace(E, axis1=1, axis2=2) / d)[:, None, None] * np.eye(d)
    return E / np.linalg.norm(E)


def _state(rng, n, d):
    A = rng.normal(size=(n, d, d)) + 1j * rng.normal(size=(n, d, d))
    r = A @ A.conj().swapaxes(1, 2) + 0.1 * np.eye(d)
    return r / np.trace(r, axis1=1, axis2=2).real[:, None, None]


def _ip(G, E):
    return float((G * E.swapaxes(-1, -2)).sum().real) if np.iscomplexobj(G) else float((G * E).sum())


def _fd(f, x, E):
    return (f(x + H_STEP * E) - f(x - H_STEP * E)) / (2 * H_STEP)


def _close(fd, an, scale):
    assert abs(fd - an) <= FD_TOL * max(abs(an), scale), (fd, an)


def _one(f):
    """A map on one d x d matrix from a batched map (batch of 1)."""
    return lambda X: f(X[None])[0]


def _channels(rng, d):
    """name -> single-matrix linear map, every channel implementation of §3.2 and §3.3."""
    H = _herm(rng, 1, d) * 3
    lam, V = un.hamiltonian_eig(H)
    sigma = _state(rng, 1, d)
    W = np.linalg.eigh(_state(rng, 1, d))[1]
    eps = np.array([0.37])
    J = 0.5 * (rng.normal(size=(1, 1, d, d)) + 1j * rng.normal(size=(1, 1, d, d)))
    Ls = jump_operators(H, J, np.array([0.4]))
    P = exact_propagator(H, Ls, 0.3)
    K1 = kraus_operators(H, Ls, 0.2, 1)
    K2 = kraus_operators(H, Ls, 0.2, 2)
    kraus = lambda K: _one(lambda X: (K @ X[:, None] @ K.conj().swapaxes(-1, -2)).sum(axis=1))
    U = un.propagator(lam, V, np.array([0.7]))
    return {
        "dephase": _one(lambda X: ch.dephase(X, eps)),
        "dephase_energy": _one(lambda X: ch.dephase_energy(X, eps, V)),
        "C1": _one(lambda X: ch.mix(X, sigma, eps)),
        "C2": _one(lambda X: ch.pinch_mix(X, W, eps)),
        "thermalise": _one(lambda X: ch.mix(X, un.gibbs(lam, V, np.array([0.8]))[0], eps)),
        "unitary": _one(lambda X: U @ X @ U.conj().swapaxes(-1, -2)),
        "exact": _one(lambda X: (P @ X.reshape(1, d * d, 1)).reshape(1, d, d)),
        "kraus1": kraus(K1),
        "kraus2": kraus(K2),
        "strang": lambda X: lindblad_evolve(X[None], H, 0.3, 1, jumps=J, dephasing_rate=0.4, method="strang")[
            -1, 0
        ],
    }


@pytest.mark.parametrize("d", [2, 3, 6])
def test_every_channel_is_cptp(d):
    rng = np.random.default_rng(d)
    for name, phi in _channels(rng, d).items():
        C = choi(phi, d)
        assert np.abs(C - C.conj().T).max() <= 1e-13, name
        assert np.linalg.eigvalsh(C).min() >= -1e-13, name
        tr_out = np.einsum("kala->kl", C.reshape(d, d, d, d))  # Tr over the output factor
        np.testing.assert_allclose(tr_out, np.eye(d), atol=1e-13, err_msg=name)


def test_channels_hermiticity_trace_positivity_and_dpi():
    rng = np.random.default_rng(7)
    d = 4
    chans = _channels(rng, d)
    for _ in range(5):
        rho, sig = _state(rng, 2, d)
        for name, phi in chans.items():
            a, b = phi(rho), phi(sig)
            assert np.abs(a - a.conj().T).max() <= 1e-14, name
            assert abs(np.trace(a) - 1) <= 1e-13, name
            assert np.linalg.eigvalsh(a).min() >= -1e-13, name
            before, after = relative_entropy(rho, sig, 0.0), relative_entropy(a, b, 0.0)
            if name == "unitary":
                assert after == pytest.approx(before, rel=1e-11)
            else:
                assert after <= before + 1e-12, name


def test_dephasing_matches_oracle_and_lindblad_and_limits():
    rng = np.random.default_rng(3)
    rho = _state(rng, 3, 3)
    eps = ch.dephasing_strength(np.array([0.0, 0.5, 2.0]), 0.4)
    assert eps[0] == 0.0 and eps[1] == pytest.approx(1 - np.exp(-0.2))
    out = ch.dephase(rho, eps)
    np.testing.assert_array_equal(out[0], rho[0])  # eps = 0: identity channel
    for i in range(3):
        np.testing.assert_allclose(out[i], ref_dephase(rho[i], eps[i]), atol=1e-15)
    zero = np.zeros_like(rho)
    via_lindblad = lindblad_evolve(
        rho, zero, 0.4, 1, dephasing_rate=np.array([0.0, 0.5, 2.0]), method="exact"
    )
    np.testing.assert_allclose(via_lindblad[-1], out, atol=1e-13)


def test_gibbs_preserving_monotonicity_and_counterexample():
    rng = np.random.default_rng(11)
    d, n = 3, 200
    H = _herm(rng, n, d) * 4.0
    rho = _state(rng, n, d)
    T = np.full(n, 0.7)
    lam, V = un.hamiltonian_eig(H)
    sigma, l, _ = un.gibbs(lam, V, T)
    eps = np.full(n, 0.6)
    D0 = un.relative_entropy_gibbs(rho, V, l)[0]
    for out in (ch.dephase_energy(rho, eps, V), ch.mix(rho, sigma, eps)):
        assert (un.relative_entropy_gibbs(out, V, l)[0] <= D0 + 1e-12).all()
    np.testing.assert_allclose(ch.dephase_energy(sigma, eps, V), sigma, atol=1e-14)  # sigma is fixed
    # computational-basis dephasing does not fix sigma for non-diagonal H: from equilibrium (D = 0) it
    # raises D(rho || sigma) for every agent (the documented counterexample, spec §3.2)
    D_eq = un.relative_entropy_gibbs(sigma, V, l)[0]
    raised = un.relative_entropy_gibbs(ch.dephase(sigma, eps), V, l)[0]
    assert (np.abs(D_eq) < 1e-10).all() and (raised > 1e-4).all()
    # ... and for diagonal H the two dephasings coincide
    Hd = np.zeros_like(H)
    Hd[:, np.arange(d), np.arange(d)] = rng.normal(size=(n, d)) + 3 * np.arange(d)
    lam_d, V_d = un.hamiltonian_eig(Hd)
    np.testing.assert_allclose(ch.dephase_energy(rho, eps, V_d), ch.dephase(rho, eps), atol=1e-14)


def test_unitary_step_invariants():
    rng = np.random.default_rng(5)
    n, d = 4, 4
    H = _herm(rng, n, d) * 5
    rho = _state(rng, n, d)
    lam, V = un.hamiltonian_eig(H)
    T = np.full(n, 0.9)
    sigma, l, _ = un.gibbs(lam, V, T)
    t = np.array([0.0, 0.1, 1.0, 7.0])
    U = un.propagator(lam, V, t)
    assert np.abs(U.conj().swapaxes(1, 2) @ U - np.eye(d)).max() <= 1e-13
    import scipy.linalg

    for i in range(n):
        np.testing.assert_allclose(U[i], scipy.linalg.expm(-1j * H[i] * t[i]), atol=1e-13)
    out = rho
    for _ in range(100):
        out = un.unitary_step(out, U)
    np.testing.assert_allclose(np.linalg.eigvalsh(out), np.linalg.eigvalsh(rho), atol=1e-13)
    energy = lambda r: np.einsum("nkl,nlk->n", H, r).real
    np.testing.assert_allclose(energy(out), energy(rho), atol=1e-12)
    np.testing.assert_allclose(
        un.relative_entropy_gibbs(out, V, l)[0], un.relative_entropy_gibbs(rho, V, l)[0], atol=1e-12
    )
    for i in range(n):
        np.testing.assert_allclose(sigma[i], gibbs_state(H[i], T[i]), atol=1e-13)


# ------------------------------------------------------------------------------- adjoints (§4.3)


@pytest.mark.parametrize("d", [2, 4])
def test_channel_adjoints_fd(d):
    rng = np.random.default_rng(20 + d)
    n = 3
    rho, sigma = _state(rng, n, d), _state(rng, n, d)
    H = _herm(rng, n, d) * 3
    lam, V = un.hamiltonian_eig(H)
    W = np.linalg.eigh(_state(rng, n, d))[1]
    eps = rng.uniform(0.1, 0.9, n)
    Rb = _herm(rng, n, d)
    L = lambda out: _ip(Rb, out)
    E, Et, e = _herm(rng, n, d), _herm(rng, n, d, traceless=True), rng.normal(size=n)

    rb, eb = ch.dephase_vjp(Rb, rho, eps)
    _close(_fd(lambda r: L(ch.dephase(r, eps)), rho, E), _ip(rb, E), np.linalg.norm(rb))
    _close(_fd(lambda x: L(ch.dephase(rho, x)), eps, e), eb @ e, np.linalg.norm(eb))

    rb, eb, Hb = ch.dephase_energy_vjp(Rb, rho, eps, V, lam)
    f = lambda Hx: L(ch.dephase_energy(rho, eps, un.hamiltonian_eig(Hx)[1]))
    _close(_fd(f, H, E), _ip(Hb, E), np.linalg.norm(Hb))
    _close(_fd(lambda r: L(ch.dephase_energy(r, eps, V)), rho, E), _ip(rb, E), np.linalg.norm(rb))
    _close(_fd(lambda x: L(ch.dephase_energy(rho, x, V)), eps, e), eb @ e, np.linalg.norm(eb))

    rb, sb, eb = ch.mix_vjp(Rb, rho, sigma, eps)
    _close(_fd(lambda r: L(ch.mix(r, sigma, eps)), rho, E), _ip(rb, E), np.linalg.norm(rb))
    _close(_fd(lambda s: L(ch.mix(rho, s, eps)), sigma, E), _ip(sb, E), np.linalg.norm(sb))
    _close(_fd(lambda x: L(ch.mix(rho, sigma, x)), eps, e), eb @ e, np.linalg.norm(eb))

    rb, eb = ch.pinch_mix_vjp(Rb, rho, W, eps)
    _close(_fd(lambda r: L(ch.pinch_mix(r, W, eps)), rho, E), _ip(rb, E), np.linalg.norm(rb))
    _close(_fd(lambda x: L(ch.pinch_mix(rho, W, x)), eps, e), eb @ e, np.linalg.norm(eb))

    # R1 in rho, H and t
    t = rng.uniform(0.2, 1.5, n)
    U = un.propagator(lam, V, t)
    out = un.unitary_step(rho, U)
    rb, Hb, tb = un.unitary_step_vjp(Rb, rho, out, U, lam, V, t)
    fU = lambda r, Hx, tx: L(un.unitary_step(r, un.propagator(*un.hamiltonian_eig(Hx), tx)))
    _close(_fd(lambda r: fU(r, H, t), rho, Et), _ip(rb, Et), np.linalg.norm(rb))
    _close(_fd(lambda Hx: fU(rho, Hx, t), H, E), _ip(Hb, E), np.linalg.norm(Hb))
    _close(_fd(lambda tx: fU(rho, H, tx), t, e), tb @ e, np.linalg.norm(tb))

    # Gibbs priors and the gate's relative entropy D(x || sigma(H, T)), through the soft gate
    T = rng.uniform(0.5, 2.0, n)
    Lb = _herm(rng, n, d)

    def gate_loss(r, Hx, Tx):
        lm, Vx = un.hamiltonian_eig(Hx)
        s, l, _ = un.gibbs(lm, Vx, Tx)
        g = un.soft_gate(un.relative_entropy_gibbs(r, Vx, l)[0], 0.3, 0.7)
        return _ip(Rb, s) + float(g @ e)

    s, l, p = un.gibbs(lam, V, T)
    D, cache = un.relative_entropy_gibbs(rho, V, l)
    g = un.soft_gate(D, 0.3, 0.7)
    rb, lsb = un.relative_entropy_gibbs_vjp(un.soft_gate_vjp(e, g, 0.7), cache, rho.dtype)
    Hb, Tb = un.gibbs_vjp(Rb, lsb, lam, V, T, s, l, p)
    _close(_fd(lambda r: gate_loss(r, H, T), rho, Et), _ip(rb, Et), np.linalg.norm(rb))
    _close(_fd(lambda Hx: gate_loss(rho, Hx, T), H, E), _ip(Hb, E), np.linalg.norm(Hb))
    _close(_fd(lambda Tx: gate_loss(rho, H, Tx), T, e), Tb @ e, np.linalg.norm(Tb))
    assert Lb.shape == (n, d, d)


def test_coupling_geometry_and_transport_adjoints():
    rng = np.random.default_rng(31)
    n, d = 4, 3
    index, mask = ch.coupling_window(n, "dense")
    assert index.tolist() == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]] and mask.all()
    cw = ch.causal_window(n, 2)
    assert cw.index[3].tolist() == [2, 1] and not cw.mask[0].any() and cw.mask[1].tolist() == [True, False]
    pos = rng.normal(size=(n, 2))
    dist = ch.pair_distances(index, mask, pos)
    assert dist[0, 1] == pytest.approx(np.linalg.norm(pos[0] - pos[2]))
    assert ch.pair_distances(index, mask)[3].tolist() == [3.0, 2.0, 1.0]
    eb = rng.normal(size=index.shape)
    g0, gl = ch.coupling_strengths_vjp(eb, 0.4, 1.3, dist, mask)
    f = lambda e0, ell: float((ch.coupling_strengths(e0, ell, dist, mask) * eb).sum())
    _close((f(0.4 + H_STEP, 1.3) - f(0.4 - H_STEP, 1.3)) / (2 * H_STEP), g0, 1.0)
    _close((f(0.4, 1.3 + H_STEP) - f(0.4, 1.3 - H_STEP)) / (2 * H_STEP), gl, 1.0)
    # transports U_ij = U_i U_j^dag and frames (R2): phi_bar of L = Re tr(Mb^dag M(phi))
    J = spin_generators(d)
    phi = rng.normal(size=(n, 3))
    Mb = rng.normal(size=(n, 3, d, d)) + 1j * rng.normal(size=(n, 3, d, d))
    L = lambda ph: float(
        np.einsum("nwkl,nwkl->", Mb.conj(), ch.transports(frames(ph, J, complex)[0], index)).real
    )
    U, cache = frames(phi, J, complex)
    pb = frames_vjp(ch.transports_vjp(Mb, U, index), cache, J)
    e = rng.normal(size=phi.shape)
    _close(_fd(L, phi, e), float((pb * e).sum()), np.linalg.norm(pb))


def test_dynamics_config_errors_name_the_key():
    for kw, key in [
        (dict(coupling="C3"), "coupling"),
        (dict(coupling_strength=1.5), "coupling_strength"),
        (dict(coupling_length=0.0), "coupling_length"),
        (dict(dephasing_rate=-0.1), "dephasing_rate"),
        (dict(thermal_rate=[0.1, np.nan]), "thermal_rate"),
        (dict(gate="maybe"), "gate"),
        (dict(gate_width=0), "gate_width"),
        (dict(order="random"), "order"),
        (dict(mirror_steps=-1), "mirror_steps"),
        (dict(armijo_c=1.0), "armijo_c"),
        (dict(dephasing_basis="x"), "dephasing_basis"),
    ]:
        with pytest.raises(ConfigError, match=f"^{key}:"):
            QuantumDynamics(**kw)
    with pytest.raises(ValueError, match="degenerate"):
        H = np.diag([1.0, 1.0, 2.0]).astype(complex)[None]
        lam, V = un.hamiltonian_eig(H)
        ch.dephase_energy_vjp(np.eye(3)[None] + 0j, np.eye(3)[None] / 3 + 0j, np.array([0.5]), V, lam)
    with pytest.raises(ValueError, match="d <= 8"):
        exact_propagator(np.zeros((1, 9, 9), complex), np.zeros((1, 0, 9, 9), complex), 0.1)


@pytest.mark.parametrize("window", ["ragged", "star", "empty"])
def test_incoming_sums_equal_a_scatter_add(window):
    """add_incoming (gather and fixed-order sums over the transposed window, the rollout's and
    transports_vjp's scatter onto senders) against np.add.at over the unmasked slots; the star's in-degree
    (N - 1) exceeds the window width, so the sums run over several column blocks."""
    rng = np.random.default_rng(3)
    n, d = 9, 3
    if window == "ragged":
        lists = [list(rng.choice(np.delete(np.arange(n), i), i % 4, replace=False)) for i in range(n)]
        nb = SparseNeighbours.from_lists(lists)
        index, mask = np.asarray(nb.index), np.asarray(nb.mask)
    elif window == "star":
        index, mask = np.zeros((n, 2), np.int64), np.ones((n, 2), bool)
        index[:, 1], mask[0] = 1 + np.arange(n) % (n - 1), False
    else:
        index, mask = np.zeros((n, 0), np.int64), np.zeros((n, 0), bool)
    parts = rng.normal(size=(n, index.shape[1], d, d)) + 1j * rng.normal(size=(n, index.shape[1], d, d))
    bar = rng.normal(size=(n, d, d)) + 0j
    want = bar.copy()
    np.add.at(want, index[mask], parts[mask])
    slots = ch.incoming_slots(index, mask, n)
    assert slots.shape == (n, max(1, int(np.bincount(index[mask], minlength=n).max(initial=0))))
    np.testing.assert_allclose(ch.add_incoming(bar, parts, slots), want, rtol=0, atol=1e-14)
    if window != "empty":  # the masked slots' parts are not read
        parts[~mask] = np.nan
        assert np.isfinite(ch.add_incoming(bar, parts, slots)).all()


def test_pair_distances_and_strengths():
    """Sequence and Euclidean distances of the window's slots (0 under the mask), with the array module
    given (the GPU's prepare passes CuPy: tests/test_cuda_gpu.py), and strengths where the distances are."""
    from vfesim.quantum.channels import coupling_strengths, pair_distances

    index = np.array([[1, 2], [0, 2], [0, 1]])
    mask = np.array([[True, False], [True, True], [False, True]])
    want = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    pos = np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    np.testing.assert_array_equal(pair_distances(index, mask, xp=np), want)
    r = np.sqrt(18.0)
    np.testing.assert_allclose(pair_distances(index, mask, pos, xp=np), [[5.0, 0.0], [5.0, r], [0.0, r]])
    np.testing.assert_array_equal(pair_distances(index[1:], mask[1:], start=1), want[1:])
    eps = coupling_strengths(0.3, 2.0, want, mask)
    np.testing.assert_array_equal(eps, np.where(mask, 0.3 * np.exp(-want / 2.0), 0.0))
