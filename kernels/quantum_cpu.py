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
_energy_prep_agent = _m.energy_prep_agent
_energy_features_agent = _m.energy_features_agent
_energy_backward_agent = _m.energy_backward_agent
_sender_state_agent = _m.sender_state_agent
_channel_step_agent = _m.channel_step_agent
_incoming_agent = _m.incoming_agent
_channel_step_vjp_agent = _m.channel_step_vjp_agent
_born_logp_entry = _m.born_logp_entry
_born_add_entry = _m.born_add_entry

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
def _energy_prep(
    t0, t1, rho, H, T, phi, J, fs, fb, fp, eps, tol2, x, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf
):  # fmt: skip
    d = rho.shape[1]
    Ms = np.empty((d, d), rho.dtype)
    r = np.empty(d, s.dtype)
    for t in range(t0, t1):
        _energy_prep_agent(
            t, rho, H, T, phi, J, fs, fb, fp, eps, tol2, x, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf,
            Ms, r,
        )  # fmt: skip


@_kernel
def _energy_features(n0, n1, y, fs, fb, fp, fo, x, logx, xlx, sigma, logsig, l, p, U, e, A, B, c):
    d = x.shape[1]
    Ts = np.empty((2, d, d), x.dtype)
    for n in range(n0, n1):
        _energy_features_agent(
            y, fs, fb, fp, fo, n, x, logx, xlx, sigma, logsig, l, p, U, e, A, B, c, Ts[0], Ts[1]
        )


@_kernel
def _energy_backward(
    n0, n1, H, T, y, J, fs, fb, fp, fo, ls, lb, lp, lo, eps, gA, gB, gc, x, s, W, logx, sigma, logsig, l, p,
    V, U, k, Vf, g_rho, g_H, g_T, g_phi,
):  # fmt: skip
    d = x.shape[1]
    S = np.empty((10, d, d), x.dtype)
    for n in range(n0, n1):
        _energy_backward_agent(
            H, T, y, J, fs, fb, fp, fo, ls, lb, lp, lo, eps, gA, gB, gc, n, x, s, W, logx, sigma, logsig, l,
            p, V, U, k, Vf, g_rho, g_H, g_T, g_phi, S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7], S[8],
            S[9],
        )  # fmt: skip


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
    T = np.empty((2, d, d), rho.dtype)
    for n in range(n0, n1):
        _incoming_agent(rho, U, slots, s, Bt, n, x_bar, U_bar, T[0], T[1])


@_kernel
def _born_logp(k0, k1, flat, offsets, keep, add, acc):
    for k in range(k0, k1):
        _born_logp_entry(flat, offsets, k, keep, add, acc)


@_kernel
def _born_add(k0, k1, bar, bar_offsets, flat, offsets, keep, add, c):
    for k in range(k0, k1):
        _born_add_entry(bar, bar_offsets, flat, offsets, k, keep, add, c)


KERNELS = {
    "energy_prep": _energy_prep,
    "energy_features": _energy_features,
    "energy_backward": _energy_backward,
    "sender_states": _sender_states,
    "channel_step": _channel_step,
    "channel_step_vjp": _channel_step_vjp,
    "incoming": _incoming,
    "born_logp": _born_logp,
    "born_add": _born_add,
}


def launch(name: str, N: int, d: int, dtype, *args, modes=None) -> None:
    """Run kernel ``name`` over items 0 .. N (agents; parts of agents for ``energy_prep``, N = 3 x agents;
    arguments as the CUDA kernels of
    :func:`vfesim_kernels.cuda.make_quantum_kernels`; d, dtype and the channel step's ``modes`` unused:
    the CPU kernels specialise on their arguments and read the modes from their array argument)."""
    _run(KERNELS[name], N, *args)


def launch_serial(name: str, N: int, d: int, dtype, *args, modes=None) -> None:
    """:func:`launch` in the calling thread only (tasks of a scheduler that runs its own threads)."""
    KERNELS[name](0, N, *args)
