"""The per-agent stages of density-matrix agents (:class:`~.energy.QuantumOps`) run by kernels: the CPU
kernels of :mod:`vfesim_kernels.quantum_cpu` or the CUDA kernels of
:func:`vfesim_kernels.cuda.make_quantum_kernels` (one source, :mod:`vfesim_kernels.quantum_math`).

:func:`kernel_ops` allocates the outputs with the backend's array module (``array_module()``, asked at
each call: a backend module imports without its device) and hands every operation to a
``launch(name, N, d, dtype, *args)`` of the backend over N threads (one per agent, or per part of an
agent's work: ``energy_prep`` takes 3 N); the arguments are arrays in the kernels' dtypes (complex
matrices, real vectors of the matching precision) and Python scalars (int64 term flags, float64 weights
and tolerances). The channel step's kernels also get their mode codes as a keyword, ``modes=(coupling,
basis, gate, newton)`` (the same codes as their ``modes`` array argument): a launch that compiles kernels
may specialise on them (the cuda backend's does; the CPU kernels read the array).

Layout: C-contiguous by default (one thread per agent on a CPU core walks its own rows). With
``agent_minor=True`` (the GPU) every per-agent array the kernels read or write, except the feature rows
the pair kernels take, is :func:`vfesim.arrays.agent_minor`: the agent axis fastest in memory, so the
threads of a warp touch consecutive addresses (the kernels index ``x[n, r, c]`` either way; only the
strides differ, and the results are bitwise the same). The channel step returns its states so laid out,
and takes them back without a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..arrays import agent_minor as _minor
from ..arrays import device_constant, empty_agent_minor
from .born import BornOps, born_add, born_logp
from .channels import incoming_slots
from .energy import Forward, QuantumOps, floor_eps, terms_on
from .evolve import resident, window
from .frames import spin_generators

__all__ = ["kernel_ops", "kernel_step_vjp", "kernel_born", "kernel_accumulators", "sized_ops", "jacobi_tol2"]

# The matrix size d of a stage's call (the last axis of one of its arguments).
_SIZE = {
    "forward": lambda args: args[0]["rho"].shape[-1],
    "backward": lambda args: args[0]["rho"].shape[-1],
    "channel_step": lambda args: args[1].shape[-1],
}
# The alignment terms in the order of the passes' feature and cotangent slots (A[0], A[1], ...).
_SLOTS = ("belief_align", "prior_align")
# Codes of the channel step's modes (vfesim_kernels.quantum_math.channel_step_agent).
_COUPLING = {"none": 0, "C1": 1, "C2": 2}
_BASIS = {"computational": 0, "energy": 1}
_GATE = {"none": 0, "soft": 1, "hard": 2}


def jacobi_tol2(dtype) -> float:
    """Stopping threshold of the Jacobi sweeps (squared relative off-diagonal norm): (4 ulp)^2."""
    eps = float(np.finfo(np.dtype(dtype)).eps)
    return (4.0 * eps) ** 2


_REAL = {np.dtype(np.complex64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.float64)}


def _real(dtype) -> np.dtype:
    """The real dtype of a complex (or real) dtype (a lookup for the usual two: a step's host work)."""
    r = _REAL.get(dtype)
    return np.finfo(np.dtype(dtype)).dtype if r is None else r


def _arranger(array_module: Callable, minor: bool):
    """(c, empty): ``c(a, axis=0)`` the array the kernels take for ``a`` (agent axis ``axis``): agent-minor
    or C-contiguous, a writable copy of a read-only NumPy array (the CUDA simulator, and numba for host
    arrays, copies every argument back after a launch); ``empty(shape, dtype, axis=0)`` a new one."""

    def c(a, axis=0):
        xp = array_module()
        a = _minor(xp.asarray(a), axis) if minor else xp.ascontiguousarray(a)
        return a.copy(order="K") if isinstance(a, np.ndarray) and not a.flags.writeable else a

    def empty(shape, dtype, axis=0):
        xp = array_module()
        return empty_agent_minor(xp, shape, dtype, axis) if minor else xp.empty(shape, dtype)

    return c, empty


def kernel_ops(
    array_module: Callable,
    launch: Callable,
    pairwise: tuple = (None, None),
    agent_minor: bool = False,
    batched_eigh_from: int | None = None,
) -> QuantumOps:
    """A :class:`QuantumOps` whose passes run ``launch`` on arrays of ``array_module()``: the free energy's
    per-agent forward pass in two kernels (``energy_prep`` over 3 N threads, ``energy_features``; four
    with ``batched_eigh_from``), its
    backward pass in one (``energy_backward``), and ``step_vjp`` :func:`kernel_step_vjp` for every d.
    The channel steps make a run's constants once per cache (:func:`.evolve.resident`). ``pairwise``: the
    backend's (pairwise_dense,
    pairwise_sparse) for the free energy of rollouts and mirror steps. ``agent_minor``: the layout of the
    module docstring. ``batched_eigh_from``: the d from which the forward pass's eigen-decompositions run
    as one batched ``eigh`` launch over the 3 N matrices (the cuda backend's cooperative solver), between
    ``energy_mats`` and ``energy_finish``, instead of inside ``energy_prep`` (None: never)."""
    c, empty = _arranger(array_module, agent_minor)

    def forward(arrays, weights):
        xp = array_module()
        rho, H = c(arrays["rho"]), c(arrays["hamiltonian"])
        N, d = rho.shape[:2]
        rdt = _real(rho.dtype)
        T = c(arrays["temperature"].astype(rdt, copy=False))
        phi = c(arrays["phi"].astype(rdt, copy=False))
        on = tuple(int(f) for f in terms_on(weights))
        y = c(xp.asarray(arrays["outcome"]).astype(np.int64, copy=False)) if on[3] else xp.zeros(1, np.int64)
        J = device_constant(xp, ("J", d, rho.dtype.str), lambda: xp.array(spin_generators(d), rho.dtype))
        # One allocation per kind (fewer host calls per pass); each part is laid out as an allocation of
        # its own would be.
        x, W, logx, sigma, logsig, V, U, Vf = empty((8, N, d, d), rho.dtype, axis=1)
        s, l, p, k = empty((4, N, d), rdt, axis=1)
        reals = xp.empty((5, N), rdt)
        xlx, e, cf = reals[0], reals[1:3], reals[3:5]  # e: self, observation; cf: belief, prior
        # the pair kernels' feature rows: row-major in either layout
        A, B = xp.empty((2, 2, N, d * d), rdt)  # each (belief, prior)
        eps = float(floor_eps(rho.dtype))
        fs, fb, fp, fo = on
        prep = (x, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf)
        # 3 N threads: the floored belief's, the prior's and the frame's eigen-decompositions in parallel
        tol2 = jacobi_tol2(rho.dtype)
        if batched_eigh_from is None or d < batched_eigh_from:
            launch("energy_prep", 3 * N, d, rho.dtype, rho, H, T, phi, J, fs, fb, fp, eps, tol2, *prep)
        else:
            M = xp.empty((3 * N, d, d), rho.dtype)
            ew = xp.empty((3 * N, d), rdt)
            eV = xp.empty((3 * N, d, d), rho.dtype)
            launch("energy_mats", 3 * N, d, rho.dtype, rho, H, phi, J, fs, fb, fp, eps, x, M)
            launch("eigh", 3 * N, d, rho.dtype, M, tol2, ew, eV)
            launch("energy_finish", 3 * N, d, rho.dtype, T, fs, fb, fp, ew, eV, *prep[1:])
        launch("energy_features", N, d, rho.dtype, y, *on, x, logx, xlx, sigma, logsig, l, p, U, e, A, B, cf)
        energies = {name: e[i] for i, (name, f) in enumerate((("self", fs), ("observation", fo))) if f}
        on_slots = zip(_SLOTS, (fb, fp), strict=True)
        features = {n: (A[i], B[i], cf[i]) for i, (n, f) in enumerate(on_slots) if f}
        cache = (H, T, y, J, on, eps, (x, s, W, logx, sigma, logsig, l, p, V, U, k, Vf))
        return Forward(energies, features, cache)

    def backward(arrays, fw, weights, cot):
        xp = array_module()
        H, T, y, J, on, eps, cached = fw.cache
        x = cached[0]
        N, d = x.shape[:2]
        rdt = _real(x.dtype)
        gA, gB = xp.empty((2, 2, N, d * d), rdt)  # each (belief, prior)
        gc = xp.empty((2, N), rdt)
        for i, name in enumerate(_SLOTS):
            if name in cot:
                for buf, g in zip((gA, gB, gc), cot[name], strict=True):
                    buf[i] = g
        g_rho, g_H = empty((2, N, d, d), x.dtype, axis=1)
        g_T, g_phi = xp.empty(N, rdt), empty((N, 3), rdt)
        lams = tuple(float(w) for w in weights)
        launch(
            "energy_backward", N, d, x.dtype, H, T, y, J, *on, *lams, eps, gA, gB, gc, *cached, g_rho, g_H,
            g_T, g_phi,
        )  # fmt: skip
        return {"rho": g_rho, "hamiltonian": g_H, "temperature": g_T, "phi": g_phi}

    def channel_step(P, rho, dt, dyn, senders=None):
        xp = array_module()
        rho = c(rho)
        args, gmin, codes = _step_args(xp, c, P, rho, dt, dyn)
        out = empty(rho.shape, rho.dtype)
        if senders is None:
            xt = _sender_states(launch, xp, empty, P, rho, dyn, args[2])
        else:  # a chunk of a population: the window's senders are other agents (their states, frames)
            xt = _chunk_sender_states(launch, xp, c, empty, P, rho, dyn, senders)
        launch("channel_step", rho.shape[0], rho.shape[-1], rho.dtype, rho, xt, *args, out, gmin, modes=codes)
        if dyn.gate != "none":
            _refuse_non_positive(xp, gmin <= 0, gmin)
        return out

    step_vjp = kernel_step_vjp(array_module, launch, agent_minor)
    born = kernel_born(array_module, launch)
    return QuantumOps(forward, backward, channel_step, lambda d: step_vjp, *pairwise, born=born)


def kernel_born(array_module: Callable, launch: Callable) -> BornOps:
    """The Born terms of rollouts (:class:`.born.BornOps`) by the kernels ``born_logp`` and ``born_add``,
    one launch per step each, over the observed entries x_i[y_i, y_i] as the flat view and offsets of
    ``Observations.entries`` (any dense layout; another falls back to the array code). The forward adds
    each step's log-probabilities into a float64 accumulator per observed entry (k-th entry of each step
    into slot k), summed once by ``total``; both compute the floored diagonal (1 - e) rho_yy + e / d and
    its log in the states' real precision, as the array code does."""

    def start(xp, n):
        return xp.zeros(n, np.float64)

    def logp(acc, rho, observed, t):
        if observed.steps[t] is None:
            return acc
        entries = observed.entries(rho, t)
        if entries is None:
            acc[:1] += born_logp(rho, observed, t)
            return acc
        flat, offsets = entries
        keep, add = _floor_terms(rho)
        d = rho.shape[-1]
        launch("born_logp", offsets.shape[0], d, rho.dtype, flat, offsets, keep, add, acc)
        return acc

    def total(acc):
        return float(acc.sum())

    def add_bar(bar, rho, observed, t, weight):
        if observed.steps[t] is None or weight == 0:
            return bar
        got, kept = observed.entries(bar, t), observed.entries(rho, t)
        if got is None or kept is None:
            return born_add(bar, rho, observed, t, weight)
        keep, add = _floor_terms(rho)
        c = keep.dtype.type(-weight * float(1.0 - floor_eps(rho.dtype)))
        d = rho.shape[-1]
        launch("born_add", got[1].shape[0], d, rho.dtype, got[0], got[1], kept[0], kept[1], keep, add, c)
        return bar

    return BornOps(start, logp, total, add_bar)


def _floor_terms(rho):
    """(1 - e, e / d) of the depolarising floor in the states' real precision (the kernels' arithmetic)."""
    rdt = _real(rho.dtype).type
    e = floor_eps(rho.dtype)
    return rdt(1.0 - e), rdt(e / rho.shape[-1])


def _buffer(P, xp, key, make):
    """An array made once per cache P: a scratch buffer of the kernels (the senders' states, the adjoint's
    tape, gmin, flags), shared by every call with the same P and kept for P's lifetime: one thread steps a
    P at a time (runs and rollouts do)."""
    return resident(P, xp, key, None, make)


def _step_args(xp, c, P, rho, dt, dyn):
    """The channel step kernels' arguments after (rho, xt) for Prepared caches P, gmin (the gate's least
    eigenvalue per agent) and the mode codes (a tuple: the launch's ``modes``). The run's constants
    (coupling window, strengths of the rates at this dt, mode codes, and gmin, which the kernels fill for
    every agent under a gate) are made on the device once per cache (:func:`.evolve.resident`), not every
    step."""
    dt = float(dt)
    # The whole tuple, once per (P, module, dtype) for the last (dynamics, dt, arranger): a step's host work
    # is one lookup, not a dozen (a rollout's steps share them).
    last = P.consts.get(("step args", xp.__name__, rho.dtype.str))
    if last is not None and last[0] is dyn and last[1] == dt and last[2] is c:
        return last[3]

    def const(key, source, make, tag=None):
        return resident(P, xp, key, source, make, tag=tag)

    # vfesim.quantum.channels.dephasing_strength
    eps_d = const("eps_d", P.gamma, lambda: c(-xp.expm1(-P.gamma * dt)), tag=dt)
    eps_t = const("eps_t", P.gamma_th, lambda: c(-xp.expm1(-P.gamma_th * dt)), tag=dt)
    codes = (
        _COUPLING[dyn.coupling],
        _BASIS[dyn.dephasing_basis],
        _GATE[dyn.gate],
        int(rho.dtype == np.complex64),
    )
    modes = const("modes", None, lambda: xp.asarray(codes, np.int64), tag=codes)
    index, mask = window(P, xp)
    rdt = _real(rho.dtype)
    args = (
        const("index kernel", index, lambda: c(index)),
        const("mask kernel", mask, lambda: c(mask)),
        *(
            const(k, getattr(P, k), lambda k=k: c(getattr(P, k)))
            for k in ("U", "eps_c", "lam", "V", "sigma", "l")
        ),
        eps_d,
        eps_t,
        modes,
        float(dyn.gate_threshold),
        float(dyn.gate_width),
        dt,
        float(floor_eps(rho.dtype)),
        jacobi_tol2(rho.dtype),
    )
    out = args, _buffer(P, xp, ("gmin", np.dtype(rdt).str), lambda: xp.empty(rho.shape[0], rdt)), codes
    P.consts[("step args", xp.__name__, rho.dtype.str)] = (dyn, dt, c, out)
    return out


def _vjp_args(xp, c, empty, P, rho, dyn, args, gap_tol):
    """The adjoint kernels' arguments beyond :func:`_step_args` for Prepared caches P -> (xs: the tape
    buffer, gam: the two rates (2, N), prm: the float64 parameters, flag: a zero buffer, or None where the
    kernel may flag (a fresh zero array each call), ins: the C1 senders' slots or None), made once per
    (P, module, dtype) for the last (dynamics, step arguments, gap_tol, arranger)."""
    key = ("vjp args", xp.__name__, rho.dtype.str)
    last = P.consts.get(key)
    if last is not None and last[0] is dyn and last[1] is args and last[2] == gap_tol and last[3] is c:
        return last[4]
    N, d = rho.shape[:2]
    w = P.index.shape[1]
    slots = 1 + (w if dyn.coupling == "C2" else 0)  # tape: the C2 channels' inputs, the unitary's input
    xs = _buffer(P, xp, ("xs", rho.dtype.str, slots), lambda: empty((N, slots, d, d), rho.dtype))
    rdt = _real(rho.dtype)
    gam = resident(P, xp, ("gam", rdt.str), P.gamma, lambda: xp.stack([P.gamma, P.gamma_th]).astype(rdt))
    values = (*args[11:], float(gap_tol))  # thr, width, dt, floor, tol2, gap_tol
    prm = resident(P, xp, "prm", None, lambda: xp.asarray(values, np.float64), tag=values)
    checked = dyn.dephasing_basis == "energy" or dyn.gate != "none"
    flag = None if checked else _buffer(P, xp, "flag", lambda: xp.zeros(N, np.int64))
    ins = None
    if dyn.coupling == "C1" and w:
        ins = resident(P, xp, "slots", P.index, lambda: c(incoming_slots(P.index, P.mask, N, xp)))
    out = xs, gam, prm, flag, ins
    P.consts[key] = (dyn, args, gap_tol, c, out)
    return out


def _coupled(P, dyn) -> bool:
    return dyn.coupling != "none" and P.index.shape[1] > 0


def _sender_states(launch, xp, empty, P, rho, dyn, U):
    """The senders' normalised states in their own frames (the ``sender_states`` kernel, frames ``U`` as
    :func:`_step_args` passes them) for the coupling window of a step from ``rho``; without a coupling
    window, rho itself (the kernels do not read it)."""
    if not _coupled(P, dyn):
        return rho
    xt = _buffer(P, xp, ("xt", rho.dtype.str), lambda: empty(rho.shape, rho.dtype))
    N, d = rho.shape[0], rho.shape[-1]
    launch("sender_states", N, d, rho.dtype, rho, U, xt)
    return xt


def _chunk_sender_states(launch, xp, c, empty, P, rho, dyn, senders):
    """:func:`_sender_states` of senders that are not the stepped agents: ``senders`` = (their states
    (n_s, d, d), their frames (n_s, d, d)), the rows the coupling window ``P.index`` names."""
    if not _coupled(P, dyn):
        return rho
    S, U_s = (c(a) for a in senders)
    xt = empty(S.shape, S.dtype)
    launch("sender_states", S.shape[0], S.shape[-1], S.dtype, S, U_s, xt)
    return xt


def _refuse_non_positive(xp, bad, gmin) -> None:
    if bool(bad.any()):
        i = int(xp.argmax(bad))
        raise ValueError(
            f"rho[agent={i}]: not positive semidefinite (floored eigenvalue {float(gmin[i]):.3g})"
        )


def kernel_accumulators(xp, n: int, w: int, d: int, dtype, agent_minor: bool = False) -> dict:
    """Zero accumulators of the kernels' step adjoint (:func:`kernel_step_vjp` adds into them): ``H``,
    ``sigma``, ``logsig``, ``U`` (n, d, d) complex, ``gamma``, ``gamma_th`` (n,) real, ``eps_c`` (n, w)
    real, as views of three arrays (under ``"_kernel"``) the kernel takes whole; ``agent_minor``: the
    layout of the module docstring (the adjoint's own, ``vjp.agent_minor``)."""
    rdt = _real(dtype)
    _, empty = _arranger(lambda: xp, agent_minor)
    m, r, sw = empty((4, n, d, d), dtype, axis=1), xp.zeros((2, n), rdt), empty((3, n, w), rdt, axis=1)
    m[...] = 0
    sw[...] = 0
    acc = dict(H=m[0], sigma=m[1], logsig=m[2], U=m[3], gamma=r[0], gamma_th=r[1], eps_c=sw[1])
    acc["_kernel"] = (m, r, sw)
    return acc


def kernel_step_vjp(array_module: Callable, launch: Callable, agent_minor: bool = False) -> Callable:
    """The adjoint of one Jacobi channel step by the kernels (``channel_step_vjp``, forward recomputed per
    agent, then ``incoming`` for the C1 senders): ``vjp(P, rho, out_bar, dt, dynamics, gap_tol=1e-9,
    acc=None) -> dict``: ``bar`` (N, d, d), the cotangent of the states before the step (each agent's own
    part and, through the coupling, its part as a sender); ``dt_bar`` (a scalar of the arrays' module);
    per agent ``eps_d_bar``, ``eps_t_bar``, ``tg`` (t_bar g), ``D_bar``, ``D`` (N,). The parameters'
    cotangents are added into ``acc`` (:func:`kernel_accumulators`: H, sigma, logsig, U (the frames through
    the coupling, dL = Re tr(U_bar^dag dU)), gamma, gamma_th, eps_c); without ``acc`` into zeros returned
    as ``H_bar``, ``sigma_bar``, ``logsig_bar``, ``U_bar``, ``gamma_bar``, ``gamma_th_bar``,
    ``eps_c_bar``. The array code gets the same from ``vfesim.quantum.rollout._update_terms`` with
    ``channels.add_incoming`` (senders' parts) and ``channels.transports_vjp`` (transports to frames).
    ``agent_minor``: the layout of the module docstring (also ``vjp.agent_minor``, for accumulators)."""
    c, empty = _arranger(array_module, agent_minor)

    def vjp(P, rho, out_bar, dt, dyn, gap_tol=1e-9, acc=None):
        xp = array_module()
        rho = c(rho)
        N, d = rho.shape[:2]
        w = P.index.shape[1]
        rdt = _real(rho.dtype)
        fresh = acc is None
        if fresh:
            acc = kernel_accumulators(xp, N, w, d, rho.dtype, agent_minor)
        accm, racc, sw = acc["_kernel"]
        args, gmin, codes = _step_args(xp, c, P, rho, dt, dyn)
        xs, gam, prm, flag, ins = _vjp_args(xp, c, empty, P, rho, dyn, args, gap_tol)
        xt = _sender_states(launch, xp, empty, P, rho, dyn, args[2])
        mats = empty((2, N, d, d), rho.dtype, axis=1)  # x_bar, Bt
        scal = empty((N, 6), rdt)
        if flag is None:  # the kernel flags (1, 2) under the energy basis or the gate: zeros every call
            flag = xp.zeros(N, np.int64)
        idx, msk, U, eps_c, lam, V, sigma, l, eps_d, eps_t, modes = args[:11]
        launch(
            "channel_step_vjp", N, d, rho.dtype, rho, xt, idx, msk, U, eps_c, lam, V, sigma, l, eps_d, eps_t,
            gam, modes, prm, c(out_bar.astype(rho.dtype, copy=False)), xs, mats, accm, sw, racc, scal, gmin,
            flag, modes=codes,
        )  # fmt: skip
        if ins is not None:
            m_acc, _, sw_acc = acc["_kernel"]
            launch("incoming", N, d, rho.dtype, rho, U, ins, sw_acc[0], mats[1], mats[0], m_acc[3])
        if dyn.dephasing_basis == "energy" and bool((flag == 1).any()):
            i = int(xp.argmax(flag == 1))
            raise ValueError(
                f"hamiltonian[agent={i}]: energy-basis dephasing is not differentiable at a degenerate "
                f"spectrum (eigenvalue gap below {gap_tol:g} relative)"
            )
        if dyn.gate != "none":
            _refuse_non_positive(xp, flag == 2, gmin)
        out = dict(bar=mats[0], dt_bar=scal[:, 5].sum())
        for k, col in zip(("eps_d_bar", "eps_t_bar", "tg", "D_bar", "D"), range(5), strict=True):
            out[k] = scal[:, col]
        if fresh:
            for k in ("H", "sigma", "logsig", "U", "gamma", "gamma_th", "eps_c"):
                out[f"{k}_bar"] = acc[k]
        return out

    vjp.agent_minor = agent_minor
    return vjp


def sized_ops(small: QuantumOps, large: QuantumOps, max_d: int) -> QuantumOps:
    """Stages that run ``small`` for matrices up to ``max_d`` and ``large`` above (e.g. per-agent Jacobi
    kernels for small d, batched LAPACK / cuSOLVER array code for larger d); ``step_vjp(d)`` is the one
    of the same side, so a channel step and its adjoint always come from one of them."""

    def pick(name):
        size = _SIZE[name]
        lo, hi = getattr(small, name), getattr(large, name)

        def stage(*args, **kwargs):
            return (lo if size(args) <= max_d else hi)(*args, **kwargs)

        stage.__name__ = name
        return stage

    def step_vjp(d):
        return (small if d <= max_d else large).step_vjp(d)

    stages = {name: pick(name) for name in _SIZE}
    shared = ("pairwise_dense", "pairwise_sparse", "born")
    either = {k: getattr(small, k) or getattr(large, k) for k in shared}
    return QuantumOps(**stages, step_vjp=step_vjp, **either)
