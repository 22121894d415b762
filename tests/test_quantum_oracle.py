"""The density-matrix oracle (tests/reference/quantum.py) against closed forms and invariants, so that it
can be trusted as the reference of tests/test_quantum_vs_reference.py. complex128; no vfesim quantum code."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg
from reference.quantum import (
    EPS,
    aggregate,
    energy_terms,
    fd_gradient,
    floor,
    frame,
    frame_generators,
    gibbs,
    log_gibbs,
    log_partition,
    pair_divergences,
    random_hermitian,
    random_traceless_hermitian,
    rel_entropy,
    spin_generators,
    tesseral_unitary,
    unit_vector,
)

from vfesim.groups import generators

DS = (2, 3, 4, 5)


def _rand_rho(rng, d, lam_min=0.05):
    """A random full-rank density matrix with eigenvalues >= lam_min / d."""
    A = rng.standard_normal((d, d)) + 1j * rng.standard_normal((d, d))
    r = A @ A.conj().T
    r /= np.trace(r).real
    return (1 - lam_min) * r + lam_min * np.eye(d) / d


def _rand_herm(rng, d, scale=1.0):
    A = rng.standard_normal((d, d)) + 1j * rng.standard_normal((d, d))
    return scale * 0.5 * (A + A.conj().T)


def _rand_unitary(rng, d):
    Q, R = np.linalg.qr(rng.standard_normal((d, d)) + 1j * rng.standard_normal((d, d)))
    return Q * (np.diag(R) / np.abs(np.diag(R)))


def _system(rng, n, d):
    rho = np.stack([_rand_rho(rng, d) for _ in range(n)])
    H = np.stack([_rand_herm(rng, d) for _ in range(n)])
    T = rng.uniform(0.6, 1.8, n)
    phi = rng.uniform(-1.5, 1.5, (n, 3))
    y = rng.integers(0, d, n)
    return rho, H, T, phi, y


def _cfg(d, **kw):
    cfg = dict(
        d=d,
        lambda_self=1.0,
        lambda_belief=1.0,
        lambda_prior=1.0,
        lambda_obs=1.0,
        kappa_beta=0.8,
        kappa_gamma=1.3,
        aggregator="softmin",
        neighbours=None,
    )
    cfg.update(kw)
    return cfg


def _classical_kl(p, q):
    return float(np.sum(p * (np.log(p) - np.log(q))))


# ------------------------------------------------------------------------------------------- generators


@pytest.mark.parametrize("d", DS)
def test_spin_generators_su2_and_casimir(d):
    J = spin_generators(d)
    j = (d - 1) / 2
    for a, b, c in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        np.testing.assert_allclose(J[a] @ J[b] - J[b] @ J[a], 1j * J[c], atol=1e-13)
    for a in range(3):
        np.testing.assert_allclose(J[a], J[a].conj().T, atol=0)
    cas = sum(J[a] @ J[a] for a in range(3))
    np.testing.assert_allclose(cas, j * (j + 1) * np.eye(d), atol=1e-13)
    np.testing.assert_allclose(np.diag(J[2]).real, np.arange(j, -j - 1, -1), atol=0)
    # The same for the frame generators (a unitary change of basis of the spin irrep for odd d).
    F = frame_generators(d)
    for a, b, c in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        np.testing.assert_allclose(F[a] @ F[b] - F[b] @ F[a], 1j * F[c], atol=1e-13)
    np.testing.assert_allclose(sum(F[a] @ F[a] for a in range(3)), j * (j + 1) * np.eye(d), atol=1e-13)


@pytest.mark.parametrize("d", (3, 5))
def test_odd_d_frame_equals_gaussian_rotation(d):
    """J = 1j * generators((l,)) for odd d, and expm(-1j phi.J) = expm(phi.G), the Gaussian R (real)."""
    l = (d - 1) // 2
    G = generators((l,))
    J = frame_generators(d)
    np.testing.assert_allclose(J, 1j * G, atol=1e-14)
    S = tesseral_unitary(d)
    np.testing.assert_allclose(S @ S.conj().T, np.eye(d), atol=1e-14)
    rng = np.random.default_rng(0)
    for _ in range(4):
        phi = rng.uniform(-3, 3, 3)
        U = frame(phi, J)
        U_vf = scipy.linalg.expm(-1j * np.einsum("a,aij->ij", phi, 1j * G))
        R = scipy.linalg.expm(np.einsum("a,aij->ij", phi, G))
        np.testing.assert_allclose(U, R, atol=1e-13)
        np.testing.assert_allclose(U_vf, R, atol=1e-13)
        np.testing.assert_allclose(R.T @ R, np.eye(d), atol=1e-13)


@pytest.mark.parametrize("d", (2, 4))
def test_even_d_frame_is_spin_irrep(d):
    np.testing.assert_array_equal(frame_generators(d), spin_generators(d))
    U = frame(np.array([0.0, 0.0, 2 * np.pi]), frame_generators(d))
    np.testing.assert_allclose(U, -np.eye(d), atol=1e-12)  # half-integer spin: U(2 pi) = -I


# ------------------------------------------------------------------------------------------- divergences


@pytest.mark.parametrize("d", DS)
def test_logm_matches_eigh_log(d):
    """scipy logm of a Hermitian PD matrix agrees with the spectral log (the oracle relies on logm)."""
    rng = np.random.default_rng(d)
    for lam_min in (0.5, 1e-3):
        r = _rand_rho(rng, d, lam_min)
        w, V = np.linalg.eigh(r)
        np.testing.assert_allclose(scipy.linalg.logm(r), (V * np.log(w)) @ V.conj().T, atol=1e-12)


@pytest.mark.parametrize("d", DS)
def test_logm_and_eigh_energies_agree(d):
    """The whole energy with scipy logm equals the one with the spectral log (used for fast FD sweeps)."""
    rng = np.random.default_rng(d + 5)
    rho, H, T, phi, y = _system(rng, 3, d)
    a = energy_terms(rho, H, T, phi, y, _cfg(d), log="logm", gibbs_log="matrix")
    b = energy_terms(rho, H, T, phi, y, _cfg(d), log="eigh")
    c = energy_terms(rho, H, T, phi, y, _cfg(d), log="logm")
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-13), k
        assert a[k] == pytest.approx(c[k], rel=1e-12, abs=1e-13), k
    for i in range(3):  # the exact Gibbs log equals the matrix log of the Gibbs matrix
        L = log_gibbs(H[i], T[i])
        np.testing.assert_allclose(L, scipy.linalg.logm(gibbs(H[i], T[i])), atol=1e-11)
        np.testing.assert_allclose(scipy.linalg.expm(L), gibbs(H[i], T[i]), atol=1e-14)


@pytest.mark.parametrize("d", DS)
def test_divergence_nonnegative_and_zero_on_equal(d):
    rng = np.random.default_rng(10 + d)
    for _ in range(2):
        r, s = _rand_rho(rng, d), _rand_rho(rng, d)
        assert rel_entropy(r, s) > 0
        assert abs(rel_entropy(r, r)) < 1e-13
        # Gibbs states too
        a, b = gibbs(_rand_herm(rng, d), 0.7), gibbs(_rand_herm(rng, d), 1.3)
        assert rel_entropy(a, b) > 0
        assert abs(rel_entropy(a, a)) < 1e-13


def test_floor_keeps_rank_deficient_finite():
    d = 3
    pure = np.zeros((d, d), complex)
    pure[0, 0] = 1.0
    D = rel_entropy(floor(pure), floor(np.eye(d) / d))
    assert np.isfinite(D) and abs(D - math.log(d)) < 1e-9
    # D(. || rho_eps) <= log(d / eps) (spec §2.3)
    other = np.zeros((d, d), complex)
    other[1, 1] = 1.0
    D = rel_entropy(floor(pure), floor(other))
    assert np.isfinite(D) and D <= math.log(d / EPS) + 1e-6


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("d", DS)
def test_commuting_states_reduce_to_classical_kl(d, aggregator):
    """Diagonal rho and H, phi = 0: every divergence is the KL of the spectra (of the floored beliefs)."""
    rng = np.random.default_rng(20 + d)
    n = 3
    p = rng.dirichlet(np.ones(d), n)
    b = rng.normal(size=(n, d))
    T = rng.uniform(0.5, 2.0, n)
    rho = np.stack([np.diag(p[i]).astype(complex) for i in range(n)])
    H = np.stack([np.diag(b[i]).astype(complex) for i in range(n)])
    phi = np.zeros((n, 3))
    pe = (1 - EPS) * p + EPS / d
    q = np.exp(-b / T[:, None])
    q /= q.sum(axis=1, keepdims=True)
    kb, kg = 0.7, 1.9
    cfg = _cfg(d, lambda_obs=0.0, kappa_beta=kb, kappa_gamma=kg, aggregator=aggregator)
    got = energy_terms(rho, H, T, phi, None, cfg, log="eigh")
    want_self = sum(_classical_kl(pe[i], q[i]) for i in range(n))
    want_belief = sum(
        aggregate([_classical_kl(pe[i], pe[j]) for j in range(n) if j != i], kb, aggregator) for i in range(n)
    )
    want_prior = sum(
        aggregate([_classical_kl(q[i], q[j]) for j in range(n) if j != i], kg, aggregator) for i in range(n)
    )
    assert got["self"] == pytest.approx(want_self, rel=1e-12, abs=1e-13)
    assert got["belief_align"] == pytest.approx(want_belief, rel=1e-12, abs=1e-13)
    assert got["prior_align"] == pytest.approx(want_prior, rel=1e-12, abs=1e-13)
    # unfloored spectra differ only at O(eps)
    assert got["self"] == pytest.approx(sum(_classical_kl(p[i], q[i]) for i in range(n)), rel=1e-10)


@pytest.mark.parametrize("d", DS)
def test_self_term_is_thermodynamic_free_energy(d):
    """D(rho||sigma_T) = (tr(rho H) - T S(rho) + T log Z) / T, S from eigvalsh, log Z from eigvalsh."""
    rng = np.random.default_rng(30 + d)
    for _ in range(2):
        rho, H, T = _rand_rho(rng, d), _rand_herm(rng, d), rng.uniform(0.4, 2.5)
        w = np.linalg.eigvalsh(rho)
        S = -np.sum(w * np.log(w))
        logZ = math.log(np.sum(np.exp(-np.linalg.eigvalsh(H) / T)))
        assert log_partition(H, T) == pytest.approx(logZ, rel=1e-13)
        want = (np.trace(rho @ H).real - T * S + T * logZ) / T
        assert rel_entropy(rho, gibbs(H, T)) == pytest.approx(want, rel=1e-12, abs=1e-13)


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("d", DS)
def test_prior_alignment_gibbs_closed_form(d, aggregator):
    """Two agents, one neighbour each (so A = D):
    D(s~_i||s~_j) = tr s~_i(-H~_i/T_i + H~_j/T_j) - log Z_i + log Z_j with H~ = U^dagger H U;
    checked for the Gibbs pair itself and through the frames."""
    rng = np.random.default_rng(40 + d)
    n = 2
    rho, H, T, phi, _ = _system(rng, n, d)
    s = [gibbs(H[i], T[i]) for i in range(n)]
    logZ = [log_partition(H[i], T[i]) for i in range(n)]
    closed = np.trace(s[0] @ (-H[0] / T[0] + H[1] / T[1])).real - logZ[0] + logZ[1]
    assert rel_entropy(s[0], s[1]) == pytest.approx(closed, rel=1e-12)

    J = frame_generators(d)
    U = [frame(phi[i], J) for i in range(n)]
    Ht = [U[i].conj().T @ H[i] @ U[i] for i in range(n)]
    st = [U[i].conj().T @ s[i] @ U[i] for i in range(n)]

    def D(i, j):
        return np.trace(st[i] @ (-Ht[i] / T[i] + Ht[j] / T[j])).real - logZ[i] + logZ[j]

    lam = 0.7
    cfg = _cfg(d, lambda_self=0.0, lambda_belief=0.0, lambda_prior=lam, lambda_obs=0.0, aggregator=aggregator)
    got = energy_terms(rho, H, T, phi, None, cfg)
    assert got["prior_align"] == pytest.approx(lam * (D(0, 1) + D(1, 0)), rel=1e-12)
    assert got["total"] == got["prior_align"]


@pytest.mark.parametrize("d", DS)
def test_pullback_equals_direct_transport(d):
    rng = np.random.default_rng(50 + d)
    n = 3
    rho, H, T, phi, _ = _system(rng, n, d)
    J = frame_generators(d)
    U = np.stack([frame(phi[i], J) for i in range(n)])
    nbrs = [[j for j in range(n) if j != i] for i in range(n)]
    X = np.stack([floor(r) for r in rho])
    a = pair_divergences(X, U, nbrs, "pullback", log="eigh")
    b = pair_divergences(X, U, nbrs, "direct", log="eigh")
    c = pair_divergences(X, U, nbrs, "direct", log="logm") if d == 4 else b
    for i in range(n):
        np.testing.assert_allclose(a[i], b[i], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(a[i], c[i], rtol=1e-12, atol=1e-14)
    cfg = _cfg(d, lambda_obs=0.0)
    ta = energy_terms(rho, H, T, phi, None, cfg, transport="pullback", log="eigh")
    tb = energy_terms(rho, H, T, phi, None, cfg, transport="direct", log="eigh")
    for k in ta:
        assert ta[k] == pytest.approx(tb[k], rel=1e-12, abs=1e-13), k


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("d", DS)
def test_gauge_covariance(d, aggregator):
    """rho_i -> W_i rho_i W_i^dagger, H_i -> W_i H_i W_i^dagger, U_i -> W_i U_i leaves self, belief and prior
    terms unchanged (the Born term is tied to the computational basis and is not gauge invariant)."""
    rng = np.random.default_rng(60 + d)
    n = 5
    rho, H, T, phi, _ = _system(rng, n, d)
    J = frame_generators(d)
    U = np.stack([frame(phi[i], J) for i in range(n)])
    W = np.stack([_rand_unitary(rng, d) for _ in range(n)])
    rho2 = np.stack([W[i] @ rho[i] @ W[i].conj().T for i in range(n)])
    H2 = np.stack([W[i] @ H[i] @ W[i].conj().T for i in range(n)])
    U2 = np.stack([W[i] @ U[i] for i in range(n)])
    cfg = _cfg(d, lambda_obs=0.0, aggregator=aggregator)
    a = energy_terms(rho, H, T, None, None, cfg, U=U, log="eigh")
    b = energy_terms(rho2, H2, T, None, None, cfg, U=U2, log="eigh")
    c = energy_terms(rho, H, T, phi, None, cfg, log="eigh")  # U passed == U built from phi
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-12 * max(1.0, abs(a[k])), (k, a[k], b[k])
        assert a[k] == c[k], k
    assert a["self"] > 0 and abs(a["belief_align"]) > 1e-3 and abs(a["prior_align"]) > 1e-3
    # a common right factor U_i -> U_i V changes nothing either (transport U_ij unchanged): only for
    # the direct form; the pulled-back states change by the same V on both sides.
    V = _rand_unitary(rng, d)
    e = energy_terms(rho, H, T, None, None, cfg, U=np.stack([U[i] @ V for i in range(n)]), log="eigh")
    for k in a:
        assert abs(a[k] - e[k]) <= 1e-12 * max(1.0, abs(a[k])), k


def test_observation_term_and_identical_agents():
    d, n = 4, 3
    rng = np.random.default_rng(70)
    rho = np.stack([_rand_rho(rng, d)] * n)
    H = np.stack([_rand_herm(rng, d)] * n)
    T = np.full(n, 0.9)
    phi = np.tile(rng.uniform(-1, 1, 3), (n, 1))
    y = np.array([0, 3, 1])
    cfg = _cfg(d, lambda_self=0.0, lambda_obs=0.6)
    got = energy_terms(rho, H, T, phi, y, cfg, log="eigh")
    assert got["observation"] == pytest.approx(
        0.6 * -sum(math.log(rho[i][y[i], y[i]].real) for i in range(n))
    )
    # identical agents in a common frame: D_ij = 0, softmin = -kappa log(n - 1) per receiver
    assert got["belief_align"] == pytest.approx(-n * 0.8 * math.log(n - 1), rel=1e-12)
    assert got["prior_align"] == pytest.approx(-n * 1.3 * math.log(n - 1), rel=1e-12)
    got = energy_terms(rho, H, T, phi, y, dict(cfg, aggregator="expected"), log="eigh")
    assert abs(got["belief_align"]) < 1e-12 and abs(got["prior_align"]) < 1e-12


def test_sparse_neighbours_and_empty_rows():
    d, n = 3, 5
    rng = np.random.default_rng(80)
    rho, H, T, phi, y = _system(rng, n, d)
    index = np.array([[1, 2, 0], [0, 4, 0], [0, 0, 0], [2, 1, 4], [3, 0, 0]])
    mask = np.array(
        [[1, 1, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]],
        dtype=bool,
    )
    cfg = _cfg(d, neighbours=(index, mask), lambda_self=0.0, lambda_obs=0.0, lambda_prior=0.0)
    got = energy_terms(rho, H, T, phi, None, cfg, log="eigh")
    J = frame_generators(d)
    U = np.stack([frame(phi[i], J) for i in range(n)])
    X = np.stack([floor(r) for r in rho])
    lists = [[1, 2], [0, 4], [], [2, 1, 4], [3]]
    Ds = pair_divergences(X, U, lists, log="eigh")
    want = sum(aggregate(Ds[i], 0.8, "softmin") for i in range(n))
    assert got["belief_align"] == pytest.approx(want, rel=1e-14)
    # the dense list equals an explicit full index
    full = np.array([[j for j in range(n) if j != i] for i in range(n)])
    a = energy_terms(rho, H, T, phi, y, _cfg(d), log="eigh")
    b = energy_terms(rho, H, T, phi, y, _cfg(d, neighbours=(full, np.ones_like(full, bool))), log="eigh")
    assert a == b


# ------------------------------------------------------------------------------------------- aggregators


def test_aggregator_limits():
    D = np.array([0.9, 0.3, 1.7, 0.31])
    for agg in ("softmin", "expected"):
        assert aggregate(D, 1e-4, agg) == pytest.approx(D.min(), abs=1e-3)
        assert aggregate(D, 1e-6, agg) == pytest.approx(D.min(), abs=1e-12)
        assert aggregate([0.42], 0.7, agg) == pytest.approx(0.42, rel=1e-15)
        assert aggregate([], 0.7, agg) == 0.0
    assert aggregate(D, 1e6, "expected") == pytest.approx(D.mean(), rel=1e-5)
    assert aggregate(D, 1e6, "softmin") == pytest.approx(D.mean() - 1e6 * math.log(len(D)), rel=1e-9)
    for kappa in (0.1, 1.0, 10.0):
        beta = np.exp(-D / kappa) / np.exp(-D / kappa).sum()
        H = -np.sum(beta * np.log(beta))
        # expected - softmin = kappa H(beta) >= 0
        diff = aggregate(D, kappa, "expected") - aggregate(D, kappa, "softmin")
        assert diff == pytest.approx(kappa * H, rel=1e-12)
        assert aggregate(D, kappa, "softmin") == pytest.approx(-kappa * math.log(np.sum(np.exp(-D / kappa))))


# -------------------------------------------------------------------------------------------- FD helper


def test_fd_gradient_on_known_gradients():
    rng = np.random.default_rng(90)
    n, d = 3, 4
    X = np.stack([_rand_herm(rng, d) for _ in range(n)])

    def f(Y):  # sum_i tr(Y_i^3), gradient 3 Y_i^2 (real for Hermitian Y)
        return float(sum(np.trace(Y[i] @ Y[i] @ Y[i]).real for i in range(n)))

    dirs = [random_hermitian(rng, n, d) for _ in range(3)] + [random_traceless_hermitian(rng, n, d)]
    fd = fd_gradient(f, X, dirs, 1e-6)
    an = [sum(np.trace(3 * X[i] @ X[i] @ E[i]).real for i in range(n)) for E in dirs]
    np.testing.assert_allclose(fd, an, rtol=1e-8)
    for E in dirs:
        assert np.linalg.norm(E) == pytest.approx(1.0)
        np.testing.assert_allclose(E, np.conj(np.swapaxes(E, -1, -2)), atol=0)
    assert np.abs(np.trace(dirs[-1], axis1=1, axis2=2)).max() < 1e-15

    x = rng.normal(size=(n, 3))
    g = fd_gradient(lambda v: float(np.sum(np.sin(v))), x, [unit_vector(x.shape, (1, 2))], 1e-6)
    assert g[0] == pytest.approx(math.cos(x[1, 2]), rel=1e-9)

    # the self term's partials: dD/dH = (rho - sigma)/T and dD/dT = tr((sigma - rho) H)/T^2 (spec §4.2)
    rho, H, T = _rand_rho(rng, d), _rand_herm(rng, d), 0.8
    s = gibbs(H, T)
    E = random_hermitian(rng, 1, d)[0]
    fd = fd_gradient(lambda Hx: rel_entropy(rho, gibbs(Hx, T)), H, [E], 1e-6)
    assert fd[0] == pytest.approx(np.trace((rho - s) @ E).real / T, rel=1e-7)
    fd = fd_gradient(lambda t: rel_entropy(rho, gibbs(H, float(t))), np.array(T), [np.array(1.0)], 1e-6)
    assert fd[0] == pytest.approx(np.trace((s - rho) @ H).real / T**2, rel=1e-7)
    # and the belief gradient on traceless directions: dD(rho||sigma)/drho = log rho - log sigma (+ I)
    Et = random_traceless_hermitian(rng, 1, d)[0]
    fd = fd_gradient(lambda r: rel_entropy(r, s), rho, [Et], 1e-6)
    G = scipy.linalg.logm(rho) - scipy.linalg.logm(s)
    assert fd[0] == pytest.approx(np.trace(G @ Et).real, rel=1e-7)


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_energy_aggregator_small_kappa_is_sum_of_minima(aggregator):
    """kappa -> 0: each receiver's alignment tends to its smallest divergence (3 agents, d = 3)."""
    d, n = 3, 3
    rng = np.random.default_rng(95)
    rho, H, T, phi, _ = _system(rng, n, d)
    J = frame_generators(d)
    U = np.stack([frame(phi[i], J) for i in range(n)])
    nbrs = [[j for j in range(n) if j != i] for i in range(n)]
    Db = pair_divergences(np.stack([floor(r) for r in rho]), U, nbrs, log="eigh")
    Dp = pair_divergences(np.stack([gibbs(H[i], T[i]) for i in range(n)]), U, nbrs, log="eigh")
    cfg = _cfg(d, lambda_self=0.0, lambda_obs=0.0, kappa_beta=1e-7, kappa_gamma=1e-7, aggregator=aggregator)
    got = energy_terms(rho, H, T, phi, None, cfg, log="eigh")
    assert got["belief_align"] == pytest.approx(sum(D.min() for D in Db), abs=1e-6)
    assert got["prior_align"] == pytest.approx(sum(D.min() for D in Dp), abs=1e-6)
