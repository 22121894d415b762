"""Invariants of the density-matrix model (spec/quantum.md §5): Klein's inequality, gauge covariance,
the commuting (classical) limit, odd-d transport = Gaussian Omega, GEMM divergences = direct ones, and
the Gibbs-Gibbs closed form of the prior term."""

import numpy as np
import pytest
import scipy.linalg as sla

import vfesim
from vfesim.groups import expm_so3, generators
from vfesim.quantum import divergences, spin_generators
from vfesim.quantum.energy import FLOOR_EPS, energy_and_gradient_arrays
from vfesim.quantum.frames import frames


def _arrays(cfg, n, seed, **kw):
    return {k: v.data.copy() for k, v in vfesim.random_state(cfg, n, seed=seed, **kw).items()}


def _U(phi, d):
    J = spin_generators(d)
    return np.stack([sla.expm(-1j * np.einsum("a,akl->kl", p, J)) for p in phi])


def _logm(a):
    w, V = np.linalg.eigh(a)
    return (V * np.log(w)) @ V.conj().T


def _direct_D(a, b):
    """tr a (log a - log b), one pair at a time."""
    return float(np.trace(a @ (_logm(a) - _logm(b))).real)


@pytest.mark.parametrize("d", [2, 3, 4, 5])
def test_gemm_divergences_equal_direct(d):
    cfg = vfesim.QuantumConfig(d=d)
    a = _arrays(cfg, 4, seed=d)
    eps = FLOOR_EPS["complex128"]
    x = (1 - eps) * a["rho"] + eps / d * np.eye(d)
    sigma = np.stack(
        [
            sla.expm(-H / T) / np.trace(sla.expm(-H / T))
            for H, T in zip(a["hamiltonian"], a["temperature"], strict=True)
        ]
    )
    U = _U(a["phi"], d)
    for which, states in (("belief", x), ("prior", sigma)):
        D = divergences(a, cfg, which)
        for i in range(4):
            for j in range(4):
                Uij = U[i] @ U[j].conj().T
                ref = _direct_D(states[i], Uij @ states[j] @ Uij.conj().T)
                assert abs(D[i, j] - ref) <= 1e-12 * max(1.0, abs(ref)), (which, i, j)


@pytest.mark.parametrize("d", [2, 3, 5])
def test_klein_inequality(d):
    cfg = vfesim.QuantumConfig(d=d, lambda_prior=1.0)
    a = _arrays(cfg, 5, seed=d)
    # agent 1 holds agent 0's belief and prior, seen from its own frame: pulled back they are equal
    U = _U(a["phi"], d)
    M = U[1] @ U[0].conj().T
    for k in ("rho", "hamiltonian"):
        a[k][1] = M @ a[k][0] @ M.conj().T
    a["temperature"][1] = a["temperature"][0]
    for which in ("belief", "prior"):
        D = divergences(a, cfg, which)
        assert D.min() >= -1e-13
        assert abs(D[0, 1]) <= 1e-12 and abs(D[1, 0]) <= 1e-12
        off = D[~np.eye(5, dtype=bool)]
        assert (np.sort(off)[2:] > 1e-3).all()  # only the equal pair (both ways) is near 0
        np.testing.assert_allclose(np.diag(D), 0, atol=1e-12)


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("d", [2, 4, 5])
def test_gauge_covariance(d, aggregator):
    """F is invariant under rho_i -> W_i rho_i W_i^dagger, H_i -> W_i H_i W_i^dagger, U_i -> W_i U_i with
    W_i = U(phi'_i) U(phi_i)^dagger (the new frames phi'_i)."""
    cfg = vfesim.QuantumConfig(d=d, lambda_prior=0.7, kappa_beta=0.6, aggregator=aggregator)
    a = _arrays(cfg, 6, seed=d)
    new_phi = np.random.default_rng(d).normal(size=(6, 3))
    W = _U(new_phi, d) @ _U(a["phi"], d).conj().swapaxes(1, 2)
    b = dict(a, phi=new_phi)
    for k in ("rho", "hamiltonian"):
        b[k] = W @ a[k] @ W.conj().swapaxes(1, 2)
    ta, ga = energy_and_gradient_arrays(a, cfg)
    tb, gb = energy_and_gradient_arrays(b, cfg)
    for k in ta:
        assert abs(tb[k] - ta[k]) <= 1e-12 * max(1.0, abs(ta[k])), k
    # gradients of states rotate with them
    for k in ("rho", "hamiltonian"):
        np.testing.assert_allclose(gb[k], W @ ga[k] @ W.conj().swapaxes(1, 2), atol=1e-11)
    np.testing.assert_allclose(gb["temperature"], ga["temperature"], atol=1e-11)


def _kl(p, q):
    return float((p * (np.log(p) - np.log(q))).sum())


@pytest.mark.parametrize("d", [2, 3, 4])
def test_commuting_states_reduce_to_classical_kl(d):
    kappa, n = 0.8, 5
    cfg = vfesim.QuantumConfig(d=d, lambda_prior=1.0, kappa_beta=kappa, kappa_gamma=kappa)
    rng = np.random.default_rng(d)
    p = rng.dirichlet(np.ones(d), size=n)
    h = rng.normal(size=(n, d))
    T = rng.uniform(0.5, 2.0, size=n)
    a = {
        "rho": np.stack([np.diag(v) for v in p]).astype(complex),
        "hamiltonian": np.stack([np.diag(v) for v in h]).astype(complex),
        "temperature": T,
        "phi": np.zeros((n, 3)),
    }
    terms, _ = energy_and_gradient_arrays(a, cfg)
    eps = FLOOR_EPS["complex128"]
    x = (1 - eps) * p + eps / d
    g = np.exp(-h / T[:, None])
    g /= g.sum(axis=1, keepdims=True)

    def softmin(P):
        total = 0.0
        for i in range(n):
            Di = np.array([_kl(P[i], P[j]) for j in range(n) if j != i])
            total += -kappa * np.log(np.exp(-Di / kappa).sum())
        return total

    assert terms["self"] == pytest.approx(sum(_kl(x[i], g[i]) for i in range(n)), rel=1e-12)
    assert terms["belief_align"] == pytest.approx(softmin(x), rel=1e-12)
    assert terms["prior_align"] == pytest.approx(softmin(g), rel=1e-12)


@pytest.mark.parametrize("d", [3, 5, 7])
def test_odd_d_transport_is_the_gaussian_omega(d):
    rng = np.random.default_rng(d)
    phi = rng.normal(size=(4, 3))
    phi[0] = 0.0
    U, _ = frames(phi, spin_generators(d), np.complex128)
    l = (d - 1) // 2
    R = expm_so3(phi, generators((l,)), l)
    np.testing.assert_allclose(U, R, atol=1e-13)
    Omega = R[1] @ R[2].T
    rho = vfesim.random_state(vfesim.QuantumConfig(d=d), 1, seed=d).rho.data[0]
    Uij = U[1] @ U[2].conj().T
    np.testing.assert_allclose(Uij @ rho @ Uij.conj().T, Omega @ rho @ Omega.T, atol=1e-13)


@pytest.mark.parametrize("d", [2, 3, 5])
def test_gibbs_gibbs_closed_form(d):
    """D(sigma~_i || sigma~_j) = tr sigma~_i (-H~_i/T_i + H~_j/T_j) - log Z_i + log Z_j."""
    cfg = vfesim.QuantumConfig(d=d, lambda_prior=1.0)
    a = _arrays(cfg, 4, seed=d)
    H, T = a["hamiltonian"], a["temperature"]
    U = _U(a["phi"], d)
    Ht = U.conj().swapaxes(1, 2) @ H @ U
    logZ = np.log([np.exp(-np.linalg.eigvalsh(Hi) / Ti).sum() for Hi, Ti in zip(H, T, strict=True)])
    sig_t = np.stack([sla.expm(-Hi / Ti) for Hi, Ti in zip(Ht, T, strict=True)]) / np.exp(logZ)[:, None, None]
    D = divergences(a, cfg, "prior")
    for i in range(4):
        for j in range(4):
            ref = np.trace(sig_t[i] @ (-Ht[i] / T[i] + Ht[j] / T[j])).real - logZ[i] + logZ[j]
            assert abs(D[i, j] - ref) <= 1e-12 * max(1.0, abs(ref))


@pytest.mark.parametrize("sparse", [False, True])
def test_attention_is_the_softmax_of_the_divergences(sparse):
    n, kappa = 6, 0.5
    nb = vfesim.SparseNeighbours.ring(n, 2) if sparse else "dense"
    cfg = vfesim.QuantumConfig(d=3, kappa_beta=kappa, neighbours=nb)
    a = _arrays(cfg, n, seed=1)
    beta = vfesim.family_of(cfg).attention(a, cfg, "belief")
    D = divergences(a, cfg, "belief")
    if sparse:
        D = np.take_along_axis(D, nb.index, axis=1)
    else:
        D = np.where(np.eye(n, dtype=bool), np.inf, D)
    ref = np.exp(-D / kappa)
    np.testing.assert_allclose(beta, ref / ref.sum(axis=1, keepdims=True), atol=1e-13)
