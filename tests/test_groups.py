"""so(3) generators, the exponential map and its derivative (SPEC §2.1)."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import scipy.linalg
from conftest import TOL

from vfesim.groups import (
    expm_so3,
    generators,
    irrep_generators,
    phi_grad_from_R,
    right_jacobian,
)


def comm(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    return A @ B - B @ A


def random_phi(rng: np.random.Generator, n: int, radius: float) -> np.ndarray:
    """n frames (n, 3) with |phi| uniform in [0, radius]."""
    d = rng.standard_normal((n, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    return d * rng.uniform(0, radius, size=(n, 1))


def X_of(phi: np.ndarray, G: np.ndarray) -> np.ndarray:
    """phi . G: phi (3,), G (3, K, K) -> (K, K)."""
    return np.einsum("a,akl->kl", phi, G)


MULTI = (0, 1, 2, 1)


@pytest.mark.parametrize("l", range(11))
def test_irrep_algebra(l):
    G = irrep_generators(l)
    d = 2 * l + 1
    assert G.shape == (3, d, d) and G.dtype == np.float64
    np.testing.assert_allclose(G, -np.swapaxes(G, 1, 2), atol=0)
    for a, b, c in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        np.testing.assert_allclose(comm(G[a], G[b]), G[c], atol=1e-12)
    casimir = -sum(G[a] @ G[a] for a in range(3))
    np.testing.assert_allclose(casimir, l * (l + 1) * np.eye(d), atol=1e-11)


def test_multi_irrep_blocks():
    G = generators(MULTI)
    K = sum(2 * l + 1 for l in MULTI)
    assert G.shape == (3, K, K) and G.dtype == np.float64
    np.testing.assert_allclose(G, -np.swapaxes(G, 1, 2), atol=0)
    for a, b, c in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        np.testing.assert_allclose(comm(G[a], G[b]), G[c], atol=1e-12)
    casimir = -sum(G[a] @ G[a] for a in range(3))
    want = np.diag(np.concatenate([np.full(2 * l + 1, l * (l + 1.0)) for l in MULTI]))
    np.testing.assert_allclose(casimir, want, atol=1e-12)
    o = 0
    for l in MULTI:
        d = 2 * l + 1
        np.testing.assert_array_equal(G[:, o : o + d, o : o + d], irrep_generators(l))
        off = G[:, o : o + d].copy()
        off[:, :, o : o + d] = 0
        assert not off.any()
        o += d


def mp_expm(X: np.ndarray) -> np.ndarray:
    """exp(X) to 40 significant digits, rounded to float64."""
    with mpmath.workdps(40):
        E = mpmath.expm(mpmath.matrix(X.tolist()))
        return np.array(E.tolist(), dtype=np.float64)


@pytest.mark.parametrize("l", [1, 3, 10])
def test_expm_vs_mpmath(l):
    rng = np.random.default_rng(l)
    G = irrep_generators(l)
    phis = random_phi(rng, 2, np.pi)
    phis[0] *= np.pi / np.linalg.norm(phis[0])  # |phi| = pi: the edge of the principal ball
    R = expm_so3(phis, G, l)
    for n in range(len(phis)):
        err = np.abs(R[n] - mp_expm(X_of(phis[n], G))).max()
        assert err <= 1e-13, (n, err)


@pytest.mark.parametrize("irreps", [(0,), (1,), (2,), (5,), (10,), MULTI])
def test_expm_vs_scipy_orthogonal(irreps):
    rng = np.random.default_rng(sum(irreps) + len(irreps))
    G = generators(irreps)
    lmax = max(irreps)
    phis = np.concatenate([random_phi(rng, 30, np.pi), np.zeros((1, 3)), 1e-9 * np.ones((1, 3))])
    R = expm_so3(phis, G, lmax)
    assert R.dtype == np.float64
    K = G.shape[1]
    for n in range(len(phis)):
        np.testing.assert_allclose(R[n], scipy.linalg.expm(X_of(phis[n], G)), rtol=0, atol=1e-12)
    np.testing.assert_allclose(R @ np.swapaxes(R, 1, 2), np.broadcast_to(np.eye(K), R.shape), atol=1e-13)
    np.testing.assert_allclose(np.linalg.det(R), 1.0, atol=1e-12)


def test_expm_float32(rng):
    G = irrep_generators(2)
    phis = random_phi(rng, 20, 3.0)
    R32 = expm_so3(phis.astype(np.float32), G, 2)
    R64 = expm_so3(phis, G, 2)
    assert R32.dtype == np.float32
    np.testing.assert_allclose(R32, R64, rtol=0, atol=TOL["float32"]["atol"])


def fd_phi_grad(C: np.ndarray, phi: np.ndarray, G: np.ndarray, lmax: int, h: float) -> np.ndarray:
    """Central differences of f(phi) = <C, expm(phi . G)> for one agent: C (K, K), phi (3,) -> (3,)."""
    out = np.zeros(3)
    for a in range(3):
        e = np.zeros(3)
        e[a] = h
        fp = np.sum(C * expm_so3((phi + e)[None], G, lmax)[0])
        fm = np.sum(C * expm_so3((phi - e)[None], G, lmax)[0])
        out[a] = (fp - fm) / (2 * h)
    return out


@pytest.mark.parametrize("irreps", [(1,), (3,), MULTI])
def test_phi_grad_from_R_vs_fd(irreps, rng):
    """<gR, dR> chained to phi, against central differences; includes the small-|phi| series branch."""
    G = generators(irreps)
    lmax = max(irreps)
    K = G.shape[1]
    phis = np.concatenate(
        [
            random_phi(rng, 4, 3.0),
            random_phi(rng, 2, 1e-3),  # series branch of c1, c2
            np.array([[2e-4, -1e-4, 3e-5]]),
            np.zeros((1, 3)),
        ]
    )
    C = rng.standard_normal((len(phis), K, K))
    R = expm_so3(phis, G, lmax)
    grad = phi_grad_from_R(C, R, phis, G)
    for n in range(len(phis)):
        fd = fd_phi_grad(C[n], phis[n], G, lmax, 1e-6)
        np.testing.assert_allclose(grad[n], fd, rtol=1e-7, atol=1e-8 * np.abs(C[n]).sum())


def spec_Q(phi: np.ndarray, G: np.ndarray) -> np.ndarray:
    """Q_a = G_a - c1 [X, G_a] + c2 [X, [X, G_a]] (SPEC §2.1) in high precision: (3, K, K)."""
    X = X_of(phi, G)
    with mpmath.workdps(30):
        t = mpmath.sqrt(sum(mpmath.mpf(float(p)) ** 2 for p in phi))
        if t == 0:
            c1, c2 = 0.5, 1.0 / 6.0
        else:
            c1 = float((1 - mpmath.cos(t)) / t**2)
            c2 = float((t - mpmath.sin(t)) / t**3)
    return np.stack([G[a] - c1 * comm(X, G[a]) + c2 * comm(X, comm(X, G[a])) for a in range(3)])


@pytest.mark.parametrize("irreps", [(1,), (4,), MULTI])
def test_right_jacobian_matches_spec_and_fd(irreps, rng):
    """sum_b Jr[b, a] G_b equals the spec Q_a, and R Q_a equals central differences of R."""
    G = generators(irreps)
    lmax = max(irreps)
    phis = np.concatenate(
        [random_phi(rng, 3, 3.0), random_phi(rng, 2, 1e-3), np.array([[1.2e-3, 0, 0]]), np.zeros((1, 3))]
    )
    Jr = right_jacobian(phis)
    R = expm_so3(phis, G, lmax)
    h = 1e-6
    for n in range(len(phis)):
        Q = spec_Q(phis[n], G)
        Q_jr = np.einsum("ba,bkl->akl", Jr[n], G)
        np.testing.assert_allclose(Q_jr, Q, rtol=0, atol=1e-13 * (1 + lmax))
        for a in range(3):
            e = np.zeros(3)
            e[a] = h
            dR = (expm_so3((phis[n] + e)[None], G, lmax)[0] - expm_so3((phis[n] - e)[None], G, lmax)[0]) / (
                2 * h
            )
            np.testing.assert_allclose(R[n] @ Q[a], dR, rtol=0, atol=1e-8 * (1 + lmax))


def test_right_jacobian_limits():
    """Jr(0) = I, and Jr phi = phi (a rotation axis is fixed by its own Jacobian)."""
    np.testing.assert_array_equal(right_jacobian(np.zeros((1, 3)))[0], np.eye(3))
    phi = np.array([[0.3, -1.1, 0.7]])
    np.testing.assert_allclose(right_jacobian(phi)[0] @ phi[0], phi[0], atol=1e-15)


def test_right_jacobian_float32_accuracy(rng):
    """Float32 Jr stays within a few float32 ulps of float64, also just above the series branch."""
    ts = np.array([1.0001e-3, 1.2e-3, 2e-3, 5e-3, 1e-2, 0.1, 1.0, 3.0])
    d = rng.standard_normal((len(ts), 3))
    phis = d / np.linalg.norm(d, axis=1, keepdims=True) * ts[:, None]
    J64 = right_jacobian(phis)
    J32 = right_jacobian(phis.astype(np.float32))
    assert J32.dtype == np.float32
    err = np.abs(J32 - J64).max(axis=(1, 2))
    assert np.all(err <= 16 * np.finfo(np.float32).eps), dict(zip(ts.tolist(), err.tolist(), strict=True))
