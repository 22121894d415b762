"""Frame-free per-agent features of the alignment KL and their adjoint (SPEC §2.3).

With nu_i = R_i^T mu_i, Lam_i = R_i^T Sigma_i R_i, P_i = Lam_i^-1, ld_i = ln|Lam_i|:

    KL(q_i || Omega_ij q_j) = 1/2 (A_i . B_j + c_i)

    A_i = [w * (Lam_i + nu_i nu_i^T)[triu], nu_i, 1]         w = 1 on the diagonal, 2 off it
    B_j = [P_j[triu], -2 P_j nu_j, nu_j^T P_j nu_j + ld_j]
    c_i = -ld_i - K

Feature length D = K(K+1)/2 + K + 1. The means are centred on the population mean of nu before the
features are formed: the pairwise KL is exactly invariant under a common shift of both means, so this
changes no value or gradient, and it removes the cancellation between the three mean terms when the
population sits far from the origin. A chunk of a population (the dask backend) passes the whole
population's mean as ``centre``, so that every chunk's features share one shift.

Functions are array-module generic (NumPy or CuPy): ``xp`` is taken from the inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..arrays import array_module as _xp
from ..groups import expm_so3, generators
from ..state import cholesky_named

__all__ = ["feature_dim", "frames", "agent_features", "features_vjp", "FeatureCache"]


def feature_dim(K: int) -> int:
    return K * (K + 1) // 2 + K + 1


def frames(phi, irreps) -> np.ndarray:
    """R_i = exp(phi_i . G): (N, 3) -> (N, K, K)."""
    return expm_so3(phi, generators(irreps), max(irreps))


class FeatureCache(NamedTuple):
    mu: object  # (N, K)
    sigma: object  # (N, K, K)
    R: object  # (N, K, K)
    nu: object  # (N, K) centred
    P: object  # (N, K, K)
    Pnu: object  # (N, K)


def _triu(K: int):
    return np.triu_indices(K)


def agent_features(mu, sigma, R, name: str = "sigma", centre=None):
    """(mu (N,K), sigma (N,K,K), R (N,K,K)) -> A (N,D), B (N,D), c (N,), cache.

    ``name`` labels sigma in the error raised when a transported covariance is not SPD. ``centre`` (K,):
    the shift of nu (default: its mean over these agents).
    """
    xp = _xp(mu)
    N, K = mu.shape
    Rt = xp.swapaxes(R, 1, 2)
    nu = xp.einsum("nkl,nk->nl", R, mu)
    nu = nu - (nu.mean(axis=0) if centre is None else xp.asarray(centre, mu.dtype))
    lam = Rt @ sigma @ R
    lam = 0.5 * (lam + xp.swapaxes(lam, 1, 2))
    L = cholesky_named(lam, name)
    ld = 2.0 * xp.log(xp.diagonal(L, axis1=1, axis2=2)).sum(axis=1)
    P = xp.linalg.inv(lam)
    P = 0.5 * (P + xp.swapaxes(P, 1, 2))
    Pnu = xp.einsum("nkl,nl->nk", P, nu)
    iu, ju = _triu(K)
    w = xp.asarray(np.where(iu == ju, 1.0, 2.0), dtype=mu.dtype)
    M = lam + nu[:, :, None] * nu[:, None, :]
    D = feature_dim(K)
    T = D - K - 1
    A = xp.empty((N, D), mu.dtype)
    A[:, :T] = M[:, iu, ju] * w
    A[:, T : T + K] = nu
    A[:, -1] = 1.0
    B = xp.empty((N, D), mu.dtype)
    B[:, :T] = P[:, iu, ju]
    B[:, T : T + K] = -2.0 * Pnu
    B[:, -1] = (nu * Pnu).sum(axis=1) + ld
    c = -ld - K
    return A, B, c, FeatureCache(mu, sigma, R, nu, P, Pnu)


def _unpack_sym(packed, K: int, offdiag_scale: float):
    """(N, T) upper-triangle values -> symmetric (N, K, K); off-diagonals times offdiag_scale."""
    xp = _xp(packed)
    iu, ju = _triu(K)
    G = xp.zeros((packed.shape[0], K, K), packed.dtype)
    off = iu != ju
    G[:, iu, ju] = packed
    G[:, iu[off], ju[off]] *= offdiag_scale
    G[:, ju[off], iu[off]] = G[:, iu[off], ju[off]]
    return G


def features_vjp(gA, gB, gc, cache: FeatureCache):
    """Adjoint of :func:`agent_features`: cotangents of (A, B, c) -> (g_mu, g_sigma, g_R).

    g_sigma is the symmetric gradient (dF = tr(g_sigma dSigma)); g_R is the plain matrix gradient.
    """
    xp = _xp(gA)
    mu, sigma, R, nu, P, Pnu = cache
    K = mu.shape[1]
    T = K * (K + 1) // 2
    GM = _unpack_sym(gA[:, :T], K, 1.0)  # cotangent of M = Lam + nu nu^T
    GP = _unpack_sym(gB[:, :T], K, 0.5)  # cotangent of P
    g_anu = gA[:, T : T + K]
    gv = gB[:, T : T + K]  # cotangent of v = -2 P nu
    gs = gB[:, T + K]  # cotangent of s = nu^T P nu + ld
    mv = lambda M, v: xp.einsum("nkl,nl->nk", M, v)
    g_nu = 2.0 * mv(GM, nu) + g_anu - 2.0 * mv(P, gv) + 2.0 * gs[:, None] * Pnu
    outer = lambda a, b: a[:, :, None] * b[:, None, :]
    GP = GP - outer(gv, nu) - outer(nu, gv) + gs[:, None, None] * outer(nu, nu)
    g_ld = gs - gc
    G_lam = GM - P @ GP @ P + g_ld[:, None, None] * P
    Rt = xp.swapaxes(R, 1, 2)
    g_mu = mv(R, g_nu)
    g_sigma = R @ G_lam @ Rt
    g_sigma = 0.5 * (g_sigma + xp.swapaxes(g_sigma, 1, 2))
    g_R = 2.0 * (sigma @ R @ G_lam) + outer(mu, g_nu)
    return g_mu, g_sigma, g_R
