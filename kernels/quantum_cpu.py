"""Numba CPU kernels of the density-matrix per-agent stages: :mod:`vfesim_kernels.quantum_math` run over
agents in parallel, each agent's matrices in per-agent scratch (no batched temporaries).

The operations and their shapes are those of the NumPy stages in ``vfesim.quantum`` (see
``vfesim.quantum.energy.QuantumOps``): complex64 or complex128 matrices (N, d, d), real vectors (N, d) of
the matching precision. Agents are independent and every result is per agent, so results do not depend
on the thread count.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from . import quantum_math as _qm

__all__ = [
    "eig_log",
    "gibbs",
    "frames",
    "frames_vjp",
    "pull_features",
    "pull_vjp",
    "dk_log",
    "dk_exp",
    "jacobi_tol2",
]

_m = _qm.link(numba.njit(nogil=True, cache=True), "cpu")
_eig_log_agent = _m.eig_log_agent
_gibbs_agent = _m.gibbs_agent
_frames_agent = _m.frames_agent
_pull_features_agent = _m.pull_features_agent
_pull_vjp_agent = _m.pull_vjp_agent
_dk_log_agent = _m.dk_log_agent
_dk_exp_agent = _m.dk_exp_agent
_frames_vjp_agent = _m.frames_vjp_agent

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


def jacobi_tol2(dtype) -> float:
    """Stopping threshold of the Jacobi sweeps (squared relative off-diagonal norm): a few ulps squared."""
    eps = float(np.finfo(np.dtype(dtype)).eps)
    return (4.0 * eps) ** 2


def _real(dtype) -> np.dtype:
    return np.finfo(np.dtype(dtype)).dtype


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


def _c(a):
    return np.ascontiguousarray(a)


def eig_log(x):
    """(s, W, log x, tr(x log x)) of floored beliefs x (N, d, d)."""
    N, d = x.shape[:2]
    s = np.empty((N, d), _real(x.dtype))
    W, logx = np.empty_like(x), np.empty_like(x)
    xlx = np.empty(N, s.dtype)
    _run(_eig_log, N, _c(x), jacobi_tol2(x.dtype), s, W, logx, xlx)
    return s, W, logx, xlx


def gibbs(H, T):
    """(sigma, log sigma, l, p, V) of Gibbs priors exp(-H/T)/Z."""
    N, d = H.shape[:2]
    l, p = np.empty((N, d), T.dtype), np.empty((N, d), T.dtype)
    sigma, logsig, V = np.empty_like(H), np.empty_like(H), np.empty_like(H)
    _run(_gibbs, N, _c(H), _c(T), jacobi_tol2(H.dtype), sigma, logsig, l, p, V)
    return sigma, logsig, l, p, V


def frames(phi, J, dtype):
    """(U, (k, V)): U_i = exp(-i phi_i . J) of complex ``dtype`` and the eigen-decomposition of phi_i . J."""
    dtype = np.dtype(dtype)
    N, d = phi.shape[0], J.shape[-1]
    U, V = np.empty((N, d, d), dtype), np.empty((N, d, d), dtype)
    k = np.empty((N, d), _real(dtype))
    phi = _c(phi.astype(_real(dtype), copy=False))
    _run(_frames, N, phi, _c(np.asarray(J, dtype)), jacobi_tol2(dtype), U, k, V)
    return U, (k, V)


def pull_features(U, a, loga):
    """(hvec(U^dagger a U), -2 hvec(U^dagger (log a) U)) (N, d^2) each."""
    N, d = U.shape[:2]
    A = np.empty((N, d * d), _real(U.dtype))
    B = np.empty_like(A)
    _run(_pull_features, N, _c(U), _c(a), _c(loga), A, B)
    return A, B


def pull_vjp(gA, gB, U, a, loga):
    """(a_bar, log_a_bar, U_bar) from the feature cotangents gA, gB (N, d^2)."""
    N = U.shape[0]
    abar, labar, Ubar = np.empty_like(U), np.empty_like(U), np.empty_like(U)
    _run(_pull_vjp, N, _c(gA), _c(gB), _c(U), _c(a), _c(loga), abar, labar, Ubar)
    return abar, labar, Ubar


def dk_log(s, W, E):
    """Dlog(x)[E] for x = W diag(s) W^dagger."""
    N = W.shape[0]
    out = np.empty_like(W)
    _run(_dk_log, N, _c(s), _c(W), _c(E.astype(W.dtype, copy=False)), out)
    return out


def dk_exp(l, p, V, E):
    """Dexp(L)[E] for L = V diag(l) V^dagger, p = exp(l)."""
    N = V.shape[0]
    out = np.empty_like(V)
    _run(_dk_exp, N, _c(l), _c(p), _c(V), _c(E.astype(V.dtype, copy=False)), out)
    return out


def frames_vjp(U_bar, cache, J):
    """phi_bar (N, 3) of the cotangent U_bar of U = exp(-i phi . J) (rule R2)."""
    k, V = cache
    N = V.shape[0]
    out = np.empty((N, 3), k.dtype)
    _run(_frames_vjp, N, _c(U_bar), _c(k), _c(V), _c(np.asarray(J, V.dtype)), out)
    return out
