"""Fused per-agent update kernels for the integrators (CPU, Numba ``njit(parallel=True)``).

Numbers and arrays only. One ``prange`` pass over agents does, per agent, everything a sub-step needs:
  * ``gradient_flow_update_cpu``: step of means, covariances (affine-invariant exponential retraction,
    SPEC §2.5) and frames (principal-ball wrap) in one pass;
  * ``kick_drift_cpu``: Hamiltonian kick ``p -= kick * dF/dx`` then drift ``x += drift * p / m`` of a
    (mean, log-Cholesky) block and optionally the frame, rebuilding ``Sigma = L L^T``.
The per-agent math is :mod:`vfesim_kernels.update_math` (shared with the CUDA kernels of
:mod:`vfesim_kernels.update_cuda`); only the agent loops and scratch allocation are CPU-specific.
Layout as there. The NumPy twins live in ``vfesim.integrators``; the two agree to rounding.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import update_math as _um
from .update_math import MODE_DIRECTION, MODE_EUCLIDEAN, MODE_NATURAL

__all__ = [
    "MODE_NATURAL",
    "MODE_EUCLIDEAN",
    "MODE_DIRECTION",
    "gradient_flow_update_cpu",
    "kick_drift_cpu",
    "theta_to_sigma_cpu",
]

_f = _um.compile_all(njit(cache=True))
_jacobi_eigh = _f.jacobi_eigh
_retract = _f.retract
_wrap_phi = _f.wrap_phi
_gradient_flow_agent = _f.gradient_flow_agent
_theta_to_sigma_agent = _f.theta_to_sigma_agent
_kick_drift_agent = _f.kick_drift_agent


@njit(parallel=True, cache=True)
def gradient_flow_update_cpu(
    mu_q, sigma_q, mu_p, sigma_p, phi,
    g_mu_q, g_sigma_q, g_mu_p, g_sigma_p, g_phi,
    eta, mode,
    o_mu_q, o_sigma_q, o_mu_p, o_sigma_p, o_phi,
):  # fmt: skip
    """One gradient-flow step for every agent. eta (5,): step sizes of mu_q, sigma_q, mu_p, sigma_p, phi
    (0 freezes the field: copied). mode: MODE_*. Means: mu - eta Sigma g (natural) / mu - eta g
    (euclidean) / mu + eta g (direction); covariances through ``update_math.retract``; phi - eta g_phi
    (or + eta g for direction), wrapped into the principal ball."""
    N, K = mu_q.shape
    W = np.empty((N, 6, K, K))  # per-agent scratch, allocated once (no allocation inside prange)
    wv = np.empty((N, 3, K))
    tmp = np.empty((N, 3))
    for i in prange(N):
        _gradient_flow_agent(
            i, mu_q, sigma_q, mu_p, sigma_p, phi,
            g_mu_q, g_sigma_q, g_mu_p, g_sigma_p, g_phi,
            eta, mode,
            o_mu_q, o_sigma_q, o_mu_p, o_sigma_p, o_phi,
            W[i], wv[i], tmp[i],
        )  # fmt: skip


@njit(parallel=True, cache=True)
def theta_to_sigma_cpu(theta, K, out):
    """Sigma = L L^T from log-Cholesky coordinates: theta (N, T) -> out (N, K, K)."""
    N = theta.shape[0]
    Ls = np.empty((N, K, K))
    for i in prange(N):
        _theta_to_sigma_agent(i, theta, K, out, Ls[i])


@njit(parallel=True, cache=True)
def kick_drift_cpu(
    x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta, out_sigma,
    x_phi, p_phi, g_phi, inv_m_phi, do_phi,
):  # fmt: skip
    """In place, per agent: ``p -= kick * dF/dx`` then ``x += drift * p / m``, Sigma = L L^T.

    dF/dtheta from the symmetric G = dF/dSigma: dF/dL = 2 G L (lower part), times L_kk on the
    log-diagonal. kick == 0 or drift == 0 skips that half; out_sigma is rebuilt only when drift != 0.
    The frame block (x_phi, p_phi, g_phi) is updated too when ``do_phi``.
    """
    N, K = x_mu.shape
    Ls = np.empty((N, K, K))  # per-agent scratch, allocated once
    for i in prange(N):
        _kick_drift_agent(
            i, x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta, out_sigma,
            x_phi, p_phi, g_phi, inv_m_phi, do_phi, Ls[i],
        )  # fmt: skip


# Serial builds of the same kernels (``prange`` runs as ``range``): for callers that already run one
# kernel per thread, e.g. the dask backend's per-chunk tasks, where Numba's parallel kernels must not be
# launched from the scheduler's threads. Per agent the same code: results equal the parallel builds'.
gradient_flow_update_serial = njit(cache=True)(gradient_flow_update_cpu.py_func)
theta_to_sigma_serial = njit(cache=True)(theta_to_sigma_cpu.py_func)
kick_drift_serial = njit(cache=True)(kick_drift_cpu.py_func)
__all__ += ["gradient_flow_update_serial", "theta_to_sigma_serial", "kick_drift_serial"]
