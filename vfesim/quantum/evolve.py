"""One synchronous step of density-matrix agents and in-memory runs (spec/quantum.md §3).

Step, for every agent i with the senders j_1..j_w of its coupling window (:mod:`.channels`)::

    x <- C_{i,j_w} o ... o C_{i,j_1}(rho_i^t)    coupling channels (C1 default, or C2; §3.2)
    y <- U_i(g_i dt) x U_i(g_i dt)^dag           unitary step, g_i the thermodynamic gate (§3.1, §3.6)
    z <- D_{eps_i}(y)                            local dephasing, eps_i = 1 - exp(-gamma_i dt), in the
                                                 computational or the energy basis of H_i
    rho_i^{t+1} <- (1 - e_i) z + e_i sigma_i     thermalising channel, e_i = 1 - exp(-gamma_th,i dt)
    [optional] ``mirror_steps`` Armijo mirror-descent steps on F (§3.4, :mod:`.flows`)

Order "jacobi" (default): every sender is read at time t (parallel over agents). "gauss_seidel": agents
are updated in index order and read the senders already updated in this step (j < i), the causal order of
sequence agents (with :func:`.channels.causal_window` every sender is new). Frames, H_i, T_i and the
rates are fixed during a run: H_i is diagonalised once (:mod:`.unitary`), the transports
U_ij = U_i U_j^dag are formed once.

:func:`evolve` runs ``n_steps`` steps and returns the final state and a history Dataset. The step with
its tape is shared with :func:`vfesim.quantum.rollout`, which differentiates it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from ..arrays import array_module as _xp
from ..arrays import host_array
from ..config import ConfigError, _check_real, resolve_neighbours
from ..integrators.base import DynamicsError
from ..observables import Observables
from ..schema import history, term_var
from .channels import (
    coupling_strengths,
    coupling_window,
    dephase,
    dephase_energy,
    dephasing_strength,
    mix,
    pair_distances,
    pinch_mix,
    transports,
)
from .config import QuantumConfig
from .energy import NUMPY_OPS, TERMS, QuantumOps, energy_and_gradient_arrays
from .flows import mirror_descent_step
from .frames import frames, spin_generators
from .linalg import dagger, eigh, eigvalsh
from .state import tolerance, validate_state
from .unitary import (
    gibbs,
    hamiltonian_eig,
    hard_gate,
    propagator,
    relative_entropy_gibbs,
    soft_gate,
    unitary_step,
)

__all__ = ["QuantumDynamics", "COUPLINGS", "ORDERS", "GATES", "DEPHASING_BASES", "prepare", "step", "evolve"]

COUPLINGS = ("C1", "C2", "none")
ORDERS = ("jacobi", "gauss_seidel")
GATES = ("none", "soft", "hard")
DEPHASING_BASES = ("computational", "energy")


def _rates(key: str, v: Any):
    if np.ndim(v) == 0:
        return _check_real(key, v, nonneg=True)
    a = np.array(v, dtype=np.float64)
    if a.ndim != 1:
        raise ConfigError(key, f"must be a number or a 1-D array (one rate per agent), got shape {a.shape}")
    bad = ~np.isfinite(a) | (a < 0)
    if bad.any():
        raise ConfigError(key, f"must be finite and >= 0, agent {int(np.argmax(bad))} has {a[bad][0]}")
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class QuantumDynamics:
    """Settings of the dynamics of density-matrix agents (spec §3), validated at construction.

    coupling: "C1" (partial replacement, default), "C2" (neighbour-basis dephasing, stop-gradient on the
    sender) or "none". coupling_strength eps0 in [0, 1], coupling_length ell > 0:
    eps_ij = eps0 exp(-dist(i, j)/ell). neighbours: the coupling window, None (the QuantumConfig's
    neighbours), "dense" or a SparseNeighbours (e.g. :func:`.channels.causal_window`). positions: None
    (``dist = |i - j|``) or agent positions (N, p) (Euclidean dist). order: "jacobi" or "gauss_seidel".
    dephasing_rate gamma_i >= 0 and thermal_rate >= 0: a number or one per agent (N,).
    dephasing_basis: "computational" or "energy". gate: "none" (g = 1), "soft"
    (g = sigmoid((D(rho||sigma) - gate_threshold)/gate_width)) or "hard" (1[D > gate_threshold],
    inference only). mirror_steps >= 0 Armijo mirror-descent steps per step, from mirror_eta, with
    armijo_c and max_backtracks.
    """

    coupling: str = "C1"
    coupling_strength: float = 0.0
    coupling_length: float = 1.618
    neighbours: Any = None
    positions: Any = None
    order: str = "jacobi"
    dephasing_rate: Any = 0.0
    dephasing_basis: str = "computational"
    thermal_rate: Any = 0.0
    gate: str = "none"
    gate_threshold: float = 0.0
    gate_width: float = 1.0
    mirror_steps: int = 0
    mirror_eta: float = 1.0
    armijo_c: float = 1e-4
    max_backtracks: int = 30

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)
        for key, allowed in (
            ("coupling", COUPLINGS),
            ("order", ORDERS),
            ("gate", GATES),
            ("dephasing_basis", DEPHASING_BASES),
        ):
            v = getattr(self, key)
            if not isinstance(v, str) or v not in allowed:
                raise ConfigError(key, f"must be one of {allowed}, got {v!r}")
        eps0 = _check_real("coupling_strength", self.coupling_strength, nonneg=True)
        if eps0 > 1:
            raise ConfigError("coupling_strength", f"must be in [0, 1] (a mixing weight), got {eps0}")
        s("coupling_strength", eps0)
        s("coupling_length", _check_real("coupling_length", self.coupling_length, positive=True))
        if self.neighbours is not None:
            s("neighbours", resolve_neighbours(self.neighbours))
        if self.positions is not None:
            pos = np.array(self.positions, dtype=np.float64)
            if pos.ndim != 2 or not np.isfinite(pos).all():
                raise ConfigError("positions", f"must be a finite (N, p) array, got shape {pos.shape}")
            pos.setflags(write=False)
            s("positions", pos)
        s("dephasing_rate", _rates("dephasing_rate", self.dephasing_rate))
        s("thermal_rate", _rates("thermal_rate", self.thermal_rate))
        s("gate_threshold", _check_real("gate_threshold", self.gate_threshold))
        s("gate_width", _check_real("gate_width", self.gate_width, positive=True))
        m = self.mirror_steps
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
            raise ConfigError("mirror_steps", f"must be an integer >= 0, got {m!r}")
        s("mirror_eta", _check_real("mirror_eta", self.mirror_eta, positive=True))
        c = _check_real("armijo_c", self.armijo_c, positive=True)
        if c >= 1:
            raise ConfigError("armijo_c", f"must be in (0, 1), got {c}")
        b = self.max_backtracks
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
            raise ConfigError("max_backtracks", f"must be an integer >= 0, got {b!r}")

    def replace(self, **changes: Any) -> QuantumDynamics:
        return dataclasses.replace(self, **changes)


class Prepared(NamedTuple):
    """Per-run caches (fixed H, T, frames, rates): one eigh of every H_i, the frames and transports."""

    lam: Any  # (N, d) eigenvalues of H
    V: Any  # (N, d, d) eigenvectors of H
    T: Any  # (N,)
    sigma: Any  # (N, d, d) Gibbs priors
    l: Any  # (N, d) log-eigenvalues of sigma
    p: Any  # (N, d) eigenvalues of sigma
    U: Any  # (N, d, d) frames
    fcache: Any  # frames' eigen-cache (rule R2)
    index: np.ndarray  # (N, w) coupling window
    mask: np.ndarray  # (N, w)
    dist: Any  # (N, w) on the state's device
    M: Any  # (N, w, d, d) transports U_i U_j^dag, or a function making them (:func:`transports_of`)
    eps_c: Any  # (N, w) coupling strengths
    gamma: Any  # (N,) dephasing rates
    gamma_th: Any  # (N,) thermal rates
    consts: dict  # constant arrays made on the state's device once (:func:`resident`)


def resident(P: Prepared, xp, key, source, make, tag=None):
    """The array ``make()`` derived from ``source`` (a constant of the run: the coupling window, the kernels'
    mode codes), made once per cache ``P`` and array module ``xp``: per-step calls reuse it instead of
    copying it to the device again. ``source`` is kept with it (so its id is not reused). ``tag``: what
    else it depends on (a step size): one array per key, made again when the tag changes, so a schedule of
    varying dt keeps one, not one per dt."""
    return _resident(P.consts, xp, key, source, make, tag)


def _resident(consts: dict, xp, key, source, make, tag=None):
    """:func:`resident` in a caches' dict (``Prepared.consts``, also while :func:`prepare` fills it)."""
    k = (key, xp.__name__, id(source))
    hit = consts.get(k)
    if hit is None or hit[1] != tag:
        hit = consts[k] = (source, tag, make())
    return hit[2]


def transports_of(P: Prepared):
    """The transports U_i U_j^dag (N, w, d, d) of P, made on first use and kept in P's caches: the array
    code's steps read them; the kernels form each from the frames, so a kernel run never makes them (at
    N = 65 536, w = 8, complex128: 134 MB and a batched product per run)."""
    if not callable(P.M):
        return P.M
    hit = P.consts.get("transports")
    if hit is None:
        hit = P.consts["transports"] = P.M()
    return hit


def window(P: Prepared, xp) -> tuple[Any, Any]:
    """The coupling window (index int64, mask bool) (N, w) as C-contiguous writable arrays of ``xp`` (the
    kernels' arguments: the CUDA simulator writes arguments back), made once per cache."""
    return _window_in(P.consts, xp, P.index, P.mask)


def _window_in(consts: dict, xp, index, mask) -> tuple[Any, Any]:
    """:func:`window` of the host window (index, mask) in a caches' dict."""
    return (
        _resident(consts, xp, "index", index, lambda: xp.asarray(np.array(index, np.int64, order="C"))),
        _resident(consts, xp, "mask", mask, lambda: xp.asarray(np.array(mask, bool, order="C"))),
    )


def _per_agent(key: str, v, n: int, xp, dtype):
    a = np.broadcast_to(np.asarray(v, np.float64), (n,)) if np.ndim(v) == 0 else np.asarray(v)
    if a.shape != (n,):
        raise ConfigError(key, f"has {a.shape[0]} rates for {n} agents")
    return xp.asarray(a, dtype=dtype)


def prepare(arrays: dict[str, Any], qcfg: QuantumConfig, dyn: QuantumDynamics) -> Prepared:
    """The per-run caches of :class:`Prepared` for state arrays (rho, hamiltonian, temperature, phi)."""
    rho, H, T, phi = arrays["rho"], arrays["hamiltonian"], arrays["temperature"], arrays["phi"]
    xp = _xp(rho)
    n, d = rho.shape[0], rho.shape[-1]
    lam, V = hamiltonian_eig(H)
    sigma, l, p = gibbs(lam, V, T)
    J = spin_generators(d)
    U, fcache = frames(phi, J, rho.dtype)
    nb = qcfg.neighbours if dyn.neighbours is None else dyn.neighbours
    if dyn.coupling == "none":
        index, mask = np.zeros((n, 0), np.int64), np.zeros((n, 0), bool)
    else:
        index, mask = coupling_window(n, nb)
    if dyn.positions is not None and dyn.positions.shape[0] != n:
        raise ConfigError("positions", f"has {dyn.positions.shape[0]} rows for {n} agents")
    # The window on the state's device (where the kernels read it: kept in the caches, as window() keeps
    # it) and the distances and strengths computed there.
    consts: dict = {}
    dev_index, dev_mask = _window_in(consts, xp, index, mask)
    dist = pair_distances(dev_index, dev_mask, dyn.positions, xp=xp)
    eps_c = coupling_strengths(dyn.coupling_strength, dyn.coupling_length, dist, dev_mask).astype(lam.dtype)
    M = lambda: transports(U, dev_index)  # noqa: E731 - made on first use (transports_of)
    rdt = lam.dtype
    gamma = _per_agent("dephasing_rate", dyn.dephasing_rate, n, xp, rdt)
    gamma_th = _per_agent("thermal_rate", dyn.thermal_rate, n, xp, rdt)
    return Prepared(lam, V, T, sigma, l, p, U, fcache, index, mask, dist, M, eps_c, gamma, gamma_th, consts)


def agent_update(P: Prepared, sel, x0, R, dt: float, dyn: QuantumDynamics, keep: bool = False):
    """The step of the agents ``sel`` (a slice or index array, batch B) from their states x0 (B, d, d) and
    their senders' states R (B, w, d, d) -> (new states (B, d, d), tape or None).

    The tape holds what the adjoint needs: the states before each coupling channel (w + 1), before the
    unitary and before the dephasing, the gate g, D(x || sigma) and its cache, U and t = g dt.
    """
    xp = _xp(x0)
    xs, Ws = [x0], []
    x = x0
    w = R.shape[1]
    if dyn.coupling != "none" and w:
        M = transports_of(P)[sel]
        eps_c = P.eps_c[sel]
        sig = M @ normalised(R) @ dagger(M)
        for k in range(w):
            if dyn.coupling == "C1":
                x = mix(x, sig[:, k], eps_c[:, k])
            else:
                W = eigh(sig[:, k])[1]
                Ws.append(W)
                x = pinch_mix(x, W, eps_c[:, k])
            xs.append(x)
    lam, V = P.lam[sel], P.V[sel]
    g = xp.ones(lam.shape[0], lam.dtype)
    gcache = D = None
    if dyn.gate != "none":
        D, gcache = relative_entropy_gibbs(x, V, P.l[sel])
        g = (
            soft_gate(D, dyn.gate_threshold, dyn.gate_width)
            if dyn.gate == "soft"
            else hard_gate(D, dyn.gate_threshold)
        )
    t = g * dt
    U = propagator(lam, V, t)
    y = unitary_step(x, U)
    eps_d = dephasing_strength(P.gamma[sel], dt)
    z = dephase(y, eps_d) if dyn.dephasing_basis == "computational" else dephase_energy(y, eps_d, V)
    eps_t = dephasing_strength(P.gamma_th[sel], dt)
    out = mix(z, P.sigma[sel], eps_t)
    tape = (
        dict(xs=xs, Ws=Ws, g=g, D=D, gcache=gcache, t=t, U=U, y=y, z=z, eps_d=eps_d, eps_t=eps_t)
        if keep
        else None
    )
    return out, tape


def normalised(R):
    """R / tr R per sender (B, w, d, d). Equal to R on S_d; it keeps C1 exactly trace preserving in the
    receiver when the senders' traces carry round-off: with tr(U rho_j U^dag) = 1 + delta the receiver's
    trace error grows by prod_k (1 + eps_ik) per step (measured: |tr - 1| = 4 after 100 complex64 steps,
    N = 4096, w = 8, eps0 = 0.3)."""
    tr = R.diagonal(axis1=-2, axis2=-1).sum(axis=-1).real
    return R / tr[..., None, None].astype(R.dtype)


def senders(index_rows, i0: int, old, new):
    """Senders' states (B, w, d, d) for Gauss–Seidel agents i0..i0+B-1: new for j < i, old otherwise."""
    xp = _xp(old)
    idx = xp.asarray(index_rows)
    rows = xp.arange(i0, i0 + idx.shape[0])[:, None]
    return xp.where((idx < rows)[..., None, None], new[idx], old[idx])


def step(P: Prepared, rho, dt: float, dyn: QuantumDynamics, keep: bool = False, ops: QuantumOps = NUMPY_OPS):
    """One synchronous step of all agents -> (rho_new (N, d, d), tapes: list (one per update batch) or None).

    Jacobi: one batch of all agents (without a tape: ``ops.channel_step``, the backend's per-agent kernels
    where it has them). Gauss–Seidel: one batch per agent, in index order.
    """
    xp = _xp(rho)
    if dyn.order == "jacobi":
        if not keep:
            return ops.channel_step(P, rho, dt, dyn), None
        out, tape = agent_update(P, slice(None), rho, rho[window(P, xp)[0]], dt, dyn, keep)
        return out, ([tape] if keep else None)
    new = rho.copy()
    tapes = []
    for i in range(rho.shape[0]):
        R = senders(P.index[i : i + 1], i, rho, new)
        out, tape = agent_update(P, slice(i, i + 1), rho[i : i + 1], R, dt, dyn, keep)
        new[i] = out[0]
        tapes.append(tape)
    return new, (tapes if keep else None)


# ----------------------------------------------------------------------------------------- evolve


def _diagnostics(rho, terms) -> dict[str, Any]:
    xp = _xp(rho)
    s = eigvalsh(rho)
    ent = -xp.where(s > 0, s * xp.log(xp.where(s > 0, s, 1.0)), 0.0).sum(axis=1)
    out = {term_var(k): terms[k] for k in ("total", *TERMS)}
    out.update(
        agent_purity=xp.einsum("nkl,nlk->n", rho, rho).real,
        agent_entropy=ent,
        system_trace_residual=float(xp.abs(rho.diagonal(axis1=1, axis2=2).sum(axis=1) - 1).max()),
        system_hermiticity_residual=float(xp.abs(rho - dagger(rho)).max()),
        system_min_eigenvalue=float(s[:, 0].min()),
    )
    return out


def _check(rho, step_no: int) -> None:
    xp = _xp(rho)
    n, d = rho.shape[0], rho.shape[-1]
    bad = ~xp.isfinite(rho).reshape(n, -1).all(axis=1)
    if bool(bad.any()):
        raise DynamicsError(step_no, "rho", "non-finite after the step", agent=int(xp.argmax(bad)))
    tol = tolerance(rho.dtype) * d
    lam_min = eigvalsh(rho)[:, 0]
    if bool((lam_min < -tol).any()):
        i = int(xp.argmin(lam_min))
        raise DynamicsError(
            step_no, "rho", f"lost positivity (smallest eigenvalue {float(lam_min[i]):.3g})", i
        )
    tr_err = xp.abs(rho.diagonal(axis1=1, axis2=2).sum(axis=1) - 1)
    if bool((tr_err > tol).any()):
        i = int(xp.argmax(tr_err))
        raise DynamicsError(step_no, "rho", f"trace drifted by {float(tr_err[i]):.3g}", i)


def evolve(
    qstate: xr.Dataset,
    qcfg: QuantumConfig,
    dynamics: QuantumDynamics,
    dt: float,
    n_steps: int,
    *,
    record_every: int = 1,
    ops: QuantumOps = NUMPY_OPS,
    observables=None,
) -> tuple[xr.Dataset, xr.Dataset]:
    """Run ``n_steps`` steps (module docstring) -> (final state, history).

    history: dim ``time`` (coordinates ``step`` = 0, r, 2r, ..., and the last step, r = record_every, and
    ``time`` = step * dt) and ``agent``: ``energy_total`` and ``energy_<term>`` (F of qcfg, nats;
    docs/outputs.md), ``agent_purity`` tr rho^2,
    ``agent_entropy`` S(rho), ``system_trace_residual`` max|tr rho - 1|, ``system_hermiticity_residual``
    max|rho - rho^dag|, ``system_min_eigenvalue`` min lambda_min(rho), ``system_mirror_eta`` (the last
    accepted mirror step, NaN without mirror steps). Raises DynamicsError (step, agent, variable) when a
    step leaves rho non-finite, non-positive or with a drifted trace (tolerance 1000 u d).
    observables: as for :func:`vfesim.run_dynamics` (or a :class:`vfesim.observables.Observables`), each
    recorded as the history variable of its name.
    """
    if not isinstance(dynamics, QuantumDynamics):
        raise TypeError(f"dynamics: must be a QuantumDynamics, got {type(dynamics).__name__}")
    for key, v, lo in (("n_steps", n_steps, 0), ("record_every", record_every, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{key}: must be an integer >= {lo}, got {v!r}")
    dt = _check_real("dt", dt, positive=True)
    validate_state(qstate, qcfg)
    obs = observables
    if not isinstance(obs, Observables):
        obs = Observables(obs, qcfg, qstate.sizes["agent"], reserved=list(qstate.data_vars))
    arrays = {k: qstate[k].data for k in qstate.data_vars}
    P = prepare(arrays, qcfg, dynamics)
    rho = arrays["rho"]
    rows: list[dict] = []
    values: list[dict] = []
    steps: list[int] = []
    eta = float("nan")

    def record(k: int) -> None:
        terms = energy_and_gradient_arrays({**arrays, "rho": rho}, qcfg, ops=ops)[0]
        row = _diagnostics(rho, terms)
        row["system_mirror_eta"] = eta
        rows.append(row)
        steps.append(k)
        if obs.entries:
            values.append(obs.evaluate(_with_rho(qstate, rho)))

    record(0)
    for k in range(1, n_steps + 1):
        rho, _ = step(P, rho, dt, dynamics, ops=ops)
        for _ in range(dynamics.mirror_steps):
            rho, info = mirror_descent_step(
                {**arrays, "rho": rho},
                qcfg,
                eta0=dynamics.mirror_eta,
                armijo_c=dynamics.armijo_c,
                max_backtracks=dynamics.max_backtracks,
                ops=ops,
            )
            eta = info["eta"]
        _check(rho, k)
        if k % record_every == 0 or k == n_steps:
            record(k)
    to_host = host_array
    data = {}
    for key in rows[0]:
        col = [to_host(r[key]) for r in rows]
        data[key] = (("agent",) if key.startswith("agent_") else (), np.stack(col))
    data.update(obs.stack(values) if obs.entries else {})
    attrs = {"family": "quantum", "dt": dt, "dynamics": repr(dynamics)}
    hist = history(steps, dt, data, attrs, obs.var_attrs)
    return _with_rho(qstate, rho), hist


def _with_rho(qstate: xr.Dataset, rho) -> xr.Dataset:
    """``qstate`` with the belief ``rho`` replaced (attributes kept)."""
    out = qstate.copy()
    out["rho"] = (qstate["rho"].dims, rho, qstate["rho"].attrs)
    return out
