"""Numba CPU kernels of the density-matrix per-agent stages: :mod:`vfesim_kernels.quantum_math` run over
agent ranges on a few threads, each agent's matrices in per-thread scratch (no batched temporaries).

The operations, arguments and shapes are those of the CUDA kernels
(:func:`vfesim_kernels.cuda.make_quantum_kernels`); ``vfesim.quantum.kernel_ops`` wraps either set as
the stages of the one assembly. Agents are independent and every result is per agent, so results do not
depend on the thread count.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from . import quantum_math as _qm

__all__ = ["KERNELS", "launch", "launch_serial", "MIN_AGENTS_PER_THREAD"]

_m = _qm.link(numba.njit(nogil=True, cache=True), "cpu")
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

# Serial kernels over an agent range, run on a few Python threads (they release the GIL): parallel over
# agents without Numba's parfors, whose compilation costs ~3 s per kernel and dtype (the kernels here
# compile in ~0.5 s each).
_kernel = numba.njit(nogil=True, cache=True)
# Agents per thread below which one thread does all the work.
MIN_AGENTS_PER_THREAD = 64
_pool: ThreadPoolExecutor | None = None


def _run(kernel, N: int, *args) -> None:
    """kernel(n0, n1, *args) over agent ranges covering 0 .. N, on up to numba.get_num_threads() threads."""
    global _pool
    parts = max(1, min(numba.get_num_threads(), N // MIN_AGENTS_PER_THREAD))
    if parts == 1:
        kernel(0, N, *args)
        return
    if _pool is None or _pool._max_workers < parts:
        _pool = ThreadPoolExecutor(max_workers=parts, thread_name_prefix="vfesim-agents")
    bounds = [N * k // parts for k in range(parts + 1)]
    futures = [_pool.submit(kernel, bounds[k], bounds[k + 1], *args) for k in range(parts)]
    for f in futures:
        f.result()


@_kernel
def _eig_log(n0, n1, x, tol2, s, W, logx, xlx):
    d = x.shape[1]
    A = np.empty((d, d), x.dtype)
    r = np.empty(d, s.dtype)
    for n in range(n0, n1):
        _eig_log_agent(x, n, s, W, logx, xlx, A, r, tol2)


@_kernel
def _gibbs(n0, n1, H, T, tol2, sigma, logsig, l, p, V):
    d = H.shape[1]
    A = np.empty((d, d), H.dtype)
    for n in range(n0, n1):
        _gibbs_agent(H, T, n, sigma, logsig, l, p, V, A, tol2)


@_kernel
def _frames(n0, n1, phi, J, tol2, U, k, V):
    d = U.shape[1]
    A = np.empty((d, d), U.dtype)
    for n in range(n0, n1):
        _frames_agent(phi, J, n, U, k, V, A, tol2)


@_kernel
def _pull_features(n0, n1, U, a, loga, Aout, Bout):
    d = U.shape[1]
    T = np.empty((2, d, d), U.dtype)
    for n in range(n0, n1):
        _pull_features_agent(U, a, loga, n, Aout, Bout, T[0], T[1])


@_kernel
def _pull_vjp(n0, n1, gA, gB, U, a, loga, abar, labar, Ubar):
    d = U.shape[1]
    T = np.empty((3, d, d), U.dtype)
    for n in range(n0, n1):
        _pull_vjp_agent(gA, gB, U, a, loga, n, abar, labar, Ubar, T[0], T[1], T[2])


@_kernel
def _dk_log(n0, n1, s, W, E, out):
    d = W.shape[1]
    T = np.empty((2, d, d), W.dtype)
    for n in range(n0, n1):
        _dk_log_agent(s, W, E, n, out, T[0], T[1])


@_kernel
def _dk_exp(n0, n1, l, p, V, E, out):
    d = V.shape[1]
    T = np.empty((2, d, d), V.dtype)
    for n in range(n0, n1):
        _dk_exp_agent(l, p, V, E, n, out, T[0], T[1])


@_kernel
def _frames_vjp(n0, n1, Ubar, k, V, J, out):
    d = V.shape[1]
    T = np.empty((3, d, d), V.dtype)
    for n in range(n0, n1):
        _frames_vjp_agent(Ubar, k, V, J, n, out, T[0], T[1], T[2])


@_kernel
def _sender_states(n0, n1, rho, U, xt):
    d = rho.shape[1]
    T = np.empty((d, d), rho.dtype)
    for n in range(n0, n1):
        _sender_state_agent(rho, U, n, xt, T)


@_kernel
def _channel_step(
    n0, n1, rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, modes, thr, width, dt, floor,
    tol2, out, gmin,
):  # fmt: skip
    d = rho.shape[1]
    T = np.empty((7, d, d), rho.dtype)
    w = np.empty(d, lam.dtype)
    xs = np.empty((1, 1, 1, 1), rho.dtype)  # no tape
    for n in range(n0, n1):
        _channel_step_agent(
            rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, n, modes, thr, width, dt, floor,
            tol2, out, gmin, T[0], T[1], T[2], T[3], T[4], w, T[5], T[6], xs,
        )  # fmt: skip


@_kernel
def _channel_step_vjp(
    n0, n1, rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, modes, prm, ob, xs, mats,
    accm, sw, racc, scal, gmin, flag,
):  # fmt: skip
    d = rho.shape[1]
    Tm = np.empty((9, d, d), rho.dtype)
    w = np.empty(d, lam.dtype)
    for n in range(n0, n1):
        _channel_step_vjp_agent(
            rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, n, modes, prm, ob, xs, mats,
            accm, sw, racc, scal, gmin, flag, Tm, w,
        )  # fmt: skip


@_kernel
def _incoming(n0, n1, rho, U, slots, s, Bt, x_bar, U_bar):
    d = rho.shape[1]
    T = np.empty((3, d, d), rho.dtype)
    for n in range(n0, n1):
        _incoming_agent(rho, U, slots, s, Bt, n, x_bar, U_bar, T[0], T[1], T[2])


KERNELS = {
    "eig_log": _eig_log,
    "gibbs": _gibbs,
    "frames": _frames,
    "pull_features": _pull_features,
    "pull_vjp": _pull_vjp,
    "dk_log": _dk_log,
    "dk_exp": _dk_exp,
    "frames_vjp": _frames_vjp,
    "sender_states": _sender_states,
    "channel_step": _channel_step,
    "channel_step_vjp": _channel_step_vjp,
    "incoming": _incoming,
}


def launch(name: str, N: int, d: int, dtype, *args) -> None:
    """Run kernel ``name`` over agents 0 .. N (arguments as the CUDA kernels of
    :func:`vfesim_kernels.cuda.make_quantum_kernels`; d and dtype unused: the CPU kernels specialise on
    their arguments)."""
    _run(KERNELS[name], N, *args)


def launch_serial(name: str, N: int, d: int, dtype, *args) -> None:
    """:func:`launch` in the calling thread only (tasks of a scheduler that runs its own threads)."""
    KERNELS[name](0, N, *args)
