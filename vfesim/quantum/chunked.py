"""Density-matrix runs on the dask backend (methods "channels" and "mirror_descent" of :mod:`.runs`).

The state stays Dask arrays chunked along ``agent`` and persisted on the scheduler's workers for the
whole run (the chunking of :class:`vfesim.integrators.chunked._Layout`: ``run.chunks``, else the default
of :func:`vfesim.backends.dask_backend.auto_chunk`); the client holds their futures and, per step, the
energy terms. The per-run caches of :func:`.evolve.prepare` (eigen-decompositions of H_i, Gibbs priors,
transports U_i U_j^dag, coupling strengths, rates) are built per chunk at init and restore and persisted
beside the state. One step:

* channels, per receiver chunk: the rho rows of the sender chunks its coupling window names are gathered
  (dense: every chunk; ring and causal lists: the chunks of :func:`vfesim.backends.dask_backend.plan`'s
  sparse plan, the one the alignment terms use, and of those only the rows it names), and order
  "jacobi" moves the chunk, given the senders' states and frames, in the serial builds of the channel
  step's CPU kernels (the numba backend's; :func:`.evolve.agent_update`, the NumPy step, above their
  largest d) or, with inner "cuda", in the cuda backend's channel step kernels on the worker's GPU: one
  task per chunk, all in parallel. "gauss_seidel": :func:`.evolve.agent_update` on the
  chunk's agents in index order, reading the new states of earlier chunks: each chunk
  waits for the earlier chunks it reads (a chain for dense and causal windows: no parallelism, exact).
  The guard of :func:`.evolve._check` (non-finite, positivity, trace drift) runs on the chunk in its task
  and names the global agent;
* ``observe = "born"``: one uniform per agent is drawn on the client from the run's RNG (the same
  ``rng.random(N)`` call as the in-process run, so outcomes are bitwise theirs), sampled per chunk;
* ``mirror_steps`` Armijo mirror-descent steps (:mod:`.flows`): F and its gradient at the current state by
  the dask backend's lazy evaluation (:func:`vfesim.backends.dask_backend.chunk_energy`), log x per
  chunk, then per trial step size eta, per chunk the trial state exp(log x - eta G)/tr and its share of
  sum_i tr(G_i (rho_i(eta) - rho_i)), and F at the trial state (a full energy graph: its gradient comes
  along and is reused by the next mirror step when accepted). The accept/reject test is global: one
  round trip to the client per trial (one graph, one ``persist`` and one ``compute``). Cost per step and
  accepted first trial: two energy graphs (the in-process run evaluates F three times, the terms
  included); every backtrack adds one energy graph and one round trip;
* the terms of the final state (the accepted trial's, or F at the channels' output); non-finite terms
  stop the run with a DynamicsError, as in-process.

Every per-agent result is computed by the in-process run's code on the chunk's rows; reductions (terms,
the Armijo decrease) add per-chunk float64 sums in chunk order. A run is therefore bitwise reproducible
for a given chunking on any scheduler, and equal to the in-process "numpy" run to rounding (the sums'
association; the "numba" backend's kernels differ by rounding as well). With inner "cuda" the Jacobi
channel step and the energy run on the workers' GPUs, the chunk states stay on the host between tasks;
Gauss–Seidel steps run the array code on the host.
Method "fit" (a rollout fit of one Hamiltonian estimate, not a population run) is refused on dask.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import dask
import numpy as np
import xarray as xr

from ..arrays import host_array
from ..backends.dask_backend import _identity, device_task
from ..integrators import chunked as ch
from ..integrators.base import Carry, DynamicsError
from .channels import coupling_strengths, pair_distances
from .config import QuantumConfig
from .evolve import Prepared, _check, _per_agent, agent_update
from .flows import _exp_normalised, _log_floored
from .frames import frames, spin_generators
from .linalg import dagger
from .unitary import gibbs, hamiltonian_eig

__all__ = ["QuantumChunked", "make_chunked"]

_CACHE = "_quantum_chunked_cache"  # per-chunk Prepared caches (recomputable: never checkpointed)


class QuantumChunked(NamedTuple):
    """init/step/restore of a density-matrix run on agent chunks, with the variables saved per frame
    (``trajectory``) and the chunking (``layout``, fixed at the first init or restore)."""

    name: str
    init: Callable[[xr.Dataset], Carry]
    step: Callable[[Carry], Carry]
    restore: Callable[..., Carry]
    trajectory: tuple[str, ...]
    layout: Any


class _Window(NamedTuple):
    """The coupling window of one receiver chunk: the sender chunks it reads (ascending), and for sparse
    lists the rows' global senders, their rows in the named chunks' parts concatenated, and the mask
    (Delayed; None for "dense", computed in the task, and for no coupling). ``takes``: per named chunk
    the rows of it the window reads (Delayed), or None for the whole chunk (the alignment terms' plan,
    :func:`vfesim.backends.dask_backend._sparse_plan`; the chunk itself is always whole)."""

    kind: str  # "none" | "dense" | "sparse"
    owners: list[int]
    index: Any
    local: Any
    mask: Any
    takes: list | None = None

    def parts(self, chunks: list, workers: list) -> list:
        """The window's sender parts of per-chunk arrays ``chunks`` (Delayed): each named chunk, or the
        rows of it the window reads (cut out on ``workers[s]``, the named chunk's worker)."""
        takes = self.takes or [None] * len(self.owners)
        return [
            chunks[s] if t is None else ch._delayed(_take, workers[s])(chunks[s], t)
            for s, t in zip(self.owners, takes, strict=True)
        ]


def _take(x, rows):
    return x[rows]


def _own(a):
    return np.array(a, order="C", copy=True)


def _item(x, key):
    return x[key]


def _merge(arrays: dict, moved: dict) -> dict:
    """A chunk's state arrays with those a step moved replaced. (Chunk states travel as one Delayed
    dict each: a persisted Delayed nested in a container argument would not keep its future alive.)"""
    return {**arrays, **moved}


def _rows(win: _Window, n: int, r0: int, nc: int):
    """(global senders, their rows in the gathered sender states, mask), each (nc, w), of agents
    r0 .. r0 + nc - 1 (:func:`.channels.coupling_window`'s rows)."""
    if win.kind == "none":
        z = np.zeros((nc, 0), np.int64)
        return z, z, np.zeros((nc, 0), bool)
    if win.kind == "dense":  # every j != i, increasing; the senders are every chunk in order
        j = np.arange(n - 1)[None, :]
        index = j + (j >= np.arange(r0, r0 + nc)[:, None])
        return index, index, np.ones(index.shape, bool)
    return np.asarray(win.index, np.int64), np.asarray(win.local, np.int64), np.asarray(win.mask, bool)


def _frames_task(phi, d: int, dtype):
    return frames(_own(phi), spin_generators(d), dtype)[0]


def _prepare_task(dyn, win: _Window, arrays: dict, U, U_senders: list, n: int, r0: int):
    """The :class:`.evolve.Prepared` caches of one chunk (``index``: the senders' rows in the gathered
    sender states), the global senders (nc, w) and the gathered senders' frames."""
    H, T, rho = _own(arrays["hamiltonian"]), _own(arrays["temperature"]), arrays["rho"]
    nc = rho.shape[0]
    lam, V = hamiltonian_eig(H)
    sigma, l, p = gibbs(lam, V, T)
    index, local, mask = _rows(win, n, r0, nc)
    dist = pair_distances(index, mask, dyn.positions, start=r0)
    eps_c = np.asarray(coupling_strengths(dyn.coupling_strength, dyn.coupling_length, dist, mask), lam.dtype)
    Us = np.concatenate(U_senders) if U_senders else U  # no senders: every slot is masked
    M = U[:, None] @ dagger(Us[local])
    rdt = lam.dtype
    gamma = _per_agent("dephasing_rate", dyn.dephasing_rate, n, np, rdt)[r0 : r0 + nc]
    gamma_th = _per_agent("thermal_rate", dyn.thermal_rate, n, np, rdt)[r0 : r0 + nc]
    P = Prepared(lam, V, T, sigma, l, p, U, None, local, mask, dist, M, eps_c, gamma, gamma_th, {})
    return P, index, Us


def _guarded(rho, n_step: int, r0: int):
    """The guard of :func:`.evolve._check` on a chunk: ChunkDynamicsError naming the global agent."""
    try:
        _check(rho, n_step)
    except DynamicsError as e:
        raise ch.chunk_error(e, r0) from None
    return rho


def _finish_chunk(new, n_step: int, r0: int, u) -> dict:
    _guarded(new, n_step, r0)
    out = {"rho": new}
    if u is not None:
        from .runs import born_outcomes

        out["outcome"] = born_outcomes(new, u)
    return out


# The per-agent caches of a step (the coupling window stays on the host: kernel_ops copies it once, window()).
_DEVICE_FIELDS = ("lam", "V", "T", "sigma", "l", "p", "U", "M", "eps_c", "gamma", "gamma_th")


# Device copies of chunks' caches in this worker process, by the identity of their host eigenvalues
# (dropped with them): not in the persisted caches themselves, which Dask may pickle (to move or spill).
_ON_DEVICE: dict = {}


def _on_device(P: Prepared, U_s, xp):
    """A chunk's caches (and its senders' frames) as arrays of ``xp``, made at its first step on a
    device and kept in this process for the next: the persisted caches stay on their worker, so do the
    copies."""
    if xp is np:  # the CUDA simulator: host arrays already
        return P, U_s
    key = (id(P.lam), xp.__name__)
    hit = _ON_DEVICE.get(key)
    if hit is None:
        moved = {f: None if getattr(P, f) is None else xp.asarray(getattr(P, f)) for f in _DEVICE_FIELDS}
        hit = _ON_DEVICE[key] = (P._replace(**moved, consts={}), xp.asarray(U_s))
        weakref.finalize(P.lam, _ON_DEVICE.pop, key, None)
    return hit


@device_task
def _jacobi_task(dt: float, dyn, prep, rho, senders: list, n_step: int, r0: int, u, inner: str = "numba"):
    """One Jacobi step of one chunk (:func:`.evolve.step`): {"rho"[, "outcome"]}, the window's senders
    given with their frames. inner "numba": the serial builds of the channel step's CPU kernels
    (``numba_backend.SERIAL_OPS``; array code above their largest d); "cuda": the cuda backend's channel
    step kernels on the worker's GPU (the chunk's caches are copied there at its first step and kept with
    them; the states travel per step, the new ones back to the host)."""
    P, _, U_s = prep
    rho = _own(rho)
    S = np.concatenate([_own(s) for s in senders]) if senders else rho
    if inner == "cuda":
        from ..backends import cuda_backend as cb

        ops, xp = cb.QUANTUM_OPS, cb.array_module()
        P, U_s = _on_device(P, U_s, xp)
        rho, S = xp.asarray(rho), xp.asarray(S)
    else:
        from ..backends.numba_backend import SERIAL_OPS

        ops = SERIAL_OPS["quantum"]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the guard reports instead
        new = host_array(ops.channel_step(P, rho, dt, dyn, senders=(S, U_s)))
    return _finish_chunk(new, n_step, r0, u)


def _gauss_seidel_task(dt: float, dyn, prep, rho, olds: list, news: list, own: int, n_step: int, r0: int, u):
    """One Gauss–Seidel step of one chunk: its agents in index order, each reading its senders j < i
    new and the others old (:func:`.evolve.senders`). ``olds``/``news``: the window's sender parts (each
    named chunk, or the rows of it the window reads) at t and after this step (their old states for
    chunks from this one on); ``own``: this chunk's position among them (-1: not one; its part is the
    whole chunk)."""
    P, index, _ = prep
    rho = _own(rho)
    old = np.concatenate([_own(s) for s in olds]) if olds else rho
    new_s = np.concatenate([_own(s) for s in news]) if news else rho.copy()
    off = sum(s.shape[0] for s in olds[:own]) if own >= 0 else -1
    new = rho.copy()
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for k in range(rho.shape[0]):
            loc = P.index[k : k + 1]
            R = np.where((index[k : k + 1] < r0 + k)[..., None, None], new_s[loc], old[loc])
            new[k] = agent_update(P, slice(k, k + 1), rho[k : k + 1], R, dt, dyn)[0][0]
            if off >= 0:
                new_s[off + k] = new[k]
    return _finish_chunk(new, n_step, r0, u)


def _log_task(arrays: dict):
    return _log_floored(_own(arrays["rho"]))


def _trial_task(log_x, G, arrays: dict, eta: float, n_step: int, r0: int):
    """One trial of the line search on a chunk: (its state arrays with the trial rho, the chunk's share
    of sum_i tr(G_i (new_i - rho_i)), the guard's report (step, variable, message, global agent) or
    None)."""
    rho = arrays["rho"]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        new = _exp_normalised(_own(log_x) - eta * _own(G))
        decrease = float(np.einsum("nkl,nlk->", G, new - rho).real)
    try:
        _guarded(new, n_step, r0)
        report = None
    except ch.ChunkDynamicsError as e:
        report = e.args
    return {**arrays, "rho": new}, decrease, report


def make_chunked(cfg: QuantumConfig, integ: dict, backend, seed: int) -> QuantumChunked:
    """The stepper of a validated "channels" / "mirror_descent" integrator section on the dask
    ``backend`` (its ``chunks`` and ``inner``)."""
    from .runs import dynamics

    if integ["method"] == "fit":
        raise ValueError(
            "integrator.method = 'fit' runs on the 'numpy' and 'numba' backends only, not 'dask' (it fits "
            "one rollout, not a population)"
        )
    dyn = dynamics(integ)
    dt, observe = integ["dt"], integ["observe"] == "born"
    layout = ch._Layout(cfg, backend.chunks, backend.inner)
    shipped: dict[str, Any] = {}

    def ship(n: int) -> None:
        """What every step of this chunking shares, on the workers: dyn, and the coupling windows."""
        if shipped.get("bounds") == layout.bounds:
            return
        if dyn.positions is not None and dyn.positions.shape[0] != n:
            raise ValueError(f"integrator.positions: has {dyn.positions.shape[0]} rows for {n} agents")
        nchunks = len(layout.sizes)
        if dyn.coupling == "none":
            windows = [_Window("none", [], None, None, None)] * nchunks
        elif cfg.dense:
            windows = [_Window("dense", list(range(nchunks)), None, None, None)] * nchunks
        else:
            index = np.asarray(cfg.neighbours.index, np.int64)
            spans = zip(layout.bounds[:-1], layout.bounds[1:], strict=True)
            w = layout.workers()  # each chunk's rows beside its tasks
            rows = [ch._delayed(_identity, w[j])(index[r0:r1]) for j, (r0, r1) in enumerate(spans)]
            (rows,) = dask.persist(rows)
            windows = [  # the alignment terms' plan: its local rows and masks are on the workers already
                _Window("sparse", owners, r, local, msk, takes)
                for r, (owners, takes, local, msk) in zip(rows, layout.plan.sparse, strict=True)
            ]
        (shipped["dyn"],) = dask.persist(dask.delayed(dyn, traverse=False))
        shipped["windows"] = windows
        shipped["bounds"] = layout.bounds

    def prepare_parts(parts: list, dtype) -> list:
        """Per chunk, the Delayed (Prepared, global senders) of :func:`_prepare_task`."""
        w = layout.workers()
        U = [ch._delayed(_frames_task, w[c])(p["phi"], cfg.d, dtype) for c, p in enumerate(parts)]
        n = layout.bounds[-1]
        return [
            ch._delayed(_prepare_task, w[c])(shipped["dyn"], win, p, U[c], win.parts(U, w), n, r0)
            for c, (win, p, r0) in enumerate(zip(shipped["windows"], parts, layout.starts, strict=True))
        ]

    def carry_of(state, step_no, terms, rng_state, prepared) -> Carry:
        c = Carry(state, step_no, {}, terms, rng_state)
        object.__setattr__(c, _CACHE, prepared)
        return c

    def restore(
        state: xr.Dataset, step_no: int, aux: dict, rng_state: dict | None = None, *, validate: bool = True
    ) -> Carry:
        if aux:
            raise ValueError(f"{integ['method']} restore: no aux arrays expected, got {sorted(aux)}")
        if observe and rng_state is None:
            raise ValueError("observe = 'born' needs the run's RNG state")
        layout.fix(state)
        ship(state.sizes["agent"])
        state = ch._dataset(state, {k: layout.array(state[k].data) for k in state.data_vars})
        arrays = {k: state[k].data for k in state.data_vars}
        parts = ch._blocks(arrays)
        summary, _ = ch._chunk_energy(layout, cfg, parts, validate)  # validates every chunk in its task
        prepared = prepare_parts(parts, arrays["rho"].dtype)
        arrays, summary, prepared = ch._reraise(dask.persist, arrays, summary, prepared)
        terms = ch._finish(ch._reraise(summary.compute))
        return carry_of(ch._dataset(state, arrays), int(step_no), terms, rng_state, prepared)

    def init(state: xr.Dataset) -> Carry:
        rng = np.random.default_rng(seed) if observe else None
        return restore(state, 0, {}, rng.bit_generator.state if observe else None)

    def channels(parts: list, prepared: list, n_step: int, uniforms: list) -> list:
        """Per chunk, the Delayed {"rho"[, "outcome"]} after the channels."""
        rho = [p["rho"] for p in parts]
        w = layout.workers()
        out: list = []
        moved: list = []  # Gauss-Seidel: the states of the chunks before this one after the step
        for c, (win, r0) in enumerate(zip(shipped["windows"], layout.starts, strict=True)):
            if dyn.order == "jacobi":
                task = ch._delayed(_jacobi_task, w[c])
                args = (prepared[c], rho[c], win.parts(rho, w))
                kw = {"inner": layout.inner}
            else:
                task = ch._delayed(_gauss_seidel_task, w[c])
                olds = win.parts(rho, w)
                news = win.parts(moved + rho[c:], w)
                own = win.owners.index(c) if c in win.owners else -1
                args = (prepared[c], rho[c], olds, news, own)
                kw = {}
            out.append(task(dt, shipped["dyn"], *args, n_step, r0, uniforms[c], **kw))
            moved.append(ch._delayed(_item, w[c])(out[c], "rho"))
        return out

    def mirror(parts: list, n_step: int) -> tuple[list, Any]:
        """``dyn.mirror_steps`` Armijo steps from the chunk states ``parts`` (Delayed dicts, not yet
        persisted) -> (persisted parts, the computed summary of the final state)."""
        known = None  # (computed summary, grads) of the current parts when already evaluated
        w = layout.workers()
        for _ in range(dyn.mirror_steps):
            if known is None:
                summary0, grads0 = ch._chunk_energy(layout, cfg, parts, False)
            else:
                summary0, grads0 = known
            G = [ch._delayed(_item, w[j])(g, "rho") for j, g in enumerate(grads0)]
            log_x = [ch._delayed(_log_task, w[j])(p) for j, p in enumerate(parts)]
            parts, G, log_x, summary0 = ch._reraise(dask.persist, parts, G, log_x, summary0)
            F0 = None
            eta = float(dyn.mirror_eta)
            for _ in range(dyn.max_backtracks + 1):
                trials = [
                    ch._delayed(_trial_task, w[j])(lx, g, p, eta, n_step, r0)
                    for j, (lx, g, p, r0) in enumerate(zip(log_x, G, parts, layout.starts, strict=True))
                ]
                tparts = [ch._delayed(_item, w[j])(t, 0) for j, t in enumerate(trials)]
                summary1, grads1 = ch._chunk_energy(layout, cfg, tparts, False)
                decs = [ch._delayed(_item, w[j])(t, 1) for j, t in enumerate(trials)]
                reports = [ch._delayed(_item, w[j])(t, 2) for j, t in enumerate(trials)]
                tparts, grads1, summary1, decs, reports = ch._reraise(
                    dask.persist, tparts, grads1, summary1, decs, reports
                )
                s0, s1, decs, reports = ch._reraise(dask.compute, summary0, summary1, decs, reports)
                F0 = s0[0]["total"] if F0 is None else F0
                decrease = 0.0
                for x in decs:  # chunk order
                    decrease += x
                if s1[0]["total"] <= F0 + dyn.armijo_c * decrease:
                    bad = next((r for r in reports if r is not None), None)
                    if bad is not None:
                        raise DynamicsError(*bad)
                    parts, known = tparts, (s1, grads1)
                    break
                eta *= 0.5
            else:  # no step accepted: the state stays (eta = 0)
                known = (s0, grads0)
        return parts, known[0]

    def step(carry: Carry) -> Carry:
        prepared = getattr(carry, _CACHE, None)
        if prepared is None:
            carry = restore(carry.state, carry.step, carry.aux, carry.rng_state)
            prepared = getattr(carry, _CACHE)
        n_step = carry.step + 1
        layout.place()  # the step's tasks below read layout.workers()
        arrays = {k: carry.state[k].data for k in carry.state.data_vars}
        parts = ch._blocks(arrays)
        rng_state = carry.rng_state
        uniforms = [None] * len(parts)
        if observe:
            rng = np.random.Generator(np.random.PCG64())  # the run's generator (default_rng's)
            rng.bit_generator.state = rng_state
            u = rng.random(layout.bounds[-1])
            rng_state = rng.bit_generator.state
            uniforms = [u[r0:r1] for r0, r1 in zip(layout.bounds[:-1], layout.bounds[1:], strict=True)]
        moved = channels(parts, prepared, n_step, uniforms)
        w = layout.workers()
        parts = [ch._delayed(_merge, w[c])(p, m) for c, (p, m) in enumerate(zip(parts, moved, strict=True))]
        if dyn.mirror_steps:
            parts, summary = mirror(parts, n_step)
        else:
            summary, _ = ch._chunk_energy(layout, cfg, parts, False)
            parts, summary = ch._reraise(dask.persist, parts, summary)
            summary = ch._reraise(summary.compute)
        terms = {k: float(v) for k, v in summary[0].items()}
        bad = [t for t, v in terms.items() if not np.isfinite(v)]
        if bad:
            raise DynamicsError(n_step, f"terms[{bad[0]!r}]", f"energy term is {terms[bad[0]]}")
        state = ch._dataset(carry.state, ch._arrays(layout, parts, arrays))
        return carry_of(state, n_step, terms, rng_state, prepared)

    trajectory = ("rho", "outcome") if observe else ("rho",)
    return QuantumChunked(integ["method"], init, step, restore, trajectory, layout)
