"""Rollouts of density-matrix agents with exact hand-written adjoints (spec/quantum.md §4).

``rollout(qstate, qcfg, schedule, loss=..., grad=True)`` runs T = ``schedule.n_steps`` synchronous steps
(:mod:`.evolve`, spec §3) and returns the loss

    L = w_born sum_{t=1..T} sum_{i: y_ti >= 0} -log <y_ti| x_i^t |y_ti>  +  w_F F(rho^T)

(x = (1 - e) rho + e I/d the floored state of spec §2.3, y_ti = ``schedule.outcomes[t-1, i]``, -1 for
unobserved; F the free energy of ``qcfg``) and its exact gradient with respect to the initial beliefs,
H_i, T_i, phi_i, the dephasing and thermal rates, and the coupling strength eps0 and length ell.

Reverse sweep (§4.2), per step from T-1 down to 0, per agent batch in reverse update order:
thermalising channel (R4 with the Gibbs prior) -> dephasing (R3; energy basis: the pinching's derivative
through the eigenvectors of H_i, :func:`.channels.dephase_energy_vjp`) -> unitary (R1, with t = g dt and
the soft gate g through D(x||sigma), §3.6) -> coupling channels in reverse neighbour order (R4; C2 with
stop-gradient on the sender). Cotangents of the senders' states are scattered into the cotangent of the
states they were read at (time t for Jacobi; for Gauss–Seidel the already updated j < i). H_bar, T_bar and
rate cotangents accumulate per step; the transports' cotangents accumulate over the rollout and pass
once through U_ij = U_i U_j^dag and rule R2 to phi_bar. Gibbs priors: :func:`.unitary.gibbs_vjp`;
F(rho^T): :func:`.energy.energy_and_gradient_arrays`; Born terms: rule R7.

Mirror-descent steps after a step (rule R9) are reversed first, by
:func:`.flows.mirror_descent_step_vjp` (Armijo's eta is piecewise constant: no cotangent); their H, T
cotangents arrive through log sigma_i, their phi cotangents directly. dt (one per step), the gate's
threshold theta and width tau get cotangents too (:func:`_update_vjp`).

Checkpointing, uniform (``checkpoint_every=s``): the states at t = 0, s, 2s, ... are kept (c = ceil(T/s)
checkpoints, c N d^2 complex numbers); the reverse sweep replays one segment of s steps from its
checkpoint, keeping that segment's states and tapes ((w + 3) N d^2 per step, w the window width), then runs
its adjoint. Memory O((c + s (w + 3)) N d^2); every step's forward is computed twice (recomputation factor
2, independent of s), plus one adjoint (about 2-3 forward steps). The default s = ceil(sqrt(T)) balances
the two memory terms.

Checkpointing, binomial (``checkpoints=c``, Griewank's revolve): at most c states are held at once (the
initial state included; ``stats["max_stored"]``) plus the tape of one step, memory O((c + w + 3) N d^2).
A segment [t0, t1) with f = c - 1 free slots is split at t0 + l1: the right part (at most
beta(f - 1, r) steps, beta(f, r) = (f + r)!/(f! r!), r the least with beta(f, r) >= t1 - t0) is
reversed with one slot fewer, then the left part with the slot freed. Every step is advanced at most
r + 1 times (r + 2 counting the taped replay); forward steps <= T + (r + 1) T, for T = 100: c = 4 (r = 7),
c = 6 (r = 4), c = 8 (r = 3). The forward pass that computes the loss stores the first
descent's checkpoints, so it is not repeated. c = 1 replays from t = 0 for every step (T (T + 1)/2).

Kernel backends (``ops.step_vjp(d)`` not None, Jacobi order): every forward step is the backend's channel
step kernel and every reverse step its adjoint kernel, which recomputes each agent's step from the state
before it: no tapes (memory O((c + s) N d^2) uniform, O(c N d^2) binomial), and without mirror steps no
step is replayed for its tape (forward steps 2T - c uniform, T fewer binomial). ``stats["step_adjoint"]``.

Gradient conventions (as :mod:`.energy`): ``rho`` traceless Hermitian (dL = tr(G d rho) on the tangent
space of S_d), ``hamiltonian`` Hermitian, the rest plain partial derivatives; a rate given as a number
gets the derivative with respect to that number (the sum over agents).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from ..arrays import array_module as _xp
from ..arrays import host_floats
from ..config import ConfigError, _check_real
from .born import ARRAY_BORN, is_own_outcomes, observed_outcomes, own_outcomes
from .channels import (
    add_incoming,
    coupling_strengths_vjp,
    dephase_energy_vjp,
    dephase_vjp,
    dephasing_strength_vjp,
    incoming_slots,
    mix_vjp,
    pinch_mix_vjp,
    transports_vjp,
)
from .config import QuantumConfig
from .energy import NUMPY_OPS, QuantumOps, energy_and_gradient_arrays
from .evolve import Prepared, QuantumDynamics, normalised, prepare, senders, step, transports_of, window
from .flows import mirror_descent_step, mirror_descent_step_vjp
from .frames import frames_vjp, spin_generators
from .linalg import dagger, herm, traceless
from .state import validate_state
from .unitary import gibbs_vjp, relative_entropy_gibbs_vjp, soft_gate_vjp, unitary_step_vjp

__all__ = ["Schedule", "RolloutResult", "LOSS_TERMS", "rollout", "binomial", "repetitions"]

LOSS_TERMS = ("born", "free_energy")
# The tape of a step the kernels' adjoint differentiates (it reads only the state before the step).
_NO_TAPE = {"step": None, "pre": None, "mirror": ()}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """What a rollout runs: ``dynamics`` (a QuantumDynamics), ``dt`` > 0 (a number or one per step (T,)),
    ``n_steps`` T >= 1 and the observed ``outcomes`` (T, N) integers (outcome of agent i measured in the
    computational basis on the state after step t; -1: not observed), needed by the Born loss."""

    dynamics: QuantumDynamics
    dt: Any
    n_steps: int
    outcomes: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.dynamics, QuantumDynamics):
            raise ConfigError("dynamics", f"must be a QuantumDynamics, got {type(self.dynamics).__name__}")
        T = self.n_steps
        if isinstance(T, bool) or not isinstance(T, (int, np.integer)) or T < 1:
            raise ConfigError("n_steps", f"must be an integer >= 1, got {T!r}")
        if np.ndim(self.dt) == 0:
            dts = np.full(T, _check_real("dt", self.dt, positive=True))
        else:
            dts = np.array(self.dt, dtype=np.float64)
            if dts.shape != (T,) or not (np.isfinite(dts) & (dts > 0)).all():
                raise ConfigError("dt", f"must be > 0, a number or one per step (shape ({T},)), got {dts}")
        dts.setflags(write=False)
        object.__setattr__(self, "dt", dts)
        if self.outcomes is not None:  # a read-only copy, shared by schedules made from another's outcomes
            y = self.outcomes if is_own_outcomes(self.outcomes) else np.array(self.outcomes)
            if y.ndim != 2 or y.shape[0] != T or not np.issubdtype(y.dtype, np.integer):
                raise ConfigError(
                    "outcomes", f"must be integers of shape (n_steps={T}, N), got {y.dtype} {y.shape}"
                )
            object.__setattr__(self, "outcomes", own_outcomes(y))


class RolloutResult(NamedTuple):
    """loss (float); terms: the weighted loss terms; grads (None without grad); final: the state after T
    steps; stats: ``checkpoints`` (c), ``segment`` (s), ``forward_steps`` (steps computed: 2T with grad and
    uniform checkpointing on the tape path, module docstring), ``max_stored``, ``step_adjoint``
    ("kernels": the backend's channel step kernels forward and their adjoint in reverse, no tapes;
    "tape": the array code's step and its taped adjoint)."""

    loss: float
    terms: dict
    grads: dict | None
    final: xr.Dataset
    stats: dict


def _weights(loss) -> dict[str, float]:
    if isinstance(loss, str):
        loss = {loss: 1.0}
    if not isinstance(loss, Mapping) or not loss:
        raise ConfigError(
            "loss", f"must be one of {LOSS_TERMS} or a mapping of them to weights, got {loss!r}"
        )
    out = {}
    for k, v in loss.items():
        if k not in LOSS_TERMS:
            raise ConfigError("loss", f"unknown term {k!r} (known: {LOSS_TERMS})")
        out[k] = _check_real(f"loss.{k}", v, nonneg=True)
    return out


def _zeros_acc(P: Prepared, xp, cdt, kernel=None):
    """Zero cotangent accumulators of a reverse sweep; with a ``kernel`` step adjoint, those it adds into
    (:func:`.kernel_ops.kernel_accumulators`, in its layout) and no transports' (the frames' come
    directly)."""
    n, d = P.lam.shape
    w = P.index.shape[1]
    rdt = P.lam.dtype
    if kernel is not None:
        from .kernel_ops import kernel_accumulators

        acc = kernel_accumulators(xp, n, w, d, cdt, getattr(kernel, "agent_minor", False))
        acc.update(T=xp.zeros(n, rdt), phi=xp.zeros((n, 3), rdt), theta=0.0, tau=0.0)
        return acc
    return {
        "H": xp.zeros((n, d, d), cdt),
        "T": xp.zeros(n, rdt),
        "gamma": xp.zeros(n, rdt),
        "gamma_th": xp.zeros(n, rdt),
        "eps_c": xp.zeros((n, w), rdt),
        "M": xp.zeros((n, w, d, d), cdt),
        "logsig": xp.zeros((n, d, d), cdt),
        "sigma": xp.zeros((n, d, d), cdt),
        "phi": xp.zeros((n, 3), rdt),
        "theta": 0.0,
        "tau": 0.0,
    }


def _update_vjp(P: Prepared, sel, R, tape, out_bar, dt: float, dyn: QuantumDynamics, acc):
    """Adjoint of :func:`.evolve.agent_update` for the batch ``sel`` -> (x0_bar, R_bar, dt_bar); parameter
    cotangents are added into ``acc`` (:func:`_update_terms`, then :func:`_accumulate`)."""
    return _accumulate(P, sel, _update_terms(P, sel, R, tape, out_bar, dt, dyn), dt, dyn, acc)


def _update_terms(P: Prepared, sel, R, tape, out_bar, dt: float, dyn: QuantumDynamics) -> dict:
    """The per-agent cotangents of :func:`.evolve.agent_update` for the batch ``sel`` from its tape (the
    array code's; the kernels' adjoint, :func:`.kernel_ops.kernel_step_vjp`, computes the same
    derivatives in its own form): x_bar, R_bar, eps_c_bar, M_bar, H_bar, sigma_bar, eps_d_bar, eps_t_bar,
    tg, the gate's terms only under the soft gate and the coupling's only with a coupling window."""
    xp = _xp(out_bar)
    xs, y, z = tape["xs"], tape["y"], tape["z"]
    x = xs[-1]
    lam, V = P.lam[sel], P.V[sel]
    z_bar, sig_bar, eps_t_bar = mix_vjp(out_bar, z, P.sigma[sel], tape["eps_t"])
    if dyn.dephasing_basis == "computational":
        y_bar, eps_d_bar = dephase_vjp(z_bar, y, tape["eps_d"])
        H_bar = xp.zeros_like(y)
    else:
        y_bar, eps_d_bar, H_bar = dephase_energy_vjp(z_bar, y, tape["eps_d"], V, lam)
    x_bar, H_u, t_bar = unitary_step_vjp(y_bar, x, y, tape["U"], lam, V, tape["t"])
    g = tape["g"]
    out = dict(H_bar=H_bar + H_u, sigma_bar=sig_bar, eps_d_bar=eps_d_bar, eps_t_bar=eps_t_bar, tg=t_bar * g)
    if dyn.gate == "soft":
        D_bar = soft_gate_vjp(t_bar * dt, g, dyn.gate_width)
        rb, out["logsig_bar"] = relative_entropy_gibbs_vjp(D_bar, tape["gcache"], x.dtype)
        x_bar = x_bar + rb
        out.update(D_bar=D_bar, D=tape["D"])
    R_bar = xp.zeros_like(R)
    w = R.shape[1]
    if dyn.coupling != "none" and w:
        M, eps_c = transports_of(P)[sel], P.eps_c[sel]
        Rn = normalised(R)
        trR = R.diagonal(axis1=-2, axis2=-1).sum(axis=-1).real[..., None, None].astype(R.dtype)
        sig = M @ Rn @ dagger(M)
        eps_c_bar = xp.zeros_like(eps_c)
        M_bar = xp.zeros_like(M)
        for k in range(w - 1, -1, -1):
            if dyn.coupling == "C1":
                x_bar, s_bar, e_bar = mix_vjp(x_bar, xs[k], sig[:, k], eps_c[:, k])
                Mk = M[:, k]
                Rn_bar = dagger(Mk) @ s_bar @ Mk  # then through R / tr R
                c = xp.einsum("nkl,nlk->n", Rn_bar, Rn[:, k]).real[:, None, None]
                R_bar[:, k] = (Rn_bar - c * xp.eye(R.shape[-1], dtype=R.dtype)) / trR[:, k]
                M_bar[:, k] = 2.0 * s_bar @ Mk @ Rn[:, k]
            else:
                x_bar, e_bar = pinch_mix_vjp(x_bar, xs[k], tape["Ws"][k], eps_c[:, k])
            eps_c_bar[:, k] = e_bar
        out.update(eps_c_bar=eps_c_bar, M_bar=M_bar)
    out.update(x_bar=x_bar, R_bar=R_bar)
    return out


def _accumulate(P: Prepared, sel, terms: dict, dt: float, dyn: QuantumDynamics, acc):
    """Adds the array code's per-agent cotangents ``terms`` of one step of the batch ``sel``
    (:func:`_update_terms`) into ``acc`` -> (x0_bar, R_bar, dt_bar): the agents' own cotangents and the
    senders' parts R_bar (N, w, d, d) (transports' cotangents into acc["M"]). dt_bar: a scalar of the
    arrays' module (no transfer per step). (The kernels' adjoint adds into its accumulators itself.)

    dt enters through t = g dt (t_bar from R1) and the strengths eps = 1 - exp(-rate dt)
    (d eps/d dt = rate exp(-rate dt)); the soft gate g = sigmoid((D - theta)/tau) gives
    theta_bar = -sum D_bar and tau_bar = -sum D_bar (D - theta)/tau with D_bar = g_bar g (1 - g)/tau.
    """
    xp = _xp(terms["H_bar"])
    gamma, gamma_th = P.gamma[sel], P.gamma_th[sel]
    eps_d_bar, eps_t_bar = terms["eps_d_bar"], terms["eps_t_bar"]
    acc["gamma"][sel] += dephasing_strength_vjp(eps_d_bar, gamma, dt)
    acc["gamma_th"][sel] += dephasing_strength_vjp(eps_t_bar, gamma_th, dt)
    dt_bar = (
        terms["tg"].sum()
        + (eps_d_bar * gamma * xp.exp(-gamma * dt)).sum()
        + (eps_t_bar * gamma_th * xp.exp(-gamma_th * dt)).sum()
    )
    if dyn.gate == "soft":
        _gate_terms(terms, dyn, acc)
        acc["logsig"][sel] += terms["logsig_bar"]
    # the Gibbs adjoint is linear and H is fixed: applied once, at the end
    acc["sigma"][sel] += terms["sigma_bar"]
    acc["H"][sel] += terms["H_bar"]
    if dyn.coupling != "none" and terms["R_bar"].shape[1]:
        acc["eps_c"][sel] += terms["eps_c_bar"]
        acc["M"][sel] += terms["M_bar"]
    return terms["x_bar"], terms["R_bar"], dt_bar


def _gate_terms(terms: dict, dyn: QuantumDynamics, acc) -> None:
    """The soft gate's threshold and width cotangents (:func:`_accumulate`) into acc."""
    D_bar = terms["D_bar"]
    acc["theta"] -= float(D_bar.sum())
    acc["tau"] -= float((D_bar * (terms["D"] - dyn.gate_threshold)).sum()) / dyn.gate_width


def _step_vjp(
    P: Prepared, old, new, tapes, out_bar, dt: float, dyn: QuantumDynamics, acc, kernel=None, slots=None
):
    """Cotangent of the states before a step from the cotangent ``out_bar`` of the states after it (new:
    the states after the channels, before any mirror step) -> (bar, dt_bar). Jacobi: the terms of the
    kernel adjoint ``kernel`` (``QuantumOps.step_vjp``, from the old states, no tape) or of the array code
    from the tape; the senders' parts go to the states they were read at through ``slots``
    (:func:`.channels.incoming_slots` of the window)."""
    xp = _xp(old)
    if dyn.order == "jacobi":
        if kernel is not None:  # the kernels add the parameters' cotangents into acc
            terms = kernel(P, old, out_bar, dt, dyn, acc=acc)
            if dyn.gate == "soft":
                _gate_terms(terms, dyn, acc)
            return terms["bar"], terms["dt_bar"]
        terms = _update_terms(P, slice(None), old[window(P, xp)[0]], tapes[0], out_bar, dt, dyn)
        x_bar, R_bar, dt_bar = _accumulate(P, slice(None), terms, dt, dyn, acc)
        return add_incoming(x_bar, R_bar, slots), dt_bar
    bar_new = out_bar.copy()
    bar_old = xp.zeros_like(out_bar)
    dt_bar = 0.0
    for i in range(old.shape[0] - 1, -1, -1):
        R = senders(P.index[i : i + 1], i, old, new)
        x_bar, R_bar, db = _update_vjp(P, slice(i, i + 1), R, tapes[i], bar_new[i : i + 1], dt, dyn, acc)
        dt_bar += float(db)
        bar_old[i] += x_bar[0]
        for k, j in enumerate(P.index[i]):
            if P.mask[i, k]:
                (bar_new if j < i else bar_old)[j] += R_bar[0, k]
    return bar_old, dt_bar


def _gradient_shape(key: str, value, g):
    return float(g.sum()) if np.ndim(value) == 0 else g


def binomial(c: int, r: int) -> int:
    """beta(c, r) = (c + r)! / (c! r!): the most steps c free checkpoints reverse with each step advanced
    at most r times (Griewank, revolve)."""
    return math.comb(c + r, c)


def repetitions(n_steps: int, slots: int) -> int:
    """The least r with beta(slots, r) >= n_steps (slots >= 1 free checkpoints): the recomputation bound
    of :func:`rollout` with ``checkpoints = slots + 1``."""
    r = 0
    while binomial(slots, r) < n_steps:
        r += 1
    return r


def _split(length: int, slots: int) -> int:
    """Binomial split of a segment of ``length`` >= 2 steps with ``slots`` >= 1 free checkpoints: the
    length of the left part. The right part gets at most beta(slots - 1, r) steps (it is reversed with
    one checkpoint fewer), the left part at most beta(slots, r - 1) (one repetition fewer), r from
    :func:`repetitions`; beta(slots, r) = beta(slots, r - 1) + beta(slots - 1, r) covers the segment."""
    r = repetitions(length, slots)
    return length - min(binomial(slots - 1, r), length - 1)


def _spine(n_steps: int, slots: int) -> list[int]:
    """Checkpoints the binomial schedule places on its first (rightmost) descent: stored by the forward
    pass, so that pass is not repeated."""
    out, t0 = [], 0
    while n_steps - t0 > 1 and slots > 0:
        t0 += _split(n_steps - t0, slots)
        out.append(t0)
        slots -= 1
    return out


def rollout(
    qstate: xr.Dataset,
    qcfg: QuantumConfig,
    schedule: Schedule,
    loss: str | Mapping[str, float] = "born",
    grad: bool = True,
    *,
    checkpoint_every: int | None = None,
    checkpoints: int | None = None,
    ops: QuantumOps = NUMPY_OPS,
) -> RolloutResult:
    """Loss of a T-step rollout and, with ``grad``, its exact gradient (module docstring).

    loss: "born", "free_energy" or a mapping of both to weights. grads keys: ``rho``, ``hamiltonian``,
    ``temperature``, ``phi``, ``dephasing_rate``, ``thermal_rate``, ``coupling_strength``,
    ``coupling_length``, ``dt`` (T,) (one per step), ``gate_threshold``, ``gate_width``.
    checkpoint_every: uniform checkpointing with segment length s (default ceil(sqrt(T)));
    checkpoints: binomial checkpointing with at most c >= 1 stored states (exclusive with
    checkpoint_every). The hard gate has no gradient: with ``grad`` it raises. ops: the backend's
    :class:`QuantumOps` (``backend.agent_ops["quantum"]``): the free energy's and the mirror steps'
    stages and, where ``ops.step_vjp(d)`` gives a kernel adjoint, the Jacobi steps forward and in reverse.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule: must be a Schedule, got {type(schedule).__name__}")
    dyn = schedule.dynamics
    weights = _weights(loss)
    T = schedule.n_steps
    if grad and dyn.gate == "hard":
        raise ConfigError("gate", "the hard gate has no gradient: use gate='soft', or grad=False")
    if checkpoint_every is not None and checkpoints is not None:
        raise ConfigError(
            "checkpoints", "give checkpoint_every (uniform) or checkpoints (binomial), not both"
        )
    for key, v in (("checkpoint_every", checkpoint_every), ("checkpoints", checkpoints)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1):
            raise ConfigError(key, f"must be an integer >= 1, got {v!r}")
    s = math.ceil(math.sqrt(T)) if checkpoint_every is None else int(checkpoint_every)
    validate_state(qstate, qcfg)
    arrays = {k: qstate[k].data for k in qstate.data_vars}
    rho = arrays["rho"]
    n = rho.shape[0]
    xp = _xp(rho)
    w_born = weights.get("born", 0.0)
    if "born" in weights:
        if schedule.outcomes is None:
            raise ConfigError("outcomes", "the Born loss needs schedule.outcomes (n_steps, N)")
        if schedule.outcomes.shape[1] != n:
            raise ConfigError("outcomes", f"has {schedule.outcomes.shape[1]} agents, the state has {n}")
    observed = observed_outcomes(schedule.outcomes, rho.shape[-1], xp, keep=True) if w_born else None
    born_ops = ARRAY_BORN if ops.born is None else ops.born
    P = prepare(arrays, qcfg, dyn)
    dts = schedule.dt
    # The backend's kernel adjoint of the Jacobi step (QuantumOps.step_vjp; None: array code). With it,
    # every forward step is the kernels' channel step and no step keeps a tape (the adjoint recomputes
    # each agent's step from the old state); without it, the array code's step in every sweep. Either
    # way the states a reverse sweep recomputes are bitwise those of the first sweep.
    kernel = ops.step_vjp(rho.shape[-1]) if dyn.order == "jacobi" else None
    step_ops = NUMPY_OPS if kernel is None else ops
    stats = {"forward_steps": 0, "max_stored": 1, "step_adjoint": "tape" if kernel is None else "kernels"}

    def advance(r, t, keep=False):
        """Step t -> (state after it, tape: step tapes, state before the mirror steps, their (input,
        eta)) ."""
        stats["forward_steps"] += 1
        r, tapes = step(P, r, float(dts[t]), dyn, keep and kernel is None, ops=step_ops)
        pre, mirror = r, []
        for _ in range(dyn.mirror_steps):
            r_in = r
            r, info = mirror_descent_step(
                {**arrays, "rho": r},
                qcfg,
                eta0=dyn.mirror_eta,
                armijo_c=dyn.armijo_c,
                max_backtracks=dyn.max_backtracks,
                ops=ops,
            )
            mirror.append((r_in, info["eta"]))
        return r, (dict(step=tapes, pre=pre, mirror=mirror) if keep else None)

    binom = checkpoints is not None
    keep_at = set(_spine(T, checkpoints - 1)) if binom else {t for t in range(s, T, s)}
    store = {0: rho}
    born = born_ops.start(xp, n) if w_born else 0.0
    for t in range(T):
        rho, _ = advance(rho, t)
        if w_born:
            born = born_ops.logp(born, rho, observed, t)  # summed on the device: no sync per step
        if t + 1 in keep_at:
            store[t + 1] = rho
    stats["max_stored"] = len(store)
    terms = {}
    if "born" in weights:
        terms["born"] = -w_born * born_ops.total(born) if w_born else 0.0
    w_F = weights.get("free_energy", 0.0)
    if "free_energy" in weights:
        Fterms, Fgrads = energy_and_gradient_arrays({**arrays, "rho": rho}, qcfg, ops=ops)
        terms["free_energy"] = w_F * Fterms["total"]
    final = qstate.copy()
    final["rho"] = (qstate["rho"].dims, rho)
    if binom:
        stats.update(scheme="binomial", checkpoints=checkpoints)
    else:
        stats.update(scheme="uniform", checkpoints=len(store), segment=s)
    total = float(sum(terms.values()))
    if not grad:
        return RolloutResult(total, terms, None, final, stats)

    acc = _zeros_acc(P, xp, rho.dtype, kernel=kernel)
    slots = incoming_slots(P.index, P.mask, n, xp) if kernel is None and dyn.order == "jacobi" else None
    dt_bar = [0.0] * T
    bar = xp.zeros_like(rho)
    if w_F:
        bar = bar + w_F * Fgrads["rho"]
    if w_born:
        bar = born_ops.add(bar, rho, observed, T - 1, w_born)

    def back(t, old, tape, bar):
        """Cotangent of the state at t from that at t + 1 (mirror steps in reverse, then the step)."""
        for r_in, eta in reversed(tape["mirror"]):
            res = mirror_descent_step_vjp(bar, {**arrays, "rho": r_in}, qcfg, eta, ops=ops)
            bar = res["rho"]
            acc["logsig"] += res["log_sigma"]
            if res["phi"] is not None:
                acc["phi"] += res["phi"]
        bar, dt_bar[t] = _step_vjp(
            P, old, tape["pre"], tape["step"], bar, float(dts[t]), dyn, acc, kernel, slots
        )
        if w_born and t >= 1:
            bar = born_ops.add(bar, old, observed, t - 1, w_born)  # bar: this step's own array
        return bar

    # The kernels' adjoint reads only the state before a step: without mirror steps (whose adjoints need
    # their inputs) a step is not replayed for its tape.
    need_tape = kernel is None or dyn.mirror_steps > 0

    def taped(old, t):
        return advance(old, t, keep=True)[1] if need_tape else _NO_TAPE

    if binom:
        bar = _reverse_binomial(T, checkpoints - 1, store, advance, taped, back, bar, stats)
    else:
        for start in sorted(store, reverse=True):
            stop = min(start + s, T)
            states, tapes = [store[start]], []
            for t in range(start, stop - 1):
                r, tp = advance(states[-1], t, keep=need_tape)
                states.append(r)
                tapes.append(tp or _NO_TAPE)
            tapes.append(taped(states[-1], stop - 1))
            held = len(states) + need_tape  # a tape holds the state after its step
            stats["max_stored"] = max(stats["max_stored"], len(store) + held - 1)
            for t in range(stop - 1, start - 1, -1):
                bar = back(t, states[t - start], tapes[t - start], bar)
            del states, tapes

    # the kernels' adjoint gives the frames' cotangents directly (acc["U"]), the array code the transports'
    U_bar = acc["U"] if kernel is not None else transports_vjp(acc["M"], P.U, window(P, xp)[0])
    phi_bar = frames_vjp(U_bar, P.fcache, spin_generators(rho.shape[-1])) + acc["phi"]
    H_m, T_m = gibbs_vjp(acc["sigma"], acc["logsig"], P.lam, P.V, P.T, P.sigma, P.l, P.p)
    H_bar, T_bar = acc["H"] + H_m, acc["T"] + T_m
    if w_F:
        H_bar = H_bar + w_F * Fgrads["hamiltonian"]
        T_bar = T_bar + w_F * Fgrads["temperature"]
        phi_bar = phi_bar + w_F * Fgrads["phi"]
    e0_bar, ell_bar = coupling_strengths_vjp(
        acc["eps_c"],
        dyn.coupling_strength,
        dyn.coupling_length,
        P.dist,
        P.mask,
    )
    grads = {
        "rho": traceless(herm(bar)),
        "hamiltonian": herm(H_bar),
        "temperature": T_bar,
        "phi": phi_bar,
        "dephasing_rate": _gradient_shape("dephasing_rate", dyn.dephasing_rate, acc["gamma"]),
        "thermal_rate": _gradient_shape("thermal_rate", dyn.thermal_rate, acc["gamma_th"]),
        "coupling_strength": e0_bar,
        "coupling_length": ell_bar,
        "dt": np.array(list(host_floats(dict(enumerate(dt_bar))).values())),  # one transfer, not T
        "gate_threshold": acc["theta"],
        "gate_width": acc["tau"],
    }
    return RolloutResult(total, terms, grads, final, stats)


def _reverse_binomial(T: int, slots: int, store: dict, advance, taped, back, bar, stats: dict):
    """Reverse sweep over [0, T) with binomial checkpointing (module docstring): ``store`` holds the state
    at 0 and the forward pass's checkpoints (:func:`_spine`); at most slots + 1 states are held at once
    (stats["max_stored"]). ``taped(old, t)``: the tape of step t. Recursion depth <= slots + 1."""

    def run(t0: int, t1: int, r):
        for t in range(t0, t1):
            r, _ = advance(r, t)
        return r

    def rev(t0: int, t1: int, free: int, bar):
        if t1 - t0 == 1 or free == 0:
            for t in range(t1 - 1, t0 - 1, -1):  # free == 0: replay from t0 for every step
                old = run(t0, t, store[t0])
                bar = back(t, old, taped(old, t), bar)
            return bar
        mid = t0 + _split(t1 - t0, free)
        if mid not in store:
            store[mid] = run(t0, mid, store[t0])
            stats["max_stored"] = max(stats["max_stored"], len(store))
        bar = rev(mid, t1, free - 1, bar)
        del store[mid]
        return rev(t0, mid, free, bar)

    return rev(0, T, slots, bar)
