"""Per-agent energy terms and their hand-written adjoints (SPEC §2.2): self KL and observation.

Array-module generic (NumPy or CuPy). Shapes: mu (N, K), sigma (N, K, K), obs (N, D).
"""

from __future__ import annotations

import numpy as np

from ..arrays import array_module as _xp
from ..state import cholesky_named

__all__ = ["spd_inv_logdet", "self_kl", "self_kl_vjp", "observation", "observation_vjp"]

LOG_2PI = float(np.log(2.0 * np.pi))


def spd_inv_logdet(S, name: str = "sigma"):
    """(S^-1 symmetrised, ln|S|) for a batch of SPD matrices (N, K, K); ``name`` labels errors."""
    xp = _xp(S)
    L = cholesky_named(S, name)
    ld = 2.0 * xp.log(xp.diagonal(L, axis1=1, axis2=2)).sum(axis=1)
    inv = xp.linalg.inv(S)
    return 0.5 * (inv + xp.swapaxes(inv, 1, 2)), ld


def self_kl(mu_q, sigma_q, mu_p, sigma_p):
    """KL(q_i || p_i) per agent (N,) and a cache for the adjoint."""
    xp = _xp(mu_q)
    K = mu_q.shape[1]
    Sp_inv, ld_p = spd_inv_logdet(sigma_p, "sigma_p")
    Sq_inv, ld_q = spd_inv_logdet(sigma_q, "sigma_q")
    d = mu_p - mu_q
    Spd = xp.einsum("nkl,nl->nk", Sp_inv, d)
    tr = xp.einsum("nkl,nlk->n", Sp_inv, sigma_q)
    kl = 0.5 * (tr + (d * Spd).sum(axis=1) - K + ld_p - ld_q)
    return kl, (sigma_q, Sp_inv, Sq_inv, Spd)


def self_kl_vjp(g, cache):
    """Cotangent g (N,) of KL(q||p) -> (g_mu_q, g_sigma_q, g_mu_p, g_sigma_p)."""
    sigma_q, Sp_inv, Sq_inv, Spd = cache
    gn = g[:, None]
    g_mu_q = -gn * Spd
    g_mu_p = gn * Spd
    g_sigma_q = 0.5 * g[:, None, None] * (Sp_inv - Sq_inv)
    inner = Sp_inv @ sigma_q @ Sp_inv + Spd[:, :, None] * Spd[:, None, :]
    g_sigma_p = 0.5 * g[:, None, None] * (Sp_inv - 0.5 * (inner + inner.swapaxes(1, 2)))
    return g_mu_q, g_sigma_q, g_mu_p, g_sigma_p


def observation(mu, sigma, obs, W, R):
    """E_q[-log N(o; W z, R)] per agent (N,) and a cache. W (D, K), R (D, D) SPD."""
    xp = _xp(mu)
    D = W.shape[0]
    Rinv, ld_R = spd_inv_logdet(R[None], "R")
    Rinv, ld_R = Rinv[0], ld_R[0]
    RiW = Rinv @ W  # (D, K)
    WtRiW = W.T @ RiW  # (K, K)
    r = obs - mu @ W.T  # (N, D)
    Rir = r @ Rinv  # (N, D), Rinv symmetric
    tr = xp.einsum("kl,nlk->n", WtRiW, sigma)
    e = 0.5 * (D * LOG_2PI + ld_R + tr + (r * Rir).sum(axis=1))
    return e, (W, WtRiW, Rir)


def observation_vjp(g, cache):
    """Cotangent g (N,) -> (g_mu, g_sigma, g_obs)."""
    W, WtRiW, Rir = cache
    g_mu = -g[:, None] * (Rir @ W)
    g_sigma = 0.5 * g[:, None, None] * WtRiW[None]
    g_sigma = 0.5 * (g_sigma + g_sigma.swapaxes(1, 2))
    g_obs = g[:, None] * Rir
    return g_mu, g_sigma, g_obs
