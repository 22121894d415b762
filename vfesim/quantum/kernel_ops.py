"""The per-agent stages of density-matrix agents (:class:`~.energy.QuantumOps`) run by kernels: the CPU
kernels of :mod:`vfesim_kernels.quantum_cpu` or the CUDA kernels of
:func:`vfesim_kernels.cuda.make_quantum_kernels` (one source, :mod:`vfesim_kernels.quantum_math`).

:func:`kernel_ops` allocates the outputs with the backend's array module (``array_module()``, asked at
each call: a backend module imports without its device) and hands every operation to a
``launch(name, N, d, dtype, *args)`` of the backend; the arguments are C-contiguous arrays in the
kernels' dtypes (complex matrices, real vectors of the matching precision, a float64 tolerance).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .energy import QuantumOps, floor_eps
from .evolve import resident, window

__all__ = ["kernel_ops", "kernel_step_vjp", "sized_ops", "jacobi_tol2"]

# Which argument of each stage carries the matrix size d (its last axis).
_SIZE_ARG = {
    "eig_log": 0,
    "gibbs": 0,
    "frames": 1,
    "pull_features": 0,
    "pull_vjp": 2,
    "dk_log": 1,
    "dk_exp": 2,
    "frames_vjp": 0,
    "channel_step": 1,
}
# Codes of the channel step's modes (vfesim_kernels.quantum_math.channel_step_agent).
_COUPLING = {"none": 0, "C1": 1, "C2": 2}
_BASIS = {"computational": 0, "energy": 1}
_GATE = {"none": 0, "soft": 1, "hard": 2}


def jacobi_tol2(dtype) -> float:
    """Stopping threshold of the Jacobi sweeps (squared relative off-diagonal norm): (4 ulp)^2."""
    eps = float(np.finfo(np.dtype(dtype)).eps)
    return (4.0 * eps) ** 2


def _real(dtype) -> np.dtype:
    return np.finfo(np.dtype(dtype)).dtype


def kernel_ops(array_module: Callable, launch: Callable) -> QuantumOps:
    """A :class:`QuantumOps` whose stages run ``launch`` on arrays of ``array_module()``; its ``step_vjp``
    is :func:`kernel_step_vjp` for every d."""

    def c(a):
        a = array_module().ascontiguousarray(a)
        # A read-only NumPy input (e.g. a SparseNeighbours' index) is copied: the CUDA simulator (and numba
        # for host arrays) copies every argument back after a launch.
        return a.copy() if isinstance(a, np.ndarray) and not a.flags.writeable else a

    def run(name, like, *args):
        N, d = like.shape[0], like.shape[-1]
        launch(name, N, d, like.dtype, *args)

    def eig_log(x):
        xp = array_module()
        x = c(x)
        N, d = x.shape[:2]
        s = xp.empty((N, d), _real(x.dtype))
        W, logx = xp.empty_like(x), xp.empty_like(x)
        xlx = xp.empty(N, s.dtype)
        run("eig_log", x, x, jacobi_tol2(x.dtype), s, W, logx, xlx)
        return s, W, logx, xlx

    def gibbs(H, T):
        xp = array_module()
        H = c(H)
        N, d = H.shape[:2]
        l, p = xp.empty((N, d), T.dtype), xp.empty((N, d), T.dtype)
        sigma, logsig, V = xp.empty_like(H), xp.empty_like(H), xp.empty_like(H)
        run("gibbs", H, H, c(T), jacobi_tol2(H.dtype), sigma, logsig, l, p, V)
        return sigma, logsig, l, p, V

    def frames(phi, J, dtype):
        xp = array_module()
        dtype = np.dtype(dtype)
        N, d = phi.shape[0], J.shape[-1]
        U, V = xp.empty((N, d, d), dtype), xp.empty((N, d, d), dtype)
        k = xp.empty((N, d), _real(dtype))
        phi = c(phi.astype(_real(dtype), copy=False))
        run("frames", U, phi, xp.array(J, dtype), jacobi_tol2(dtype), U, k, V)
        return U, (k, V)

    def pull_features(U, a, loga):
        xp = array_module()
        N, d = U.shape[:2]
        A = xp.empty((N, d * d), _real(U.dtype))
        B = xp.empty_like(A)
        run("pull_features", U, c(U), c(a), c(loga), A, B)
        return A, B

    def pull_vjp(gA, gB, U, a, loga):
        xp = array_module()
        abar, labar, Ubar = xp.empty_like(U), xp.empty_like(U), xp.empty_like(U)
        run("pull_vjp", U, c(gA), c(gB), c(U), c(a), c(loga), abar, labar, Ubar)
        return abar, labar, Ubar

    def dk_log(s, W, E):
        xp = array_module()
        out = xp.empty_like(W)
        run("dk_log", W, c(s), c(W), c(E.astype(W.dtype, copy=False)), out)
        return out

    def dk_exp(l, p, V, E):
        xp = array_module()
        out = xp.empty_like(V)
        run("dk_exp", V, c(l), c(p), c(V), c(E.astype(V.dtype, copy=False)), out)
        return out

    def frames_vjp(U_bar, cache, J):
        xp = array_module()
        k, V = cache
        out = xp.empty((V.shape[0], 3), k.dtype)
        run("frames_vjp", V, c(U_bar), c(k), c(V), xp.array(J, V.dtype), out)
        return out

    def channel_step(P, rho, dt, dyn):
        xp = array_module()
        rho = c(rho)
        args, gmin = _step_args(xp, c, P, rho, dt, dyn)
        out = xp.empty_like(rho)
        run("channel_step", rho, rho, *args, out, gmin)
        if dyn.gate != "none":
            _refuse_non_positive(xp, gmin <= 0, gmin)
        return out

    step_vjp = kernel_step_vjp(array_module, launch)
    return QuantumOps(
        eig_log, gibbs, frames, pull_features, pull_vjp, dk_log, dk_exp, frames_vjp, channel_step,
        lambda d: step_vjp,
    )  # fmt: skip


def _step_args(xp, c, P, rho, dt, dyn):
    """The channel step kernels' leading arguments (after rho) for Prepared caches P, and a gmin array. The
    run's constants (coupling window, strengths of the rates at this dt, mode codes) are made on the
    device once per cache (:func:`.evolve.resident`), not copied again every step."""
    dt = float(dt)
    # vfesim.quantum.channels.dephasing_strength
    eps_d = resident(P, xp, "eps_d", P.gamma, lambda: -xp.expm1(-P.gamma * dt), tag=dt)
    eps_t = resident(P, xp, "eps_t", P.gamma_th, lambda: -xp.expm1(-P.gamma_th * dt), tag=dt)
    codes = (
        _COUPLING[dyn.coupling],
        _BASIS[dyn.dephasing_basis],
        _GATE[dyn.gate],
        int(rho.dtype == np.complex64),
    )
    modes = resident(P, xp, "modes", None, lambda: xp.asarray(codes, np.int64), tag=codes)
    index, mask = window(P, xp)
    floor = float(floor_eps(rho.dtype))
    args = (
        index,
        mask,
        c(P.U),
        c(P.eps_c),
        c(P.lam),
        c(P.V),
        c(P.sigma),
        c(P.l),
        c(eps_d),
        c(eps_t),
        modes,
        float(dyn.gate_threshold),
        float(dyn.gate_width),
        dt,
        floor,
        jacobi_tol2(rho.dtype),
    )
    return args, xp.full(rho.shape[0], np.inf, _real(rho.dtype))


def _refuse_non_positive(xp, bad, gmin) -> None:
    if bool(bad.any()):
        i = int(xp.argmax(bad))
        raise ValueError(
            f"rho[agent={i}]: not positive semidefinite (floored eigenvalue {float(gmin[i]):.3g})"
        )


def kernel_step_vjp(array_module: Callable, launch: Callable) -> Callable:
    """The adjoint of one Jacobi channel step by the kernels (``channel_step_vjp``, forward recomputed per
    agent): ``vjp(P, rho, out_bar, dt, dynamics, gap_tol=1e-9) -> dict`` of per-agent cotangents, the
    terms of ``vfesim.quantum.rollout._update_vjp``: ``x_bar`` (N, d, d) (senders' parts not added),
    ``R_bar`` (N, w, d, d) (sender slot k of agent n), ``eps_c_bar`` (N, w), ``M_bar`` (N, w, d, d),
    ``H_bar``, ``sigma_bar``, ``logsig_bar`` (N, d, d), ``eps_d_bar``, ``eps_t_bar``, ``tg`` (t_bar g),
    ``D_bar``, ``D`` (N,)."""

    def vjp(P, rho, out_bar, dt, dyn, gap_tol=1e-9):
        xp = array_module()

        def c(a):
            a = xp.ascontiguousarray(a)
            return a.copy() if isinstance(a, np.ndarray) and not a.flags.writeable else a

        rho = c(rho)
        N, d = rho.shape[:2]
        w = P.index.shape[1]
        rdt = _real(rho.dtype)
        args, gmin = _step_args(xp, c, P, rho, dt, dyn)
        xs = xp.empty((N, w + 1, d, d), rho.dtype)
        mats = xp.empty((4, N, d, d), rho.dtype)  # x_bar, H_bar, sigma_bar, logsig_bar
        out = dict(
            R_bar=xp.empty((N, w, d, d), rho.dtype), eps_c_bar=xp.empty((N, w), rdt),
            M_bar=xp.empty((N, w, d, d), rho.dtype),
        )  # fmt: skip
        scal = xp.empty((N, 5), rdt)
        flag = xp.zeros(N, np.int64)
        idx, msk, U, eps_c, lam, V, sigma, l, eps_d, eps_t, modes, *scalars = args
        values = (*scalars, float(gap_tol))  # thr, width, dt, floor, tol2, gap_tol
        prm = resident(P, xp, "prm", None, lambda: xp.asarray(values, np.float64), tag=values)
        launch(
            "channel_step_vjp", N, d, rho.dtype, rho, idx, msk, U, eps_c, lam, V, sigma, l, eps_d, eps_t,
            modes, prm, c(out_bar.astype(rho.dtype, copy=False)), xs, mats, out["R_bar"], out["eps_c_bar"],
            out["M_bar"], scal, gmin, flag,
        )  # fmt: skip
        out.update(x_bar=mats[0], H_bar=mats[1], sigma_bar=mats[2], logsig_bar=mats[3])
        if bool((flag == 1).any()):
            i = int(xp.argmax(flag == 1))
            raise ValueError(
                f"hamiltonian[agent={i}]: energy-basis dephasing is not differentiable at a degenerate "
                f"spectrum (eigenvalue gap below {gap_tol:g} relative)"
            )
        _refuse_non_positive(xp, flag == 2, gmin)
        for k, col in zip(("eps_d_bar", "eps_t_bar", "tg", "D_bar", "D"), range(5), strict=True):
            out[k] = scal[:, col]
        return out

    return vjp


def sized_ops(small: QuantumOps, large: QuantumOps, max_d: int) -> QuantumOps:
    """Stages that run ``small`` for matrices up to ``max_d`` and ``large`` above (e.g. per-agent Jacobi
    kernels for small d, batched LAPACK / cuSOLVER array code for larger d); ``step_vjp(d)`` is the one
    of the same side, so a channel step and its adjoint always come from one of them."""

    def pick(name):
        i = _SIZE_ARG[name]
        lo, hi = getattr(small, name), getattr(large, name)

        def stage(*args):
            return (lo if args[i].shape[-1] <= max_d else hi)(*args)

        stage.__name__ = name
        return stage

    def step_vjp(d):
        return (small if d <= max_d else large).step_vjp(d)

    stages = {name: pick(name) for name in _SIZE_ARG}
    return QuantumOps(**stages, step_vjp=step_vjp)
