"""numba.cuda kernels of the density-matrix per-agent stages: :mod:`vfesim_kernels.quantum_math` (the
maths written once) run with one thread per agent, each agent's matrices in per-thread local memory.

The operations of ``vfesim.quantum.energy.QuantumOps`` (shapes there). Launch with
``[ceil(N / BLOCK), BLOCK]``; every kernel takes the agent count from its first batched argument.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import complex64, complex128

from .. import quantum_math as _qm
from .core import _NB, compile_kernels, cuda, device

__all__ = ["make_quantum_kernels"]

_m = _qm.link(device, "cuda")
_eig_log_agent = _m.eig_log_agent
_gibbs_agent = _m.gibbs_agent
_frames_agent = _m.frames_agent
_pull_features_agent = _m.pull_features_agent
_pull_vjp_agent = _m.pull_vjp_agent
_dk_log_agent = _m.dk_log_agent
_dk_exp_agent = _m.dk_exp_agent
_frames_vjp_agent = _m.frames_vjp_agent
_sender_state_agent = _m.sender_state_agent
_channel_step_agent = _m.channel_step_agent
_incoming_agent = _m.incoming_agent
_channel_step_vjp_agent = _m.channel_step_vjp_agent

_COMPLEX = {np.dtype(np.complex64): complex64, np.dtype(np.complex128): complex128}


@functools.cache
def make_quantum_kernels(d: int, dtype: str) -> dict:
    """The per-agent kernels for matrices of size ``d`` and complex ``dtype``: eig_log, gibbs, frames,
    pull_features, pull_vjp, dk_log, dk_exp, frames_vjp, sender_states, channel_step, channel_step_vjp,
    incoming (arguments as the CPU kernels of :mod:`vfesim_kernels.quantum_cpu`, without the agent
    range)."""
    cdt = _COMPLEX[np.dtype(dtype)]
    rdt = _NB[np.finfo(np.dtype(dtype)).dtype]

    def eig_log(x, tol2, s, W, logx, xlx):
        for n in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            A = cuda.local.array((d, d), cdt)
            r = cuda.local.array(d, rdt)
            _eig_log_agent(x, n, s, W, logx, xlx, A, r, tol2)

    def gibbs(H, T, tol2, sigma, logsig, l, p, V):
        for n in range(cuda.grid(1), H.shape[0], cuda.gridsize(1)):
            A = cuda.local.array((d, d), cdt)
            _gibbs_agent(H, T, n, sigma, logsig, l, p, V, A, tol2)

    def frames(phi, J, tol2, U, k, V):
        for n in range(cuda.grid(1), phi.shape[0], cuda.gridsize(1)):
            A = cuda.local.array((d, d), cdt)
            _frames_agent(phi, J, n, U, k, V, A, tol2)

    def pull_features(U, a, loga, Aout, Bout):
        for n in range(cuda.grid(1), U.shape[0], cuda.gridsize(1)):
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            _pull_features_agent(U, a, loga, n, Aout, Bout, T1, T2)

    def pull_vjp(gA, gB, U, a, loga, abar, labar, Ubar):
        for n in range(cuda.grid(1), U.shape[0], cuda.gridsize(1)):
            C = cuda.local.array((d, d), cdt)
            M = cuda.local.array((d, d), cdt)
            T = cuda.local.array((d, d), cdt)
            _pull_vjp_agent(gA, gB, U, a, loga, n, abar, labar, Ubar, C, M, T)

    def dk_log(s, W, E, out):
        for n in range(cuda.grid(1), W.shape[0], cuda.gridsize(1)):
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            _dk_log_agent(s, W, E, n, out, T1, T2)

    def dk_exp(l, p, V, E, out):
        for n in range(cuda.grid(1), V.shape[0], cuda.gridsize(1)):
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            _dk_exp_agent(l, p, V, E, n, out, T1, T2)

    def frames_vjp(Ubar, k, V, J, out):
        for n in range(cuda.grid(1), V.shape[0], cuda.gridsize(1)):
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            T3 = cuda.local.array((d, d), cdt)
            _frames_vjp_agent(Ubar, k, V, J, n, out, T1, T2, T3)

    def sender_states(rho, U, xt):
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            T = cuda.local.array((d, d), cdt)
            _sender_state_agent(rho, U, n, xt, T)

    def channel_step(
        rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, modes, thr, width, dt, floor, tol2,
        out, gmin,
    ):  # fmt: skip
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            X = cuda.local.array((d, d), cdt)
            S = cuda.local.array((d, d), cdt)
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            W = cuda.local.array((d, d), cdt)
            Ut = cuda.local.array((d, d), cdt)
            Y = cuda.local.array((d, d), cdt)
            w = cuda.local.array(d, rdt)
            xs = cuda.local.array((1, 1, 1, 1), cdt)  # no tape
            _channel_step_agent(
                rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, n, modes, thr, width, dt,
                floor, tol2, out, gmin, X, S, T1, T2, W, w, Ut, Y, xs,
            )  # fmt: skip

    def channel_step_vjp(
        rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, modes, prm, ob, xs, mats, accm,
        sw, racc, scal, gmin, flag,
    ):  # fmt: skip
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            Tm = cuda.local.array((9, d, d), cdt)
            w = cuda.local.array(d, rdt)
            _channel_step_vjp_agent(
                rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, n, modes, prm, ob, xs,
                mats, accm, sw, racc, scal, gmin, flag, Tm, w,
            )  # fmt: skip

    def incoming(rho, U, slots, s, Bt, x_bar, U_bar):
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            Y = cuda.local.array((d, d), cdt)
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            _incoming_agent(rho, U, slots, s, Bt, n, x_bar, U_bar, Y, T1, T2)

    pyfuncs = {
        "eig_log": eig_log,
        "gibbs": gibbs,
        "frames": frames,
        "pull_features": pull_features,
        "pull_vjp": pull_vjp,
        "dk_log": dk_log,
        "dk_exp": dk_exp,
        "frames_vjp": frames_vjp,
        "sender_states": sender_states,
        "channel_step": channel_step,
        "channel_step_vjp": channel_step_vjp,
        "incoming": incoming,
    }
    return compile_kernels(pyfuncs)
