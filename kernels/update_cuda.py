"""numba.cuda kernels of the integrator updates (SPEC §2.5), twins of :mod:`vfesim_kernels.update_cpu`.

One thread per agent; the per-agent math is :mod:`vfesim_kernels.update_math`, compiled here as inlined
device functions, with per-thread float64 scratch in local memory (one kernel family per K, because local
array shapes must be compile-time ints). Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on NumPy
arrays.

Every kernel that writes state also writes a guard flag: ``flag[0]`` is raised to 1 (an integer atomic
max, so the result does not depend on thread order) when an agent's outputs contain NaN or Inf. The
integrator reads it together with the energy transfer instead of checking the state on the host.

    gradient_flow  mu_q, sigma_q, mu_p, sigma_p, phi, g_* (same), eta (5,) float64, mode, o_* (same), flag
    kick_drift     x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta,
                   out_sigma, x_phi, p_phi, g_phi, inv_m_phi, do_phi, flag   (in place, like kick_drift_cpu)
    theta_to_sigma theta (N, T), out (N, K, K)
    adam           g, m, v (n,) flat; b1, b2, c1 = 1 - b1^t, c2 = 1 - b2^t, eps; m_out, v_out, d_out (n,)
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float64
from numba.core import config as _numba_config

from . import update_math as _um
from .cuda.core import compile_kernels
from .cuda.core import device as _device

__all__ = ["SIMULATOR", "BLOCK", "make_update_kernels", "kernel_signatures", "launch_blocks"]

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
_numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = False  # small grids at small N are deliberate
# Threads per block. The simulator spawns one Python thread per CUDA thread of a block: small blocks.
BLOCK = 8 if SIMULATOR else 128


def _fmod_pos(x, y):
    return math.fmod(x, y)  # libdevice fmod, exact (NVVM's ``%`` is x - y floor(x / y))


_f = _um.compile_all(_device, replace={"fmod_pos": _device(_fmod_pos)})
_gradient_flow_agent = _f.gradient_flow_agent
_kick_drift_agent = _f.kick_drift_agent
_theta_to_sigma_agent = _f.theta_to_sigma_agent


def launch_blocks(n: int) -> int:
    return max(1, -(-n // BLOCK))


@functools.cache
def make_update_kernels(K: int) -> dict:
    """Update kernels for latent dimension K (any state dtype; scratch is float64).

    Returns a dict of dispatchers ``gradient_flow``, ``kick_drift``, ``theta_to_sigma``, ``adam`` and
    ``"_py"``, the uncompiled Python functions (for ``cuda.compile_ptx``). Launch with
    ``[launch_blocks(N), BLOCK]`` (``adam``: over the flat length).
    """
    gf_agent = _gradient_flow_agent
    kd_agent = _kick_drift_agent
    ts_agent = _theta_to_sigma_agent

    def gradient_flow(
        mu_q, sigma_q, mu_p, sigma_p, phi,
        g_mu_q, g_sigma_q, g_mu_p, g_sigma_p, g_phi,
        eta, mode,
        o_mu_q, o_sigma_q, o_mu_p, o_sigma_p, o_phi,
        flag,
    ):  # fmt: skip
        """One gradient-flow step of agent i = thread (``update_cpu.gradient_flow_update_cpu``)."""
        i = cuda.grid(1)
        if i >= mu_q.shape[0]:
            return
        W = cuda.local.array((6, K, K), float64)
        wv = cuda.local.array((3, K), float64)
        tmp = cuda.local.array(3, float64)
        gf_agent(
            i, mu_q, sigma_q, mu_p, sigma_p, phi,
            g_mu_q, g_sigma_q, g_mu_p, g_sigma_p, g_phi,
            eta, mode,
            o_mu_q, o_sigma_q, o_mu_p, o_sigma_p, o_phi,
            W, wv, tmp,
        )  # fmt: skip
        # v - v is NaN exactly when v is NaN or +-Inf, so one sum checks every output of the agent.
        chk = 0.0
        for a in range(K):
            chk += (o_mu_q[i, a] - o_mu_q[i, a]) + (o_mu_p[i, a] - o_mu_p[i, a])
            for b in range(K):
                chk += (o_sigma_q[i, a, b] - o_sigma_q[i, a, b]) + (o_sigma_p[i, a, b] - o_sigma_p[i, a, b])
        for a in range(3):
            chk += o_phi[i, a] - o_phi[i, a]
        if chk != chk:
            cuda.atomic.max(flag, 0, 1)

    def kick_drift(
        x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta, out_sigma,
        x_phi, p_phi, g_phi, inv_m_phi, do_phi, flag,
    ):  # fmt: skip
        """In place for agent i = thread (``update_cpu.kick_drift_cpu``); raises flag on NaN/Inf."""
        i = cuda.grid(1)
        if i >= x_mu.shape[0]:
            return
        L = cuda.local.array((K, K), float64)
        kd_agent(
            i, x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta, out_sigma,
            x_phi, p_phi, g_phi, inv_m_phi, do_phi, L,
        )  # fmt: skip
        chk = 0.0
        for a in range(K):
            chk += (x_mu[i, a] - x_mu[i, a]) + (p_mu[i, a] - p_mu[i, a])
        for t in range(x_theta.shape[1]):
            chk += (x_theta[i, t] - x_theta[i, t]) + (p_theta[i, t] - p_theta[i, t])
        if drift != 0.0:
            for a in range(K):
                for b in range(K):
                    chk += out_sigma[i, a, b] - out_sigma[i, a, b]
        if do_phi:
            for a in range(3):
                chk += (x_phi[i, a] - x_phi[i, a]) + (p_phi[i, a] - p_phi[i, a])
        if chk != chk:
            cuda.atomic.max(flag, 0, 1)

    def theta_to_sigma(theta, out):
        """out[i] = L L^T of theta[i] (N, T) -> (N, K, K)."""
        i = cuda.grid(1)
        if i >= theta.shape[0]:
            return
        L = cuda.local.array((K, K), float64)
        ts_agent(i, theta, K, out, L)

    def adam(g, m, v, b1, b2, c1, c2, eps, m_out, v_out, d_out):
        """Adam moments and direction, elementwise: m' = b1 m + (1 - b1) g, v' = b2 v + (1 - b2) g^2,
        d = -(m'/c1) / (sqrt(v'/c2) + eps) (the NumPy rule of vfesim.integrators.gradient_flow)."""
        k = cuda.grid(1)
        if k >= g.shape[0]:
            return
        gk = g[k]
        mk = b1 * m[k] + (1.0 - b1) * gk
        vk = b2 * v[k] + (1.0 - b2) * gk * gk
        m_out[k] = mk
        v_out[k] = vk
        d_out[k] = -(mk / c1) / (math.sqrt(vk / c2) + eps)

    pyfuncs = {
        "gradient_flow": gradient_flow,
        "kick_drift": kick_drift,
        "theta_to_sigma": theta_to_sigma,
        "adam": adam,
    }
    return compile_kernels(pyfuncs)


def kernel_signatures(dtype: str) -> dict[str, str]:
    """Numba signature strings of every update kernel for a state dtype, for ``cuda.compile_ptx``."""
    f = "float32" if np.dtype(dtype) == np.float32 else "float64"
    a1, a2, a3 = (f"{f}[{', '.join([':'] * (n - 1) + ['::1'])}]" for n in (1, 2, 3))
    d, i, flag = "float64", "int64", "int32[::1]"
    state = f"{a2}, {a3}, {a2}, {a3}, {a2}"
    return {
        "gradient_flow": f"void({state}, {state}, float64[::1], {i}, {state}, {flag})",
        "kick_drift": (
            f"void({a2}, {a2}, {a2}, {a2}, {a2}, {a3}, {d}, {d}, {d}, {d}, {a3}, {a2}, {a2}, {a2}, {d}, "
            f"boolean, {flag})"
        ),
        "theta_to_sigma": f"void({a2}, {a3})",
        "adam": f"void({a1}, {a1}, {a1}, {d}, {d}, {d}, {d}, {d}, {a1}, {a1}, {a1})",
    }
