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
from .eigh import COOP_MIN_D, make_coop_eigh

__all__ = ["make_quantum_kernels"]

_m = _qm.link(device, "cuda")
_energy_prep_agent = _m.energy_prep_agent
_energy_mats_agent = _m.energy_mats_agent
_energy_finish_agent = _m.energy_finish_agent
_energy_features_agent = _m.energy_features_agent
_energy_backward_agent = _m.energy_backward_agent
_sender_state_agent = _m.sender_state_agent
_channel_step_agent = _m.channel_step_agent
_incoming_agent = _m.incoming_agent
_channel_step_vjp_agent = _m.channel_step_vjp_agent
_eigh_agent = _m.eigh_agent
_born_logp_entry = _m.born_logp_entry
_born_add_entry = _m.born_add_entry

_COMPLEX = {np.dtype(np.complex64): complex64, np.dtype(np.complex128): complex128}


def make_quantum_kernels(d: int, dtype, modes: tuple | None = None) -> dict:
    """The per-agent kernels for matrices of size ``d`` and complex ``dtype``: energy_prep (launched
    with 3 N threads: the forward pass's three independent parts), energy_features, energy_backward (the
    free energy's per-agent passes; ``energy_mats`` and ``energy_finish``, 3 N threads each, the same
    forward part around a batched ``eigh`` of its 3 N matrices), sender_states, channel_step,
    channel_step_vjp, incoming (arguments as the CPU kernels of :mod:`vfesim_kernels.quantum_cpu`,
    without the agent range), and ``eigh(X, tol2, w, V)``: the ascending eigenvalues w (N, d) and
    eigenvectors V (N, d, d) of herm(X) for a batch X (N, d, d), all C-contiguous (the array code's
    batched eigh); ``born_logp``, ``born_add`` (one thread per observed entry of a rollout's Born loss,
    ``vfesim.quantum.kernel_ops.kernel_born``). From d = COOP_MIN_D (up to 8) ``eigh`` is the
    cooperative kernel of :mod:`.eigh`, and ``"_lanes"`` maps it to its threads per matrix (the launch's
    grid: ``vfesim.backends.cuda_backend._quantum_launch``); below, ``"_lanes"`` is empty (one thread per
    item).

    ``modes``: the channel step's four mode codes (:func:`vfesim_kernels.quantum_math.channel_step_agent`)
    as compile-time constants of ``channel_step`` and ``channel_step_vjp``, whose ``modes`` argument must
    then hold the same codes (it is not read): the branches of the other modes compile away, which leaves
    the kernels fewer registers and less local memory (each mode set is a kernel of its own, compiled at
    its first launch and cached on disk); the other kernels are those of ``modes=None`` (one dispatcher
    each, whatever the modes). None: the codes are read from that argument at run time."""
    raw = (d, dtype, modes if modes is None else tuple(modes))
    ks = _BY_ARGUMENTS.get(raw)  # (a launch's lookup: normalising costs more than the launch's own work)
    if ks is None:
        modes = raw[2]
        if modes is not None:
            modes = tuple(int(m) for m in modes)
            if len(modes) != 4:
                raise ValueError(f"modes: four codes (coupling, basis, gate, newton), got {modes!r}")
        ks = _BY_ARGUMENTS[raw] = _quantum_kernels(int(d), np.dtype(dtype).name, modes)
    return ks


# The kernel sets by the arguments as given (every spelling of one set maps to the same dictionary).
_BY_ARGUMENTS: dict = {}


_CHANNEL = ("channel_step", "channel_step_vjp")


@functools.cache
def _quantum_kernels(d: int, dtype: str, modes: tuple | None) -> dict:
    if modes is not None:  # the channel kernels of these modes beside the shared others
        base, own = _quantum_kernels(d, dtype, None), _compile(d, dtype, modes)
        py = base["_py"] | {k: own["_py"][k] for k in _CHANNEL}
        return base | {k: own[k] for k in _CHANNEL} | {"_py": py}
    return _compile(d, dtype, None)


def _compile(d: int, dtype: str, modes: tuple | None) -> dict:
    """The kernels of :func:`make_quantum_kernels` as new dispatchers (compiled at their first launch)."""
    cdt = _COMPLEX[np.dtype(dtype)]
    rdt = _NB[np.finfo(np.dtype(dtype)).dtype]
    if modes is None:
        mode_codes = device(lambda m: m)
    else:
        mode_codes = device(lambda m: modes)

    def energy_prep(
        rho, H, T, phi, J, fs, fb, fp, eps, tol2, x, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf
    ):  # fmt: skip
        for t in range(cuda.grid(1), 3 * rho.shape[0], cuda.gridsize(1)):
            Ms = cuda.local.array((d, d), cdt)
            r = cuda.local.array(d, rdt)
            _energy_prep_agent(
                t, rho, H, T, phi, J, fs, fb, fp, eps, tol2, x, s, W, logx, xlx, sigma, logsig, l, p, V, U, k,
                Vf, Ms, r,
            )  # fmt: skip

    def energy_mats(rho, H, phi, J, fs, fb, fp, eps, x, M):
        for t in range(cuda.grid(1), 3 * rho.shape[0], cuda.gridsize(1)):
            _energy_mats_agent(t, rho, H, phi, J, fs, fb, fp, eps, x, M)

    def energy_finish(T, fs, fb, fp, ew, eV, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf):
        for t in range(cuda.grid(1), 3 * s.shape[0], cuda.gridsize(1)):
            r = cuda.local.array(d, rdt)
            _energy_finish_agent(
                t, T, fs, fb, fp, ew, eV, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf, r
            )

    def energy_features(y, fs, fb, fp, fo, x, logx, xlx, sigma, logsig, l, p, U, e, A, B, c):
        for n in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            T1 = cuda.local.array((d, d), cdt)
            T2 = cuda.local.array((d, d), cdt)
            _energy_features_agent(
                y, fs, fb, fp, fo, n, x, logx, xlx, sigma, logsig, l, p, U, e, A, B, c, T1, T2
            )

    def energy_backward(
        H, T, y, J, fs, fb, fp, fo, ls, lb, lp, lo, eps, gA, gB, gc, x, s, W, logx, sigma, logsig, l, p, V,
        U, k, Vf, g_rho, g_H, g_T, g_phi,
    ):  # fmt: skip
        for n in range(cuda.grid(1), x.shape[0], cuda.gridsize(1)):
            S = cuda.local.array((10, d, d), cdt)
            _energy_backward_agent(
                H, T, y, J, fs, fb, fp, fo, ls, lb, lp, lo, eps, gA, gB, gc, n, x, s, W, logx, sigma, logsig,
                l, p, V, U, k, Vf, g_rho, g_H, g_T, g_phi, S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7],
                S[8], S[9],
            )  # fmt: skip

    def sender_states(rho, U, xt):
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            T = cuda.local.array((d, d), cdt)
            _sender_state_agent(rho, U, n, xt, T)

    def channel_step(
        rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, modes, thr, width, dt, floor, tol2,
        out, gmin,
    ):  # fmt: skip
        mo = mode_codes(modes)
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
                rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, n, mo, thr, width, dt,
                floor, tol2, out, gmin, X, S, T1, T2, W, w, Ut, Y, xs,
            )  # fmt: skip

    def channel_step_vjp(
        rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, modes, prm, ob, xs, mats, accm,
        sw, racc, scal, gmin, flag,
    ):  # fmt: skip
        mo = mode_codes(modes)
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            # nine matrices of their own (not one (9, d, d) array): each can stay in registers
            Tm = (
                cuda.local.array((d, d), cdt), cuda.local.array((d, d), cdt), cuda.local.array((d, d), cdt),
                cuda.local.array((d, d), cdt), cuda.local.array((d, d), cdt), cuda.local.array((d, d), cdt),
                cuda.local.array((d, d), cdt), cuda.local.array((d, d), cdt), cuda.local.array((d, d), cdt),
            )  # fmt: skip
            w = cuda.local.array(d, rdt)
            _channel_step_vjp_agent(
                rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, n, mo, prm, ob, xs,
                mats, accm, sw, racc, scal, gmin, flag, Tm, w,
            )  # fmt: skip

    def incoming(rho, U, slots, s, Bt, x_bar, U_bar):
        for n in range(cuda.grid(1), rho.shape[0], cuda.gridsize(1)):
            Y = cuda.local.array((d, d), cdt)
            T = cuda.local.array((d, d), cdt)
            _incoming_agent(rho, U, slots, s, Bt, n, x_bar, U_bar, Y, T)

    def eigh(X, tol2, w_out, V_out):
        for n in range(cuda.grid(1), X.shape[0], cuda.gridsize(1)):
            A = cuda.local.array((d, d), cdt)
            V = cuda.local.array((d, d), cdt)
            w = cuda.local.array(d, rdt)
            _eigh_agent(X, n, tol2, w_out, V_out, A, w, V)

    def born_logp(flat, offsets, keep, add, acc):
        for k in range(cuda.grid(1), offsets.shape[0], cuda.gridsize(1)):
            _born_logp_entry(flat, offsets, k, keep, add, acc)

    def born_add(bar, bar_offsets, flat, offsets, keep, add, c):
        for k in range(cuda.grid(1), offsets.shape[0], cuda.gridsize(1)):
            _born_add_entry(bar, bar_offsets, flat, offsets, k, keep, add, c)

    pyfuncs = {
        "energy_prep": energy_prep,
        "energy_mats": energy_mats,
        "energy_finish": energy_finish,
        "energy_features": energy_features,
        "energy_backward": energy_backward,
        "sender_states": sender_states,
        "channel_step": channel_step,
        "channel_step_vjp": channel_step_vjp,
        "incoming": incoming,
        "eigh": eigh,
        "born_logp": born_logp,
        "born_add": born_add,
    }
    lanes = {}
    if d >= COOP_MIN_D:  # eight threads a matrix (vfesim_kernels.cuda.eigh)
        coop = make_coop_eigh(d, dtype)
        pyfuncs["eigh"], lanes = coop["_py"]["eigh"], {"eigh": coop["lanes"]}
    return compile_kernels(pyfuncs) | {"_lanes": lanes}
