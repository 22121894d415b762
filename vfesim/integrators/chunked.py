"""Integrators on agent-chunked states: the runs of the dask backend (SPEC §4, issue 11).

The state, the integrator arrays (momenta, log-Cholesky coordinates, Adam moments) and the force stay
Dask arrays chunked along ``agent`` and persisted on the scheduler's workers for the whole run; the
client holds only their futures and, per step, the energy terms (floats). One step is one task graph:

* the update, per chunk, from the chunk's state, integrator arrays and force: the host integrators'
  own per-agent code (:func:`~vfesim.integrators.gradient_flow.flow_update`,
  :func:`~vfesim.integrators.hamiltonian.kick_drift_pair`) with the serial Numba update kernels
  (:class:`~vfesim.backends.numba_backend.SerialUpdates`), then the NaN/SPD guard of SPEC §5 on the
  chunk (errors name the global agent);
* the energy and force of the new state: :func:`vfesim.backends.dask_backend.lazy_energy`;
* Hamiltonian methods: per chunk the sums of squared momenta; the kinetic energy adds them on the
  client in a fixed order (deterministic for a given chunking).

``dask.persist`` of the new arrays and one ``compute`` of the terms end the step. The update is per agent
and every reduction has a fixed order, so a run is bitwise reproducible for a given chunking, on any
scheduler and any number of workers. The memory of a worker: its chunks of state, integrator arrays
and force, plus the evaluation's O(chunk D + N D) per pair task.

Methods: "gradient_flow" (every rule) and the constant-mass schemes "symplectic_euler", "verlet",
"ruth3", "pefrl". Initial momenta are drawn on the client with the same generator calls as on the
other backends (one (N, ...) array per momentum, then chunked).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import dask
import dask.array as da
import numpy as np
import xarray as xr

from ..backends.dask_backend import device_task
from ..config import ModelConfig
from ..family import family_of
from ..state import StateError, validate_state
from .base import Carry, DynamicsError, Integrator, check_options, guard_state, guard_terms
from .gradient_flow import FlowRule, flow_settings, flow_update, flow_update_device
from .hamiltonian import DEFAULTS as HAMILTON_DEFAULTS
from .hamiltonian import SCHEMES, _setup, kick_drift_pair

__all__ = ["make_chunked", "ChunkedIntegrator", "ChunkDynamicsError", "chunk_error", "set_task_hook"]

_CACHE = "_vfesim_chunked_force"
# Called as hook(step, r0) at the start of every per-chunk update task (fault injection in tests: a
# worker process that runs a task and dies). Set on the workers with Client.run(set_task_hook, fn).
_TASK_HOOK: Callable[[int, int], None] | None = None


def set_task_hook(hook: Callable[[int, int], None] | None) -> None:
    """Install ``hook(step, r0)``, run at the start of every per-chunk update task in this process
    (None removes it). For fault-injection tests; ``Client.run(set_task_hook, hook)`` installs it on
    every worker of a cluster."""
    global _TASK_HOOK
    _TASK_HOOK = hook


class ChunkDynamicsError(Exception):
    """A DynamicsError raised in a chunk task, picklable (DynamicsError's constructor is not the one
    pickle calls); the agent is global. :meth:`error` rebuilds it on the client."""

    def __init__(self, step: int, variable: str, message: str, agent: int | None):
        super().__init__(step, variable, message, agent)

    def error(self) -> DynamicsError:
        return DynamicsError(*self.args)


def chunk_error(e: DynamicsError, r0: int) -> ChunkDynamicsError:
    """The ChunkDynamicsError of a DynamicsError raised on the chunk of agents r0, ...: the agent global."""
    message = str(e).split(": ", 2)[-1]
    return ChunkDynamicsError(e.step, e.variable, message, None if e.agent is None else e.agent + r0)


def _guard(n: int, arrays, cfg, aux, r0: int) -> None:
    """The guard of SPEC §5 on one chunk: ChunkDynamicsError naming the global agent."""
    try:
        guard_state(n, arrays, cfg, aux)
    except DynamicsError as e:
        raise chunk_error(e, r0) from None


def _own(d: dict) -> dict:
    from ..backends.dask_backend import _own as own

    return own(d)


def _hook(n: int, r0: int) -> None:
    if _TASK_HOOK is not None:
        _TASK_HOOK(n, r0)


def _serial(cfg):
    """The serial Numba update operations (tasks run on the scheduler's threads), for cfg's family."""
    from ..backends.numba_backend import SerialUpdates
    from .base import adapt_ops

    return adapt_ops(SerialUpdates(cfg.K), cfg)


_DEVICE: dict = {}


def _device_ops(cfg):
    """The cuda backend's update operations (fused kernels, guard flag) adapted to cfg's family: one
    per process, thread and K (each scheduler thread raises its own flag)."""
    key = (family_of(cfg).name, cfg.K, threading.get_ident())
    if key not in _DEVICE:
        from ..backends import cuda_backend as cb
        from .base import adapt_ops

        _DEVICE[key] = adapt_ops(cb.BACKEND.updates(cfg.K), cfg)
    return _DEVICE[key]


# ---- per-chunk tasks ------------------------------------------------------------------------------------
@device_task
def _flow_task(rule: FlowRule, cfg, arrays, grads, aux, n: int, r0: int, inner: str = "numba"):
    """Gradient flow, one chunk: (moved state arrays, new aux), host arrays. inner "cuda": the fused
    update kernel on the worker's GPU (the cuda backend's), the guard only where its flag is raised."""
    _hook(n, r0)
    if inner == "cuda":
        return _flow_device(rule, cfg, arrays, grads, aux, n, r0)
    arrays, grads, aux = _own(arrays), _own(grads), _own(aux)
    rule = dataclasses.replace(rule, ops=_serial(cfg))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        new, aux = flow_update(rule, arrays, grads, aux, n)
    _guard(n, new, cfg, aux, r0)
    return {k: new[k] for k in rule.ops_fields}, aux


def _flow_device(rule: FlowRule, cfg, arrays, grads, aux, n: int, r0: int):
    """:func:`_flow_task` on the device: the cuda backend's Adam and gradient-flow kernels (as its
    in-process integrator runs them), copied back to the host. The kernels flag non-finite outputs;
    only then does the chunk get the host guard (which names the agent). A covariance that lost SPD
    shows as a non-finite energy term, which the step diagnoses (:func:`_guard_task`)."""
    from ..arrays import host_array

    ops = _device_ops(cfg)
    if ops.xp is np:  # the CUDA simulator: kernels write their host arguments back, so own copies
        arrays, grads, aux = _own(arrays), _own(grads), _own(aux)
    put = ops.put
    dev = {k: put(v) for k, v in arrays.items()}
    ops.reset()
    out, aux = flow_update_device(
        rule,
        ops,
        dev,
        {k: put(grads[k]) for k in rule.ops_fields},
        {k: put(v) for k, v in aux.items()},
        n,
        put(rule.eta),
        rule.ops_fields,
    )
    new = {k: host_array(v) for k, v in out.items()}
    aux = {k: host_array(v) for k, v in aux.items()}
    if host_array(ops.flag)[0]:
        _guard(n, {**arrays, **new}, cfg, aux, r0)
        raise ChunkDynamicsError(n, "state", "the update produced NaN or Inf", None)
    return new, aux


def _guard_task(n: int, arrays, cfg, aux, r0: int) -> None:
    """The host guard of one chunk (after a non-finite energy term of an inner "cuda" step)."""
    _guard(n, _own(arrays), cfg, _own(aux), r0)


def _pair_task(c, arrays, aux, grads, kick: float, drift: float, damp_first: bool, n: int, r0: int):
    """One (kick, drift) pair, one chunk: (moved state arrays, or {} when drift == 0; new aux). The
    momenta are damped first when ``damp_first``; the chunk is guarded after a drift (the energy
    follows)."""
    _hook(n, r0)
    arrays, aux, grads = _own(arrays), _own(aux), _own(grads)
    c = dataclasses.replace(c, ops=_serial(c.cfg))
    if damp_first and c.damp != 1.0:
        for k in c.p_names:
            aux[k] *= c.damp
    x = {m: arrays[m].copy() for m, _ in c.blocks}
    if c.frame is not None:
        x[c.frame] = arrays[c.frame].copy()
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        arrays = kick_drift_pair(c, kick, drift, arrays, x, aux, grads)
    if drift == 0.0:
        return {}, aux
    _guard(n, arrays, c.cfg, aux, r0)
    return {k: arrays[k] for k in _moved(c)}, aux


def _finish_task(c, arrays, aux, n: int, r0: int):
    """End of a Hamiltonian step, one chunk: momenta damped, the guard, and the chunk's sums of squared
    momenta (float64, in ``p_names`` order). (aux, sums)."""
    aux = _own(aux)
    if c.damp != 1.0:
        for k in c.p_names:
            aux[k] *= c.damp
    _guard(n, arrays, c.cfg, aux, r0)
    return aux, _square_sums(c.p_names, aux)


def _square_sums(names, aux) -> list[float]:
    return [float(np.einsum("i,i->", a, a)) for a in (aux[k].reshape(-1) for k in names)]


def _kinetic_task(names, aux):
    return _square_sums(names, _own(aux))


def _init_task(c, arrays, r0: int):
    """Log-Cholesky coordinates of one chunk's covariances, and the covariances rebuilt from them (the
    host init's ``theta_to_sigma(sigma_to_theta(Sigma))``); the chunk is validated first (errors only:
    the restore that follows validates again and reports warnings with global agents)."""

    from ..backends.dask_backend import ChunkError, task_warnings
    from ..gaussian.geometry import sigma_to_theta

    arrays = _own(arrays)
    try:
        with task_warnings(record=False):
            validate_state(arrays, c.cfg)
    except StateError as e:
        raise ChunkError.wrap(e, r0) from None
    ops = _serial(c.cfg)
    theta = {f"theta_{s}": sigma_to_theta(arrays[s]) for _, s in c.blocks}
    return {s: ops.theta_to_sigma(theta[f"theta_{s}"]) for _, s in c.blocks}, theta


def _moved(c) -> list[str]:
    out = [v for b in c.blocks for v in b]
    return out + ([c.frame] if c.frame is not None else [])


# ---- the chunked run ------------------------------------------------------------------------------------
class ChunkedIntegrator(NamedTuple):
    """An :class:`~vfesim.integrators.base.Integrator` on chunked states, with its ``layout`` (the
    agent chunking, fixed at the first init or restore; the run loop writes by it)."""

    name: str
    init: Callable[[xr.Dataset], Carry]
    step: Callable[[Carry], Carry]
    restore: Callable
    layout: Any


class _Layout:
    """The agent chunking of a run (fixed at its first init or restore) and its persisted plan."""

    def __init__(self, cfg: ModelConfig, chunks, inner: str):
        self.cfg, self.chunks, self.inner = cfg, chunks, inner
        self.bounds: tuple[int, ...] | None = None
        self.plan = None
        self.placed: list | None = None  # the chunks' workers (workers())

    def fix(self, state: xr.Dataset) -> None:
        from ..backends import dask_backend as db

        n = state.sizes["agent"]
        chunks = self.chunks
        if chunks is None:
            first = state[next(iter(state.data_vars))]
            if isinstance(first.data, da.Array):
                chunks = first.chunksizes["agent"]
            else:
                chunks = db.auto_chunk(self.cfg, n, {k: state[k].data for k in state.data_vars})
        bounds = db.chunk_bounds(n, chunks)
        if self.bounds != bounds:
            db._check_neighbours(self.cfg, n)
            self.inner = db.resolve_inner(self.inner)
            self.bounds = bounds
            self.placed = None
            self.plan = db.plan(self.cfg, bounds, self.inner, self.workers()).persist()
            db._log_client()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(np.diff(self.bounds).tolist())

    @property
    def starts(self) -> tuple[int, ...]:
        return self.bounds[:-1]

    def workers(self) -> list:
        """Per chunk, the worker its tasks run on (None: anywhere), as last placed (:meth:`place`)."""
        return self.place() if self.placed is None else self.placed

    def place(self) -> list:
        """Place the chunks on the live workers (one scheduler round trip; once per step): dealt at the
        first call (``dask_backend.graph_workers``; field agents: no placement), then kept while their
        workers live: a lost worker's chunks move, and a worker that joined takes chunks from the most
        loaded ones; nothing else moves."""
        from ..backends.dask_backend import graph_workers

        self.placed = graph_workers(self.cfg, self.bounds, keep=self.placed)
        return self.placed

    def array(self, a) -> da.Array:
        """``a`` (NumPy or Dask, agents first) chunked at the run's bounds."""
        chunks = (self.sizes, *a.shape[1:])
        if isinstance(a, da.Array):
            return a.rechunk(chunks)
        return da.from_array(np.asarray(a), chunks=chunks, name=False)


def _reraise(fn, *args):
    """fn(*args), with a task's ChunkError / ChunkDynamicsError turned back into its error."""
    from ..backends.dask_backend import ChunkError

    try:
        return fn(*args)
    except (ChunkError, ChunkDynamicsError) as e:
        raise e.error() from None


def _dataset(state: xr.Dataset, arrays: dict) -> xr.Dataset:
    data = {k: (v.dims, arrays[k] if k in arrays else v.data, v.attrs) for k, v in state.data_vars.items()}
    return xr.Dataset(data, coords=state.coords, attrs=dict(state.attrs))


def _blocks(arrays: dict) -> list[dict]:
    from ..backends.dask_backend import blocks

    return blocks(arrays) if arrays else []


def make_chunked(
    method: str, cfg: ModelConfig, dt: float, *, backend, friction: float = 0.0, seed: int = 0, **options
) -> ChunkedIntegrator:
    """The integrator ``method`` on agent-chunked Dask arrays (the dask ``backend``, whose ``chunks`` fix
    the chunking: agents per chunk or chunk sizes; None: a Dask-backed state's own chunks, else
    :func:`~vfesim.backends.dask_backend.auto_chunk`). Methods: gradient_flow and the constant-mass
    schemes; the option ``energy`` (a custom potential) is not available on the dask backend."""
    if method == "riemannian_leapfrog":
        raise ValueError(
            "method 'riemannian_leapfrog' runs on the 'numpy' and 'numba' backends only, not 'dask' "
            "(use a constant-mass scheme: symplectic_euler, verlet, ruth3, pefrl)"
        )
    if options.get("energy") is not None:
        raise ValueError(f"method {method!r}: option 'energy' (a custom potential) is not available on dask")
    layout = _Layout(cfg, backend.chunks, backend.inner)
    if method == "gradient_flow":
        return _make_flow(cfg, dt, layout, friction, options)
    return _make_const(method, cfg, dt, layout, friction, seed, backend, options)


def _evaluate(layout: _Layout, cfg, arrays: dict, validate: bool):
    from ..backends.dask_backend import lazy_energy

    return lazy_energy(arrays, cfg, layout.bounds, validate, layout.plan, layout.workers())


def _chunk_arrays(layout: _Layout, state: xr.Dataset, aux: dict) -> tuple[xr.Dataset, dict]:
    state = _dataset(state, {k: layout.array(state[k].data) for k in state.data_vars})
    return state, {k: layout.array(v) for k, v in aux.items()}


def _finish(summary) -> dict[str, float]:
    from ..backends.dask_backend import finish_terms

    return finish_terms(summary)


def _make_flow(cfg, dt, layout: _Layout, friction: float, options) -> Integrator:
    opt, fields, eta, moving, mode, b1, b2, eps = flow_settings(cfg, dt, friction, options)
    aux_names = tuple(f"adam_{w}_{k}" for k in moving for w in ("m", "v")) if mode == 2 else ()
    rule = _FlowRule(None, eta, mode, moving, b1, b2, eps, tuple(fields))
    shipped: dict[str, Any] = {}

    def _carry(state, step, aux, terms, grads, rng_state=None):
        c = Carry(state, step, aux, terms, rng_state)
        object.__setattr__(c, _CACHE, grads)
        return c

    def restore(
        state: xr.Dataset, step: int, aux: dict, rng_state: dict | None = None, *, validate: bool = True
    ) -> Carry:
        if set(aux) != set(aux_names):
            raise ValueError(f"gradient_flow restore: aux keys {sorted(aux)} != expected {sorted(aux_names)}")
        layout.fix(state)
        if "rule" not in shipped:
            (shipped["rule"],) = dask.persist(dask.delayed(rule, traverse=False))
        state, aux = _chunk_arrays(layout, state, aux)
        arrays = {k: state[k].data for k in state.data_vars}
        summary, grads = _evaluate(layout, cfg, arrays, validate)
        arrays, aux, grads, summary = _reraise(dask.persist, arrays, aux, grads, summary)
        terms = _finish(_reraise(summary.compute))
        return _carry(_dataset(state, arrays), int(step), aux, terms, grads, rng_state)

    def init(state: xr.Dataset) -> Carry:
        aux = {}
        if mode == 2:
            for k in moving:
                aux[f"adam_m_{k}"] = da.zeros_like(_as_dask(state[k].data))
                aux[f"adam_v_{k}"] = da.zeros_like(_as_dask(state[k].data))
        return restore(state, 0, aux, None)

    def step(carry: Carry) -> Carry:
        grads = getattr(carry, _CACHE, None)
        arrays = {k: carry.state[k].data for k in carry.state.data_vars}
        if grads is None:
            carry = restore(carry.state, carry.step, carry.aux, carry.rng_state)
            grads = getattr(carry, _CACHE)
        n = carry.step + 1
        sp, gp, ap = _blocks(arrays), _blocks(grads), _blocks(carry.aux)
        w = layout.place()
        parts = [
            _delayed(_flow_task, w[j])(
                shipped["rule"], layout.plan.cfg, sp[j], gp[j], ap[j] if ap else {}, n, r0, layout.inner
            )
            for j, r0 in enumerate(layout.starts)
        ]
        sp = [_delayed(_merge, w[j])(sp[j], parts[j]) for j in range(len(parts))]
        ap = [_delayed(_second, w[j])(p) for j, p in enumerate(parts)]
        summary, gp = _chunk_energy(layout, cfg, sp, False)
        sp, ap, gp, summary = _reraise(dask.persist, sp, ap, gp, summary)
        terms = _finish(_reraise(summary.compute))
        if layout.inner == "cuda" and not all(math.isfinite(v) for v in terms.values()):
            # the device update checks finiteness only: the host guard names what went wrong
            guards = [
                _delayed(_guard_task, w[j])(n, sp[j], layout.plan.cfg, ap[j] if ap else {}, r0)
                for j, r0 in enumerate(layout.starts)
            ]
            _reraise(dask.compute, guards)
        guard_terms(n, terms)
        new, aux, grads = (
            _arrays(layout, sp, arrays),
            _arrays(layout, ap, carry.aux),
            _arrays(layout, gp, grads),
        )
        return _carry(_dataset(carry.state, new), n, aux, terms, grads)

    return ChunkedIntegrator("gradient_flow", init, step, restore, layout)


@dataclasses.dataclass(frozen=True)
class _FlowRule(FlowRule):
    """A FlowRule that names the fields the fused update returns (ops is set in the task)."""

    ops_fields: tuple[str, ...] = ()


def _dense(cfg):
    return cfg if cfg.dense else cfg.replace(neighbours="dense")


def _as_dask(a):
    return a if isinstance(a, da.Array) else da.from_array(np.asarray(a), name=False)


def _make_const(method, cfg, dt, layout: _Layout, friction, seed, backend, options) -> Integrator:
    from ..backends.numba_backend import NumbaUpdates

    check_options(method, options, HAMILTON_DEFAULTS)
    host = dataclasses.replace(backend, updates=NumbaUpdates)  # _setup's checks; its ops stay unused
    c_full = _setup(method, cfg, float(dt), host, friction, options)
    # What the tasks need: no energy function, no neighbour lists, ops set in the task.
    c = dataclasses.replace(c_full, cfg=_dense(cfg), efn=None, ops=None, dev=None)
    table = SCHEMES[method][1]
    role = {}
    for m, s in c.blocks:
        role[f"p_{m}"] = (m, "mean")
        role[f"p_{s}"] = (s, "cov")
    if c.frame is not None:
        role[f"p_{c.frame}"] = (c.frame, "frame")
    shipped: dict[str, Any] = {}
    T = cfg.K * (cfg.K + 1) // 2

    def ship():
        if shipped.get("bounds") != layout.bounds:
            (shipped["c"],) = dask.persist(dask.delayed(c, traverse=False))
            shipped["bounds"] = layout.bounds

    def kinetic(sums) -> float:
        """0.5 sum_k |p_k|^2 / m_k from per-chunk sums, added in chunk order, names in p_names order."""
        total = 0.0
        for j, k in enumerate(c.p_names):
            s = 0.0
            for chunk in sums:
                s += chunk[j]
            total += 0.5 * c.inv_m[k[2:]] * s
        return total

    def make_carry(state, step, aux, eterms, grads, kin: float, rng_state):
        terms = dict(eterms)
        terms["kinetic"] = kin
        terms["hamiltonian"] = eterms["total"] + kin
        carry = Carry(state, step, aux, terms, rng_state)
        object.__setattr__(carry, _CACHE, (eterms, grads))
        return carry

    def restore(
        state: xr.Dataset, step: int, aux: dict, rng_state: dict | None = None, *, validate: bool = True
    ) -> Carry:
        if set(aux) != set(c.aux_names):
            raise ValueError(f"{method} restore: aux keys {sorted(aux)} != expected {sorted(c.aux_names)}")
        layout.fix(state)
        ship()
        state, aux = _chunk_arrays(layout, state, aux)
        arrays = {k: state[k].data for k in state.data_vars}
        summary, grads = _evaluate(layout, cfg, arrays, validate)
        w = layout.workers()
        sums = [_delayed(_kinetic_task, w[j])(c.p_names, a) for j, a in enumerate(_blocks(aux))]
        arrays, aux, grads, summary, sums = _reraise(dask.persist, arrays, aux, grads, summary, sums)
        summary, sums = _reraise(dask.compute, summary, sums)
        eterms = _finish(summary)
        return make_carry(_dataset(state, arrays), int(step), aux, eterms, grads, kinetic(sums), rng_state)

    def init(state: xr.Dataset) -> Carry:
        layout.fix(state)
        ship()
        state = _dataset(state, {k: layout.array(state[k].data) for k in state.data_vars})
        w = layout.workers()
        blocks = _blocks({k: state[k].data for k in state.data_vars})
        parts = [
            _delayed(_init_task, w[j])(shipped["c"], b, r0)
            for j, (b, r0) in enumerate(zip(blocks, layout.starts, strict=True))
        ]
        from ..backends.dask_backend import from_blocks

        covs = [s for _, s in c.blocks]
        new = from_blocks(parts, 0, {s: state[s].data for s in covs}, layout.sizes)
        lead = state[covs[0]].shape[:-2]  # (agent,) or, for field agents, (agent, *grid)
        like = {}
        for s in covs:
            like[f"theta_{s}"] = da.empty(
                (*lead, T), dtype=state[s].dtype, chunks=(layout.sizes, *lead[1:], T)
            )
        aux = from_blocks(parts, 1, like, layout.sizes)
        rng = np.random.default_rng(seed)
        # Points the family's geometry keeps still (field agents: outside the supports) start at rest,
        # as in the in-memory init (the same draws, then zeros there).
        still = getattr(family_of(cfg).geometry, "frozen", None)
        rest = None if still is None else np.asarray(still(state))
        dtype = state[c.blocks[0][0]].dtype
        for name in c.p_names:
            field, kind = role[name]
            shape = (*lead, T) if kind == "cov" else state[field].shape
            if c.opt["momenta"] == "zero":
                aux[name] = da.zeros(shape, dtype, chunks=(layout.sizes, *shape[1:]))
                continue
            z = rng.standard_normal(shape)
            if rest is not None:
                z[rest] = 0.0
            aux[name] = layout.array((math.sqrt(c.mass[field]) * z).astype(dtype))
        new, aux = _reraise(dask.persist, new, aux)
        return restore(_dataset(state, new), 0, aux, rng.bit_generator.state)

    def step(carry: Carry) -> Carry:

        cached = getattr(carry, _CACHE, None)
        if cached is None:
            carry = restore(carry.state, carry.step, carry.aux, carry.rng_state)
            cached = getattr(carry, _CACHE)
        eterms, grads = cached
        n = carry.step + 1
        arrays = {k: carry.state[k].data for k in carry.state.data_vars}
        sp, ap, gp = _blocks(arrays), _blocks(carry.aux), _blocks(grads)
        w = layout.place()
        summaries, valid = [], True
        for i, (kick, drift) in enumerate(table):
            if kick != 0.0 and not valid:
                summary, gp = _chunk_energy(layout, cfg, sp, False)
                summaries.append(summary)
                valid = True
            parts = [
                _delayed(_pair_task, w[j])(shipped["c"], sp[j], ap[j], gp[j], kick, drift, i == 0, n, r0)
                for j, r0 in enumerate(layout.starts)
            ]
            if drift != 0.0:
                sp = [_delayed(_merge, w[j])(sp[j], parts[j]) for j in range(len(parts))]
                valid = False
            ap = [_delayed(_second, w[j])(p) for j, p in enumerate(parts)]
        if not valid:
            summary, gp = _chunk_energy(layout, cfg, sp, False)
            summaries.append(summary)
        parts = [
            _delayed(_finish_task, w[j])(shipped["c"], sp[j], ap[j], n, r0)
            for j, r0 in enumerate(layout.starts)
        ]
        ap = [_delayed(_first, w[j])(p) for j, p in enumerate(parts)]
        sums = [_delayed(_second, w[j])(p) for j, p in enumerate(parts)]
        sp, ap, gp, summaries, sums = _reraise(dask.persist, sp, ap, gp, summaries, sums)
        summaries, sums = _reraise(dask.compute, summaries, sums)
        for s in summaries:
            eterms = _finish(s)
            guard_terms(n, eterms)
        state = _dataset(carry.state, _arrays(layout, sp, arrays))
        aux, grads = _arrays(layout, ap, carry.aux), _arrays(layout, gp, grads)
        return make_carry(state, n, aux, eterms, grads, kinetic(sums), carry.rng_state)

    return ChunkedIntegrator(method, init, step, restore, layout)


def _first(x):
    return x[0]


def _second(x):
    return x[1]


def _merge(arrays: dict, part) -> dict:
    """A chunk's state arrays with those an update task moved (``part[0]``) replaced."""
    return {**arrays, **part[0]}


def _delayed(f, worker=None):
    """``dask.delayed(f, pure=False)``, its tasks on ``worker`` (None: anywhere; ``dask_backend.at``)."""
    from ..backends.dask_backend import at

    return at(worker, f)


def _chunk_energy(layout: _Layout, cfg, parts: list, validate: bool):
    from ..backends.dask_backend import chunk_energy

    # the run's placement: a step's parts are new tasks, placed like the rest of the step
    return chunk_energy(parts, cfg, layout.bounds, validate, layout.plan, layout.workers())


def _arrays(layout: _Layout, parts: list, like: dict) -> dict:
    """Dask arrays like ``like`` from persisted per-chunk dicts ``parts`` (cheap: the parts are keys)."""
    from ..backends.dask_backend import from_blocks

    return from_blocks(parts, None, like, layout.sizes) if like else {}
