"""Dask backend: the agent axis in chunks, one task graph per evaluation (SPEC §4).

The model is defined once, by the family's assembly (``family.energy_and_gradient(arrays, cfg,
backend)``); this backend only schedules it. The assembly calls the family-free pairwise layer once per
alignment term with feature rows A, B (N, D), c (N,), and every pairwise interaction goes through those
rows, so an evaluation splits into tasks over agent chunks ``[r0, r1)``:

1. *features* (one task per chunk): the family's assembly on the chunk's arrays, with a pairwise
   function that records each term's (A, B, c, kappa, aggregator) and returns zero energy and zero
   cotangents (the per-agent work of the chunk, O(n K^3), nothing pairwise);
2. *pairs* (one task per receiver chunk): the chunk's receivers against every sender (dense) or against
   the rows its neighbour lists name (sparse: its own chunk whole, and of another chunk only the rows it
   names when they are at most half of it, cut out by a small task beside that chunk's features, see
   :func:`_sparse_plan`), serial Numba kernels (``nogil``) of
   :mod:`vfesim_kernels.pairwise_cpu`, or with inner "cuda" their device twins in ``cuda_backend``.
   Dense with inner "numba": :func:`~vfesim_kernels.pairwise_cpu.pairwise_dense_rows`, the fused serial
   kernel: row energies, gA, gc and these receivers' float64 share (N, D) of every sender's gB. Dense
   with inner "cuda": ``cuda_backend.pairwise_dense_receivers``: row energies, the receivers' gA, gc and
   row statistics (m, inv_s, abar: 3 numbers per receiver), no gB. Sparse,
   ``pairwise_sparse_rows``: row energies, gA, gc and float64 shares of the named senders' gB;
3. *gB*: dense with inner "numba", the shares summed in a binary tree over receiver chunks in ascending
   order; dense with inner "cuda", one task per sender chunk (``cuda_backend.pairwise_dense_senders``)
   recomputes its senders' weights against every receiver from every chunk's A, c and pass-1
   statistics and sums gB_j = sum_i W_ij A_i / 2 in a fixed order, as float64 (pass 2 of
   two: no (N, D) share per task and no reduction tree, the same pair work on the GPU; on the CPU's tiled
   path, D < 32, it would evaluate each weight once more than the fused kernel, so inner "numba" keeps
   the one pass); sparse, the shares are split by
   sender part and each sender chunk sums the shares of the receiver chunks that name it, in ascending
   order (a part with a subset of the chunk's rows adds into those rows). Both fixed by the chunking:
   deterministic;
4. *assembly* (one task per chunk): the family's assembly again on the chunk's arrays, with a pairwise
   function that returns the chunk's precomputed (E, gA, gB, gc): the chain rule back to the state
   variables and the per-agent terms. Terms are summed over chunks in float64 in chunk order.

The per-agent stages therefore run twice (steps 1 and 4): O(N K^3) beside the O(N^2 D) pairs of a dense
term, a few per cent at N = 16 384, K = 3 (``benchmarks/bench_dask.py``). No task holds an N x N array;
a dense receiver task holds its chunk and every sender's B, a dense sender task its chunk's B and every
receiver's A, c and statistics: peak memory per task O(n D + N D), with no (N, D) share. Per-agent
stages run, with inner "numba", in the serial builds of the family's fused Numba per-agent kernels
(``numba_backend.SERIAL_OPS``: Numba's parallel builds must not be launched from the scheduler's
threads), with inner "cuda" in the cuda backend's fused device stages (Gaussian chunks given the
population's centre: ``cuda_backend.chunk_stages``), else as the family's array-generic stages. With inner
"cuda" every task's results stay on the worker's GPU (CuPy) until a task on another worker reads them.

Chunks: as the state Dataset is chunked along ``agent`` (``state.chunk(agent=n)``; the gradient Dataset
comes back chunked the same way, persisted), or ``chunks=`` (agents per chunk, or a tuple of chunk sizes)
for an in-memory state, by default :func:`default_chunk` (about TASK_WORK pair-feature products per
task, >= 100 ms on one core). Field agents (each chunk with its whole grid) run their own graph of the
same steps, :mod:`vfesim.backends.dask_fields`. Scheduler: Dask's current one: the ``dask.distributed``
client when one is the default (``Client(...)``, ``LocalCluster``), else ``dask.config``'s scheduler,
else threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import re
import sys
import threading
import uuid
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import dask
import dask.array as da
import numpy as np
import xarray as xr
from vfesim_kernels.pairwise_cpu import (
    pairwise_dense_receivers,
    pairwise_dense_rows,
    pairwise_dense_senders,
    pairwise_sparse_rows,
)

from ..arrays import array_module, host_array
from ..family import family_of
from ..state import NonFiniteError, StateError, validate_state
from . import Backend, check_outputs, gradient_dataset
from .numba_backend import NumbaUpdates
from .numba_backend import pairwise_dense as _numba_dense
from .numba_backend import pairwise_sparse as _numba_sparse
from .numpy_backend import to_device, to_host

__all__ = [
    "BACKEND",
    "DaskBackend",
    "INNER",
    "TASK_WORK",
    "AGENT_WORK",
    "default_chunk",
    "auto_chunk",
    "chunk_bounds",
    "energy_and_gradient_dataset",
]

log = logging.getLogger("vfesim")

# Kernels a task may run on its chunk ("cuda": the GPU of the worker that runs it).
INNER = ("numba", "cuda")
# Dense pair tasks on a distributed scheduler take every chunk's rows directly up to this many chunks, else
# (and in one process) one gathered copy.
DIRECT_CHUNKS = 16
# A sparse receiver chunk reads only the rows it needs of another chunk when they are at most 1 /
# TAKE_FRACTION of it (a ring's boundary rows), else the whole chunk; and only when its lists name at
# most TAKE_CHUNKS other chunks (lists with locality: each taken part is one more task per evaluation).
TAKE_FRACTION = 2
TAKE_CHUNKS = 8
# Pair-feature products (receivers x senders x D) per task that make >= 100 ms on one core: the serial
# tiled kernel runs about 1.5e9 products/s at D = 10 (2 sweeps), so 2^28 products is about 180 ms.
TASK_WORK = 1 << 28
# Stand-in cost of one agent's per-agent stages, in pair-feature products (sparse chunks are sized by it).
AGENT_WORK = 4096


def default_chunk(n_agents: int, pairs_per_agent: int, D: int) -> int:
    """Agents per chunk: about TASK_WORK units of work per task (pairs_per_agent = N - 1 dense, the list
    width k sparse; D the feature length), and never more than n_agents."""
    per_agent = pairs_per_agent * D + AGENT_WORK
    return int(min(n_agents, max(1, -(-TASK_WORK // per_agent))))


def chunk_bounds(n_agents: int, chunks: int | Sequence[int]) -> tuple[int, ...]:
    """Chunk boundaries (0, ..., n_agents) of ``chunks``: agents per chunk (the last may be smaller) or
    the chunk sizes. ValueError naming ``chunks`` for anything else."""
    if isinstance(chunks, (int, np.integer)) and not isinstance(chunks, bool):
        if chunks < 1:
            raise ValueError(f"chunks: agents per chunk must be >= 1, got {chunks}")
        sizes = [int(chunks)] * (n_agents // chunks) + ([n_agents % chunks] if n_agents % chunks else [])
    elif isinstance(chunks, Sequence) and not isinstance(chunks, str):
        sizes = list(chunks)
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 1 for s in sizes):
            raise ValueError(f"chunks: chunk sizes must be integers >= 1, got {tuple(chunks)}")
        if sum(sizes) != n_agents:
            raise ValueError(
                f"chunks: chunk sizes {tuple(sizes)} sum to {sum(sizes)}, not the {n_agents} agents"
            )
    else:
        raise ValueError(f"chunks: expected agents per chunk (int) or chunk sizes (tuple), got {chunks!r}")
    return tuple(int(b) for b in np.cumsum([0, *sizes]))


# ---- errors raised inside tasks -------------------------------------------------------------------------
class ChunkError(Exception):
    """A StateError (or NonFiniteError) raised inside a task, with the agent made global; picklable (the
    state errors' own constructors are not the one pickle calls), rebuilt on the client by :meth:`error`."""

    def __init__(self, kind: str, variable: str, message: str, agent: int | None):
        super().__init__(kind, variable, message, agent)

    @classmethod
    def wrap(cls, e: StateError, r0: int) -> ChunkError:
        where = e.variable if e.agent is None else f"{e.variable}[agent={e.agent}]"
        message = str(e)[len(where) + 2 :]
        agent = None if e.agent is None else e.agent + r0
        return cls("nonfinite" if isinstance(e, NonFiniteError) else "state", e.variable, message, agent)

    def error(self) -> StateError:
        kind, variable, message, agent = self.args
        return (NonFiniteError if kind == "nonfinite" else StateError)(variable, message, agent=agent)


_AGENT = re.compile(r"\[agent=(\d+)\]")


@dataclasses.dataclass(frozen=True)
class Recorded:
    """A warning recorded in a task (category, message), re-emitted on the client. Not a tuple: Dask
    reads a tuple whose first item is callable, inside a persisted result, as a task to run."""

    category: type
    text: str


def _shift_warning(w: warnings.WarningMessage, r0: int) -> Recorded:
    """A warning recorded in a task, agent indices made global."""
    return Recorded(w.category, _AGENT.sub(lambda m: f"[agent={int(m.group(1)) + r0}]", str(w.message)))


# warnings.catch_warnings swaps process-wide state (the filters, showwarning): two tasks in threads of one
# process (the threaded scheduler, a worker's thread pool) recording or silencing warnings at once would
# restore each other's state on exit, and a warning raised in between would be lost or land in the other
# task's list. Every task that catches warnings does it through task_warnings, under one lock.
_WARNINGS_LOCK = threading.RLock()


@contextlib.contextmanager
def task_warnings(record: bool):
    """``warnings.catch_warnings`` for a task, serialised across the process's threads: ``record=True``
    yields the list of every warning raised inside (filter "always"), ``False`` silences them."""
    with _WARNINGS_LOCK, warnings.catch_warnings(record=record) as caught:
        warnings.simplefilter("always" if record else "ignore")
        yield caught


# Tasks with inner "cuda" run one at a time per worker process: the scheduler's threads share the one GPU
# (and CuPy's default stream) anyway, and numba-cuda's first load of a kernel into the context is not safe
# from several threads at once (seen on an H100: "key already in dictionary: <CUlibrary ...>", then a
# crash). Worker processes of dask-cuda have one thread each and never wait on it.
DEVICE_LOCK = threading.RLock()


def device_task(fn):
    """``fn``, a task with an ``inner`` argument, holding :data:`DEVICE_LOCK` when inner is "cuda" (and,
    on a distributed scheduler, returning once the device has finished its work)."""
    sig = inspect.signature(fn)
    default = sig.parameters["inner"].default

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if sig.bind(*args, **kwargs).arguments.get("inner", default) != "cuda":
            return fn(*args, **kwargs)
        with DEVICE_LOCK:
            out = fn(*args, **kwargs)
            # On a distributed scheduler the task ends when its kernels do: Dask's task stream (compute,
            # transfer) and its estimates of task durations then see the GPU's time, not only the launches'.
            # (CuPy is imported wherever a task ran kernels on a GPU; not under the CUDA simulator.)
            cupy = sys.modules.get("cupy")
            if cupy is not None and _distributed():
                cupy.cuda.runtime.deviceSynchronize()
            return out

    return run


# ---- the two assembly passes ----------------------------------------------------------------------------
class _Record:
    """Pairwise functions for the features pass: record each term's rows, return zeros."""

    def __init__(self):
        self.terms: list[tuple] = []

    def dense(self, A, B, c, kappa, aggregator):
        self.terms.append((A, B, c, float(kappa), aggregator))
        return 0.0, np.zeros_like(A), np.zeros_like(B), np.zeros_like(c)

    def sparse(self, A, B, c, index, mask, kappa, aggregator):
        return self.dense(A, B, c, kappa, aggregator)


class _Replay:
    """Pairwise functions for the assembly pass: the chunk's precomputed (E, gA, gB, gc) per term, in the
    order the assembly asks for them (the order the features pass recorded)."""

    def __init__(self, results: list[tuple]):
        self.results = list(results)
        self.next = 0

    def dense(self, A, B, c, kappa, aggregator):
        E, gA, gB, gc = self.results[self.next]
        self.next += 1
        if gA.shape != A.shape or gB.shape != B.shape or gc.shape != c.shape:
            raise RuntimeError("dask backend: the assembly asked for other pairwise terms than it recorded")
        return E, gA, gB, gc

    def sparse(self, A, B, c, index, mask, kappa, aggregator):
        return self.dense(A, B, c, kappa, aggregator)


# Families whose per-agent stages use a population-wide quantity (Gaussian: the centre of the transported
# means): a module with population_sum(arrays, cfg) -> {name: array} (one chunk's sums) and
# chunk_agent_ops(means) -> the family's per-agent stages using the population means.
POPULATION = {"gaussian": "vfesim.gaussian.chunks"}


def _population_module(cfg):
    name = POPULATION.get(family_of(cfg).name)
    return None if name is None else importlib.import_module(name)


def _serial_stages(cfg, inner: str):
    """The family's per-agent stages in serial Numba kernels for inner "numba" tasks (None: the family
    has none, or inner is "cuda"; its array-generic stages run then)."""
    if inner != "numba":
        return None
    from .numba_backend import SERIAL_OPS

    return SERIAL_OPS.get(family_of(cfg).name)


@device_task
def _population_task(arrays: dict, cfg, inner: str = "numba"):
    """One chunk's population sums: on the host with the serial Numba stages, or (inner "cuda") with
    the array-generic stages on the worker's GPU. The sums only set a common shift of the features (any
    value shared by every chunk is exact), so their rounding need not match the stages the chunk's
    features run."""
    module = _population_module(cfg)
    if inner == "cuda":
        from . import cuda_backend as cb

        sums = module.population_sum(_task_arrays(arrays, cb.array_module()), cfg)
        return {k: host_array(v) for k, v in sums.items()}
    serial = _serial_stages(cfg, "numba")
    kw = {} if serial is None else {"ops": serial}
    return module.population_sum(_own(arrays), cfg, **kw)


def _population_mean(n: int, *sums):
    """Sums of every chunk, added in chunk order and divided by the number of agents."""
    return {k: sum((s[k] for s in sums[1:]), start=sums[0][k].copy()) / n for k in sums[0]}


def _chunk_backend(pairwise, cfg, population=None, inner: str = "numba") -> Backend:
    """The Backend of one chunk's assembly: pairwise kernels ``pairwise``'s (a _Record or _Replay);
    per-agent stages using the population means where the family has some (inner "numba": the serial
    Numba stages with that centre; "cuda": the cuda backend's fused stages given it,
    ``cuda_backend.CHUNK_STAGES``), else the family's stages of the inner backend. inner "numba": host
    (NumPy) arrays; "cuda": the worker's GPU (CuPy arrays; NumPy under the CUDA simulator)."""
    name = family_of(cfg).name
    serial = _serial_stages(cfg, inner)
    if population is None:
        ops = {} if serial is None else {name: serial}
    else:
        kw = {} if serial is None else {"ops": serial}
        ops = {name: _population_module(cfg).chunk_agent_ops(population, **kw)}
    xp, dev, host = (lambda: np), to_device, to_host
    if inner == "cuda":
        from . import cuda_backend as cb

        xp, dev, host = cb.array_module, cb.to_device, cb.to_host
        if population is None and name in cb.BACKEND.agent_ops:
            ops = {name: cb.BACKEND.agent_ops[name]}
        elif population is not None:  # the fused device stages with the population's centre
            ops = {name: functools.partial(cb.CHUNK_STAGES[name], population)}
    return Backend(
        agent_ops=ops,
        name="dask-chunk",
        array_module=xp,
        to_device=dev,
        to_host=host,
        pairwise_dense=pairwise.dense,
        pairwise_sparse=pairwise.sparse,
        updates=NumbaUpdates,
    )


def _own(arrays: dict) -> dict:
    """Fresh C-ordered copies of a chunk's arrays: NumPy's vectorised loops may round the last bit of an
    element differently by its memory alignment, which differs between a slice of the client's array and
    a buffer received from another process; copies make every task see the same layout."""
    return {k: np.array(v, order="C", copy=True) for k, v in arrays.items()}


def _task_arrays(arrays: dict, xp) -> dict:
    """The chunk's arrays on the array module ``xp`` of the task's code: own copies (:func:`_own`) on the
    host (NumPy); on a GPU the copy to the device is the task's own already."""
    return _own(arrays) if xp is np else {k: xp.asarray(v) for k, v in arrays.items()}


@device_task
def _features_task(arrays: dict, cfg, population, r0: int, validate: bool, inner: str = "numba"):
    """Step 1 for one chunk: ([(A, B, c, kappa, aggregator) per term], warnings). ``cfg`` has dense
    neighbours (the lists are the pair tasks' business). The features stay where ``inner`` computed
    them (inner "cuda": on the worker's GPU, as do the pair results and gB rows made from them; Dask
    moves them between workers through the host when a task needs another worker's)."""
    caught: list = []
    try:
        rec = _Record()
        backend = _chunk_backend(rec, cfg, population, inner)
        # The chunk where its kernels run, validated there (on a GPU worker: the device checks).
        arrays = _task_arrays(arrays, backend.array_module())
        if validate:
            with task_warnings(record=True) as caught:
                validate_state(arrays, cfg)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            family_of(cfg).energy_and_gradient(arrays, cfg, backend)
    except StateError as e:
        raise ChunkError.wrap(e, r0) from None
    return rec.terms, [_shift_warning(w, r0) for w in caught]


@device_task
def _assembly_task(arrays: dict, cfg, population, r0: int, feats, pairs, gB_rows, inner: str = "numba"):
    """Step 4 for one chunk: (terms, grads as host arrays, warnings). ``pairs``: this chunk's pair
    results; ``gB_rows``: per term, the float64 gB of the chunk's agents as senders."""
    results = [
        (E, gA, gB.astype(B.dtype), gc)
        for (E, gA, gc, _), gB, (_, B, *_) in zip(pairs, gB_rows, feats[0], strict=True)
    ]
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            dev = _rows_kernels(inner)[3]
            results = [(E, dev(gA), dev(gB), dev(gc)) for E, gA, gB, gc in results]
            backend = _chunk_backend(_Replay(results), cfg, population, inner)
            arrays = _task_arrays(arrays, backend.array_module())
            terms, grads = family_of(cfg).energy_and_gradient(arrays, cfg, backend)
        check_outputs({}, grads)
    except StateError as e:
        raise ChunkError.wrap(e, r0) from None
    return terms, {k: host_array(v) for k, v in grads.items()}, feats[1]


# ---- pair tasks and the gB passes -----------------------------------------------------------------------
def _rows_kernels(inner: str):
    """(dense receivers, dense senders, sparse rows, to the kernels' device, what the tasks keep of
    their results) of ``inner``: with "cuda" the results stay on the worker's GPU."""
    if inner == "cuda":
        from . import cuda_backend as cb

        xp = cb.array_module()
        return (
            cb.pairwise_dense_receivers,
            cb.pairwise_dense_senders,
            cb.pairwise_sparse_rows,
            xp.asarray,
            _identity,
        )
    k = (pairwise_dense_receivers, pairwise_dense_senders, pairwise_sparse_rows)
    return (*k, np.asarray, np.asarray)


@device_task
def _dense_receivers_task(feats, r0: int, inner: str, *senders):
    """Step 2 (pass 1), dense: per term (E, gA, gc, (m, inv_s, abar)) of the chunk's receivers against
    every sender, ``senders`` the parts of :func:`_sender_rows` in chunk order (inner "cuda": on the
    worker's GPU, as are the results)."""
    recv, _, _, dev, keep = _rows_kernels(inner)
    out = []
    for (A, _, c, kappa, agg), B in zip(feats[0], _stack(senders), strict=True):
        erow, gA, gc, *stats = (keep(x) for x in recv(dev(A), dev(c), dev(B), r0, kappa, agg))
        out.append((float(erow.sum()), gA, gc, tuple(stats)))
    return out


def _sender_rows(feats):
    """What a dense receiver task reads of a chunk as senders: per term its B rows (a view)."""
    return [B for _, B, *_ in feats[0]]


def _receiver_rows(feats, pairs):
    """What a dense sender task reads of a chunk as receivers: per term (A, c, m, inv_s, abar), its
    features and pass-1 row statistics (views)."""
    return [(A, c, *p[3]) for (A, _, c, *_), p in zip(feats[0], pairs, strict=True)]


def _gather_rows(*parts):
    """Several chunks' row parts (:func:`_sender_rows` or :func:`_receiver_rows`) as one part, the rows
    concatenated in chunk order."""
    return _stack(parts)


def _stack(parts) -> list:
    """Per term, the row blocks of ``parts`` (each per term an array or a tuple of arrays) stacked in
    chunk order."""
    out = []
    for t, first in enumerate(parts[0]):
        if isinstance(first, tuple):
            out.append(tuple(_rows([p[t][k] for p in parts]) for k in range(len(first))))
        else:
            out.append(_rows([p[t] for p in parts]))
    return out


def _rows(parts: list):
    """The row blocks ``parts`` (NumPy, or CuPy on a GPU worker) stacked in order (one block: itself,
    no copy; tasks only read it)."""
    return parts[0] if len(parts) == 1 else array_module(parts[0]).concatenate(parts)


def _dense_pairs_task(feats, r0: int, *senders):
    """Step 2, dense, one pass (inner "numba"): per term (E, gA, gc, gB share (N, D) float64) of the
    chunk's receivers against every sender (``senders``: the parts of :func:`_sender_rows` in chunk
    order), from the fused serial kernel."""
    out = []
    for (A, _, c, kappa, agg), B in zip(feats[0], _stack(senders), strict=True):
        erow, gA, gc, share = pairwise_dense_rows(A, c, B, r0, kappa, agg)
        out.append((float(erow.sum()), gA, gc, share))
    return out


def _shares(x):
    """Per term, the gB share of a one-pass pair result, or a partial sum itself."""
    return [t[3] for t in x] if x and isinstance(x[0], tuple) else x


def _add_shares(x, y):
    return [a + b for a, b in zip(_shares(x), _shares(y), strict=True)]


def _tree(items: list, combine) -> Any:
    """Pairwise sums of adjacent items, level by level, in ascending order (a fixed tree for a given
    number of items)."""
    while len(items) > 1:
        nxt = [dask.delayed(combine, pure=False)(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        items = nxt + ([items[-1]] if len(items) % 2 else [])
    return items[0]


def _dense_gB_rows(total, r0: int, r1: int):
    return [s[r0:r1] for s in _shares(total)]


@device_task
def _dense_senders_task(feats, s0: int, inner: str, *receivers):
    """Step 3 (pass 2), dense: per term the float64 gB of the chunk's agents as senders (agents s0 ..),
    from every receiver's features and row statistics (``receivers``: the parts of
    :func:`_receiver_rows` in chunk order; inner "cuda": on the worker's GPU, as is the result)."""
    _, send, _, dev, keep = _rows_kernels(inner)
    out = []
    for (_, B, _, kappa, agg), (A, c, m, inv_s, abar) in zip(feats[0], _stack(receivers), strict=True):
        args = (dev(A), dev(c), dev(m), dev(inv_s), dev(abar), dev(B))
        out.append(keep(send(*args, s0, kappa, agg)))
    return out


@device_task
def _sparse_pairs_task(feats, sender_feats, local, mask, r0: int, inner: str = "numba", key=None):
    """Step 2, sparse: per term (E, gA, gc, [gB share (n_s, D) float64 per sender part]).

    sender_feats: per sender chunk the lists name (ascending), its features or, where the plan takes a
    subset of its rows (:func:`_take_senders`), those rows' B; local (n_r, k): the senders' rows in those
    parts' B concatenated (:func:`_sparse_plan`), mask (n_r, k). key: the lists' name in the plan (inner
    "cuda": the worker's GPU keeps them, checked and transposed, under it, also when the scheduler moved a
    copy of them here)."""
    sizes = [len(f[0][0][1]) if f[0] else 0 for f in sender_feats]
    offs = np.cumsum([0, *sizes])
    _, _, rows, dev, keep = _rows_kernels(inner)
    kw = {"key": key} if inner == "cuda" else {}
    out = []
    for t, (A, _, c, kappa, agg) in enumerate(feats[0]):
        B = _rows([f[0][t][1] for f in sender_feats]) if sender_feats else A[:0]
        args = (dev(A), dev(c), dev(B), local, mask, kappa, agg)
        erow, gA, gc, share = (keep(x) for x in rows(*args, **kw))
        out.append((float(erow.sum()), gA, gc, [share[offs[s] : offs[s + 1]] for s in range(len(sizes))]))
    return out


def _take_senders(feats, rows: np.ndarray):
    """The features of a chunk's agents ``rows`` as senders (B only: what a pair task reads of them),
    in the structure of the chunk's features. Runs beside the chunk's features: only the rows travel."""
    return [
        (None, B[array_module(B).asarray(rows)], None, kappa, agg) for _, B, _, kappa, agg in feats[0]
    ], []


def _share_of(pair, s: int) -> list:
    """Per term, a sparse pair result's gB share of its sender part ``s`` (cut out beside the result: only
    the share travels to the sender chunk's worker)."""
    return [term[3][s] for term in pair]


def _sparse_gB_rows(n: int, rows: list, *shares):
    """Per term, the gB (n, D) float64 of one sender chunk of n agents from the receiver chunks that name
    it, ascending: ``shares[r]`` is (their per-term shares, None) (:func:`_share_of`) or (their pair
    result, the chunk's position among its sender parts); ``rows[r]``: the chunk's rows that share covers,
    or None for all. Summed in that order, each row's shares in the order of the receiver chunks (rows a
    receiver chunk does not name get nothing from it: exact zeros before)."""
    shares = [sh if pos is None else _share_of(sh, pos) for sh, pos in shares]
    out = []
    for t in range(len(shares[0])):
        acc = None
        for sh, r in zip(shares, rows, strict=True):
            share = sh[t]
            xp = array_module(share)
            if acc is None:
                acc = xp.zeros((n, share.shape[1]), np.float64)
            if r is None:
                acc += share
            else:
                acc[xp.asarray(r)] += share  # the rows are distinct
        out.append(acc)
    return out


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """The distinct values of ``a``, ascending (a sort and a mask: NumPy 2's ``unique`` hashes, several
    times slower on large integer arrays)."""
    a = np.sort(a)
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if a.size else a


def _sparse_plan(cfg, bounds: tuple[int, ...], wide_rows: bool = False):
    """Per receiver chunk: the sender chunks its lists name (ascending); per named chunk the rows it
    needs of it (sorted), or None where it reads the whole chunk (its own chunk, and any chunk of which it
    needs more than half: ``TAKE_FRACTION``, and every chunk when the lists name more than ``TAKE_CHUNKS``
    others); its lists as rows of those parts concatenated in that order
    (``local``, 0 under the mask; int32 when they fit, unless ``wide_rows``: int64); its mask rows. Lists
    with locality (rings, grids, windows) so read a few boundary rows of the neighbouring chunks, not
    whole chunks. Work per receiver chunk O(E log E) for its E listed edges (no array of all agents).
    Fixed by the lists and the chunking: a run computes it once (:meth:`Plan.persist`), a thread per
    chunk."""
    index, mask = np.asarray(cfg.neighbours.index), np.asarray(cfg.neighbours.mask)
    bounds_a = np.asarray(bounds)
    sizes = np.diff(bounds_a)

    def one(r0: int, r1: int):
        idx, msk = index[r0:r1].astype(np.int64), mask[r0:r1]
        own = int(np.searchsorted(bounds_a[:-1], r0, side="right")) - 1
        # Each sender's chunk (masked slots: the own chunk, whatever their index holds).
        chunk = np.where(msk, np.searchsorted(bounds_a[:-1], idx, side="right") - 1, own)
        owners = np.flatnonzero(np.bincount(chunk[msk], minlength=sizes.size))  # ascending
        if owners.size - (own in owners) <= TAKE_CHUNKS:
            named = _sorted_unique(idx[msk & (chunk != own)])  # the other chunks' rows named (global)
        else:  # lists without locality: whole chunks (a task per taken part would cost more)
            named = idx[:0, 0]
        first = np.searchsorted(named, bounds_a)  # per chunk, its first entry in ``named``
        n_named = np.diff(first)
        taken = (n_named > 0) & (n_named * TAKE_FRACTION <= sizes)
        taken[own] = False
        part = np.where(taken, n_named, sizes)  # rows of each chunk's part
        offs = np.zeros(sizes.size, np.int64)  # a named chunk's part's first row in the concatenation
        offs[owners] = np.cumsum(np.concatenate([[0], part[owners][:-1]]))
        local = np.where(msk, idx - bounds_a[chunk] + offs[chunk], 0)  # rows of whole parts
        cut = np.flatnonzero((msk & taken[chunk]).ravel())
        if cut.size:  # rows of taken parts: the position among the rows named of that chunk
            g, c = idx.ravel()[cut], chunk.ravel()[cut]
            local.ravel()[cut] = np.searchsorted(named, g) - first[c] + offs[c]
        takes = [named[first[s] : first[s + 1]] - bounds_a[s] if taken[s] else None for s in owners]
        if not wide_rows and int(part[owners].sum()) < 2**31:
            local = local.astype(np.int32)
        return [int(s) for s in owners], takes, local, msk

    with ThreadPoolExecutor(max(1, min(len(bounds) - 1, os.cpu_count() or 1))) as pool:
        return list(pool.map(one, bounds[:-1], bounds[1:]))


# ---- the graph ------------------------------------------------------------------------------------------
def _sum_terms(*results) -> tuple[dict[str, float], list]:
    """Terms summed over chunks in chunk order (float64), and every chunk's recorded warnings."""
    terms: dict[str, float] = {}
    for t, _, _ in results:
        for k, v in t.items():
            terms[k] = terms.get(k, 0.0) + float(v)
    return terms, [w for r in results for w in r[2]]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every evaluation of one population with one chunking shares: ``cfg`` with dense neighbours
    (the chunk tasks' config, one Delayed), and for sparse neighbours per receiver chunk (owners, takes,
    local, mask) of :func:`_sparse_plan` (the arrays Delayed). :func:`plan` builds one per call;
    a run persists one (:meth:`persist`) so that the lists travel to the workers once, not per step.
    ``token`` names this plan's lists (unique per plan) for the device caches of the pair tasks."""

    bounds: tuple[int, ...]
    cfg: Any
    sparse: tuple | None
    inner: str = "numba"
    token: str = ""

    def persist(self) -> Plan:
        return Plan(self.bounds, *dask.persist(self.cfg, self.sparse), self.inner, self.token)


def plan(cfg, bounds: tuple[int, ...], inner: str = "numba", workers: list | None = None) -> Plan:
    """The :class:`Plan` of ``cfg`` chunked at ``bounds`` with the kernels ``inner`` (not persisted), its
    parts beside the tasks that read them: receiver chunk j's lists on ``workers[j]``, the rows taken of
    chunk s on ``workers[s]`` (default: dealt, see :func:`chunk_workers`)."""
    if _is_field(cfg):  # the lists follow the support: computed in the graph (vfesim.backends.dask_fields)
        return Plan(tuple(bounds), dask.delayed(_identity, pure=False)(cfg), None, inner)
    chunk_cfg = cfg if cfg.dense else cfg.replace(neighbours="dense")
    cfg_d = dask.delayed(_identity, pure=False)(chunk_cfg)  # one copy in the graph
    sparse = None
    if not cfg.dense:
        w = chunk_workers(bounds) if workers is None else workers
        # int64 rows for the CPU kernels (which read them at every evaluation); the GPU copies them once.
        sparse = tuple(
            (
                owners,
                [None if t is None else at(w[s], _identity)(t) for s, t in zip(owners, takes, strict=True)],
                at(w[j], _identity)(local),
                at(w[j], _identity)(msk),
            )
            for j, (owners, takes, local, msk) in enumerate(
                _sparse_plan(cfg, bounds, wide_rows=inner != "cuda")
            )
        )
    return Plan(tuple(bounds), cfg_d, sparse, inner, uuid.uuid4().hex)


def _graph(
    chunk_arrays: list[dict],
    cfg,
    bounds: tuple[int, ...],
    validate: bool,
    pl: Plan | None = None,
    workers: list | None = None,
) -> list:
    """Delayed (terms, grads, warnings) of every chunk (steps 1-4 of the module docstring). ``pl``: a
    (persisted) :class:`Plan` of ``cfg`` and ``bounds``, else one is made. ``workers``: the worker of
    each chunk's tasks (default: :func:`chunk_workers` of the chunks' data)."""
    delayed = lambda f: dask.delayed(f, pure=False)  # noqa: E731
    if _is_field(cfg):
        from .dask_fields import field_graph

        return field_graph(chunk_arrays, cfg, bounds, validate, "numba" if pl is None else pl.inner)
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    w = chunk_workers(bounds, chunk_arrays) if workers is None else workers  # chunk j's tasks on w[j]
    pl = plan(cfg, bounds, workers=w) if pl is None else pl
    cfg_d = pl.cfg
    population = None
    if _population_module(cfg) is not None:
        sums = [at(w[j], _population_task)(a, cfg_d, pl.inner) for j, a in enumerate(chunk_arrays)]
        population = delayed(_population_mean)(bounds[-1], *sums)
    feats = [
        at(w[j], _features_task)(a, cfg_d, population, r0, validate, pl.inner)
        for j, (a, (r0, _)) in enumerate(zip(chunk_arrays, spans, strict=True))
    ]
    # On a distributed scheduler with few chunks (one per GPU, say) each dense pair task reads every
    # chunk's rows itself, and only the rows it needs (a receiver task the senders' B; a sender task the
    # receivers' A, c and row statistics): a part travels once to each worker that reads it. With many
    # chunks one gather task keeps the graph O(chunks); in one process (threads) the tasks share the one
    # gathered copy instead of each stacking its own.
    direct = len(feats) <= DIRECT_CHUNKS and _distributed()
    gather = (lambda parts: parts) if direct else (lambda parts: [delayed(_gather_rows)(*parts)])  # noqa: E731
    senders = gather([at(w[j], _sender_rows)(f) for j, f in enumerate(feats)])
    if cfg.dense and pl.inner == "numba":  # one pass: the fused CPU kernel, float64 shares in a tree
        pairs = [
            at(w[j], _dense_pairs_task)(f, r0, *senders)
            for j, (f, (r0, _)) in enumerate(zip(feats, spans, strict=True))
        ]
        total = _tree(list(pairs), _add_shares)
        gB_rows = [at(w[j], _dense_gB_rows)(total, r0, r1) for j, (r0, r1) in enumerate(spans)]
    elif cfg.dense:  # two passes (inner "cuda"): receivers, then senders from the row statistics
        pairs = [
            at(w[j], _dense_receivers_task)(f, r0, pl.inner, *senders)
            for j, (f, (r0, _)) in enumerate(zip(feats, spans, strict=True))
        ]
        receivers = gather(
            [at(w[j], _receiver_rows)(f, p) for j, (f, p) in enumerate(zip(feats, pairs, strict=True))]
        )
        gB_rows = [
            at(w[j], _dense_senders_task)(f, s0, pl.inner, *receivers)
            for j, (f, (s0, _)) in enumerate(zip(feats, spans, strict=True))
        ]
    else:
        pairs = []
        for j, (f, (owners, takes, local, msk), (r0, _)) in enumerate(
            zip(feats, pl.sparse, spans, strict=True)
        ):
            parts = [
                feats[s] if t is None else at(w[s], _take_senders)(feats[s], t)
                for s, t in zip(owners, takes, strict=True)
            ]
            pairs.append(at(w[j], _sparse_pairs_task)(f, parts, local, msk, r0, pl.inner, f"{pl.token}:{r0}"))
        gB_rows = []
        for s, (s0, s1) in enumerate(spans):
            users = [r for r, (owners, *_) in enumerate(pl.sparse) if s in owners]
            if users:
                rows, shares = [], []
                for r in users:
                    pos = pl.sparse[r][0].index(s)
                    rows.append(pl.sparse[r][1][pos])
                    # across workers only the share travels: cut out beside the pair result
                    far = w[r] is not None and w[r] != w[s]
                    shares.append((at(w[r], _share_of)(pairs[r], pos), None) if far else (pairs[r], pos))
                gB_rows.append(at(w[s], _sparse_gB_rows)(s1 - s0, rows, *shares))
            else:  # nobody lists these agents: their gB is 0
                gB_rows.append(at(w[s], _zero_rows)(feats[s]))
    return [
        at(w[j], _assembly_task)(a, cfg_d, population, r0, f, p, g, pl.inner)
        for j, (a, (r0, _), f, p, g) in enumerate(
            zip(chunk_arrays, spans, feats, pairs, gB_rows, strict=True)
        )
    ]


def _identity(x):
    return x


def _is_field(cfg) -> bool:
    return family_of(cfg).name == "field"


def _zero_rows(feats):
    return [array_module(B).zeros(B.shape) for _, B, *_ in feats[0]]


def _reraise(fn, *args):
    """fn(*args), with a task's ChunkError turned back into the StateError it stands for."""
    try:
        return fn(*args)
    except ChunkError as e:
        raise e.error() from None


def _emit(recorded: list[Recorded]) -> None:
    for r in recorded:
        warnings.warn(r.text, r.category, stacklevel=4)


def store_chunk(bounds: tuple[int, ...]) -> int:
    """Agents per Zarr chunk of a run chunked at ``bounds``: the largest size dividing every chunk
    boundary but the last (the array's end), so each Zarr chunk lies in one Dask chunk and every worker
    writes whole Zarr chunks of its own agents (the chunk size itself for regular chunkings)."""
    return int(np.gcd.reduce(np.asarray(bounds[1:-1] or bounds[-1:], np.int64)))


def describe_scheduler() -> str:
    """Dask's current scheduler in words: "distributed <address> (<n> workers)" or the local one."""
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return str(dask.config.get("scheduler", None) or "threads")
    return f"distributed {client.scheduler.address} ({len(client.scheduler_info()['workers'])} workers)"


def _log_client() -> None:
    try:
        from distributed import default_client

        client = default_client()
    except (ImportError, ValueError):
        return
    log.info("dask backend: distributed client %s (dashboard %s)", client, client.dashboard_link)


# ---- entry points ---------------------------------------------------------------------------------------
def _distributed() -> bool:
    """Whether Dask's current scheduler is a dask.distributed client's."""
    return _client() is not None


def _client():
    """The current dask.distributed client, or None."""
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None


def chunk_workers(bounds: Sequence[int], parts: Sequence | None = None, keep: Sequence | None = None) -> list:
    """Per chunk of ``bounds`` (chunk j: agents bounds[j] .. bounds[j + 1] - 1), the worker its tasks run
    on, or None (threads: no placement).

    ``keep``: an earlier placement (a run's): its chunks stay on their workers while those are alive,
    and only the chunks of departed workers move, each to the worker with the fewest agents then. A
    worker without agents (one that joined) then takes chunks from the most loaded workers, their
    last ones first, until no two workers differ by more than the largest chunk (:func:`_fill_empty`).
    A first placement is balanced the same way, so that keeping it moves nothing while no worker joins
    or leaves: ``chunk_workers(b, keep=chunk_workers(b)) == chunk_workers(b)``.

    With a distributed client, a chunk whose data ``parts[j]`` (its arrays: Futures, or Delayed blocks of
    Dask arrays) the workers already hold goes where most of it is, as long as that worker's agents stay
    within an even share (N / workers, plus half the largest chunk); the others are dealt to the workers
    (sorted by address) in contiguous runs, each filled up to that share, or go to the least loaded one.
    Chunks already where the dealt layout puts them stay (a run's chunks, placed so at its first step).
    A run's chunks therefore keep their state, features, pair results, gradient and update on one
    worker from step to step (only the rows other chunks read cross the network), and neighbouring
    chunks share a worker.
    Left to itself the scheduler ran each task where its largest input was (a chunk's neighbour lists,
    placed once where they fell) and moved state, features and pair results between workers at every
    step: about nine times a chunk's state per step in a sparse run on 4 workers
    (benchmarks/results/dask_gpu_h200x4_stop26.txt)."""
    n_chunks = len(bounds) - 1
    client = _client()
    # nthreads: every worker (scheduler_info lists at most 5 on some distributed releases)
    workers = [] if client is None else sorted(client.nthreads())
    if not workers:
        return [None] * n_chunks
    W, N = len(workers), bounds[-1]
    sizes = [bounds[j + 1] - bounds[j] for j in range(n_chunks)]
    if keep is not None and any(w in workers for w in keep):
        out = [w if w in workers else None for w in keep]
        load = {w: sum(n for n, o in zip(sizes, out, strict=True) if o == w) for w in workers}
        for j, w in enumerate(out):
            if w is None:
                out[j] = min(workers, key=lambda w: (load[w], w))
                load[out[j]] += sizes[j]
        return _fill_empty(out, sizes, load)
    share = N / W + max(sizes) / 2
    dealt, k, filled = [], 0, 0  # contiguous runs, each worker filled up to the share
    for n in sizes:
        if filled and filled + n > share and k < W - 1:
            k, filled = k + 1, 0
        dealt.append(workers[k])
        filled += n
    # at least every dealt worker's load: chunks where the dealt layout put them stay there
    cap = max(share, *(sum(n for n, d in zip(sizes, dealt, strict=True) if d == w) for w in workers))
    load = dict.fromkeys(workers, 0)
    out: list = [None] * n_chunks
    if parts is not None:
        keys = [
            [v.key for v in (p.values() if isinstance(p, dict) else [p]) if hasattr(v, "key")] for p in parts
        ]
        # Only keys this client holds can be on a worker (a step's new tasks are not): no lookup otherwise.
        mine = [k for ks in keys for k in ks if k in client.futures]
        held = client.sync(client.scheduler.who_has, keys=mine) if mine else {}
        for j, ks in enumerate(keys):
            count: dict = {}
            for k in ks:
                for w in held.get(k, ()):
                    if w in load:
                        count[w] = count.get(w, 0) + 1
            for w in sorted(count, key=lambda w: (-count[w], w)):  # most of the chunk first, then by address
                if load[w] + sizes[j] <= cap:
                    out[j] = w
                    load[w] += sizes[j]
                    break
    for j in range(n_chunks):  # the rest: dealt, or the least loaded worker when that one is full
        if out[j] is None:
            w = dealt[j] if load[dealt[j]] + sizes[j] <= cap else min(workers, key=lambda w: (load[w], w))
            out[j] = w
            load[w] += sizes[j]
    return _fill_empty(out, sizes, load)


def _fill_empty(out: list, sizes: Sequence[int], load: dict) -> list:
    """A placement ``out`` (worker per chunk; ``load``: agents per worker, every live worker) with a
    worker that holds no agents (one that joined, or one the dealing left without a chunk): move the
    last non-empty chunk of the most loaded worker to the least loaded one, as long as they differ by
    more than the largest chunk. Each move lowers the sum of squared loads, so it ends, with every
    worker within the largest chunk of the others. A placement in which every worker holds agents is
    returned as it is: a run's chunks move only when a worker joins or leaves."""
    if min(load.values()) > 0:
        return out
    biggest = max(sizes)
    while True:
        hi = max(load, key=lambda w: (load[w], w))
        lo = min(load, key=lambda w: (load[w], w))
        if load[hi] - load[lo] <= biggest:
            return out
        j = max(j for j, w in enumerate(out) if w == hi and sizes[j] > 0)
        out[j] = lo
        load[hi] -= sizes[j]
        load[lo] += sizes[j]


def graph_workers(
    cfg, bounds: Sequence[int], parts: Sequence | None = None, keep: Sequence | None = None
) -> list:
    """:func:`chunk_workers` for ``cfg``'s evaluation graph: none for field agents (their graph,
    :func:`vfesim.backends.dask_fields.field_graph`, places nothing)."""
    return [None] * (len(bounds) - 1) if _is_field(cfg) else chunk_workers(bounds, parts, keep)


def at(worker, f):
    """``dask.delayed(f, pure=False)`` whose tasks prefer ``worker`` (None: anywhere). The restriction is
    loose (``allow_other_workers``): when that worker is gone the tasks run elsewhere, and Dask's work
    stealing may still move a task to an idle worker (its inputs travel then)."""
    d = dask.delayed(f, pure=False)
    if worker is None:
        return d

    @functools.wraps(f)
    def call(*args, **kwargs):
        with dask.annotate(workers=[worker], allow_other_workers=True):
            return d(*args, **kwargs)

    return call


def _workers_have_gpus() -> bool:
    """Whether the scheduler's workers see a CUDA GPU (the distributed client's workers, asked; else
    this process, whose threads run the tasks)."""
    from . import cuda_available

    client = _client()
    return cuda_available() if client is None else all(client.run(cuda_available).values())


def resolve_inner(inner: str | None) -> str:
    """``inner``, checked; None: "cuda" when the workers have GPUs, else "numba". ValueError naming
    ``inner`` for an unknown name."""
    if inner is None:
        return "cuda" if _workers_have_gpus() else "numba"
    if inner not in INNER:
        raise ValueError(f"inner: unknown {inner!r}; choose one of {INNER}")
    return inner


def auto_chunk(cfg, n_agents: int, arrays: dict) -> int:
    """The default agents per chunk of a population: :func:`default_chunk` with the feature length D of
    the family (read off a one-agent evaluation) and dense or sparse pair counts."""
    family = family_of(cfg)
    if _is_field(cfg):
        from .dask_fields import field_chunk

        return field_chunk(cfg, n_agents, arrays, TASK_WORK, AGENT_WORK)
    probe = {k: np.asarray(v[:1]) for k, v in arrays.items()}
    rec = _Record()
    with np.errstate(all="ignore"), task_warnings(record=False):
        chunk_cfg = cfg if cfg.dense else cfg.replace(neighbours="dense")
        family.energy_and_gradient(probe, chunk_cfg, _chunk_backend(rec, chunk_cfg))
    D = max((t[0].shape[1] for t in rec.terms), default=1)
    pairs = n_agents - 1 if cfg.dense else cfg.neighbours.index.shape[1]
    return default_chunk(n_agents, pairs, D)


def _check_neighbours(cfg, n: int) -> None:
    if not cfg.dense and cfg.neighbours.n_agents != n:
        raise StateError(
            "agent",
            f"config has sparse neighbours for {cfg.neighbours.n_agents} agents but the state has {n}",
        )


def energy_and_gradient_arrays(
    arrays: dict[str, Any], cfg, *, chunks: int | Sequence[int] | None = None, inner: str | None = None
) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Terms and gradient of in-memory (NumPy) arrays, computed chunk by chunk on Dask's current
    scheduler (no validation; results gathered as NumPy arrays)."""
    inner = resolve_inner(inner)
    first = next(iter(arrays.values()))
    n = int(first.shape[0])
    _check_neighbours(cfg, n)
    bounds = chunk_bounds(n, auto_chunk(cfg, n, arrays) if chunks is None else chunks)
    spans = list(zip(bounds[:-1], bounds[1:], strict=True))
    chunk_arrays = [{k: np.ascontiguousarray(v[r0:r1]) for k, v in arrays.items()} for r0, r1 in spans]
    w = graph_workers(cfg, bounds)  # dealt (None: threads, or field agents)
    if (client := _client()) is not None and w[0] is not None:
        # Each chunk to its worker first (scattered data, not recomputed should a worker die mid-call):
        # chunks inside the graph all started on one worker, their tasks having no inputs to place them,
        # and work stealing spread them only after a while (2 processes, N = 16 384: 1.8 -> 1.0 s).
        for worker in dict.fromkeys(w):
            js = [j for j, d in enumerate(w) if d == worker]
            sent = client.scatter([chunk_arrays[j] for j in js], workers=[worker], hash=False)
            for j, f in zip(js, sent, strict=True):
                chunk_arrays[j] = f
    _log_client()
    (results,) = _reraise(
        dask.compute, _graph(chunk_arrays, cfg, bounds, False, plan(cfg, bounds, inner, w), w)
    )
    terms, recorded = _sum_terms(*results)
    _emit(recorded)
    grads = {k: np.concatenate([r[1][k] for r in results]) for k in results[0][1]}
    return terms, grads


def energy_and_gradient_dataset(
    state: xr.Dataset,
    cfg,
    *,
    validate: bool = True,
    chunks: int | Sequence[int] | None = None,
    inner: str | None = None,
) -> tuple[dict[str, float], xr.Dataset]:
    """:func:`vfesim.energy_and_gradient` on the dask backend.

    An in-memory state is validated on the client (as on every backend), split into ``chunks`` (agents
    per chunk or chunk sizes; default :func:`default_chunk`) and the gradient returned as NumPy arrays. A
    Dask-backed state (``state.chunk(agent=n)``) is validated chunk by chunk inside the tasks (errors and
    warnings name global agents) and the gradient comes back as Dask arrays persisted with the state's
    agent chunks (``chunks=`` rechunks it first). inner: the kernels of a task ("numba").
    """
    inner = resolve_inner(inner)
    family = family_of(cfg)
    lazy = any(isinstance(state[k].data, da.Array) for k in state.data_vars)
    if not lazy:
        if validate:
            validate_state(state, cfg)
        arrays = {k: state[k].data for k in state.data_vars}
        terms, grads = energy_and_gradient_arrays(arrays, cfg, chunks=chunks, inner=inner)
        check_outputs(terms, {})
        return terms, gradient_dataset(state, grads)

    n = state.sizes["agent"]
    for k in state.data_vars:
        if k in family.variables and state[k].dims != family.variables[k]:
            raise StateError(k, f"dims must be {family.variables[k]}, got {state[k].dims}")
    _check_neighbours(cfg, n)
    if chunks is None:
        chunks = state[next(iter(state.data_vars))].chunksizes.get("agent", (n,))
    bounds = chunk_bounds(n, chunks)
    state = rechunk(state, bounds)
    arrays = {k: state[k].data for k in state.data_vars}
    w = graph_workers(cfg, bounds, blocks(arrays))
    summary, grads = lazy_energy(arrays, cfg, bounds, validate, plan(cfg, bounds, inner, w), w)
    _log_client()
    summary, grads = _reraise(dask.persist, summary, grads)
    terms = finish_terms(_reraise(summary.compute))
    return terms, gradient_dataset(state, grads)


def rechunk(state: xr.Dataset, bounds: tuple[int, ...]) -> xr.Dataset:
    """``state`` as Dask arrays with agent chunks at ``bounds`` and one chunk along every other dim."""
    sizes = tuple(np.diff(bounds).tolist())
    return state.chunk({d: (sizes if d == "agent" else -1) for d in state.dims})


def blocks(arrays: dict[str, da.Array]) -> list[dict[str, Any]]:
    """Per agent chunk, {name: the chunk's Delayed block} of agent-chunked Dask arrays (first axis)."""
    d = {k: v.to_delayed(optimize_graph=False).reshape(-1) for k, v in arrays.items()}
    n = len(next(iter(d.values())))
    return [{k: d[k][i] for k in d} for i in range(n)]


def from_blocks(parts: list, key, like: dict[str, da.Array], sizes) -> dict[str, da.Array]:
    """Dask arrays shaped like ``like`` (agent chunks ``sizes``) from per-chunk Delayed results:
    chunk i of array k is ``parts[i][key][k]`` (``key`` None: ``parts[i][k]``)."""
    out = {}
    for k, v in like.items():
        pieces = [
            da.from_delayed(
                dask.delayed(_pick_item, pure=False)(p, key, k),
                shape=(size, *v.shape[1:]),
                dtype=v.dtype,
                meta=np.empty((0,) * v.ndim, v.dtype),
            )
            for p, size in zip(parts, sizes, strict=True)
        ]
        out[k] = da.concatenate(pieces, axis=0)
    return out


def _pick_item(result, key, name):
    return result[name] if key is None else result[key][name]


def lazy_energy(
    arrays: dict[str, da.Array],
    cfg,
    bounds: tuple[int, ...],
    validate: bool,
    pl: Plan | None = None,
    workers: list | None = None,
) -> tuple[Any, dict[str, da.Array]]:
    """(summary, grads) of agent-chunked Dask arrays (chunks at ``bounds``), not computed: ``summary``
    a Delayed of (terms, recorded warnings) (:func:`finish_terms` reports them), ``grads`` Dask arrays
    chunked like ``arrays`` for every floating variable. ``validate``: each chunk is validated in its
    task (errors name global agents). ``workers``: each chunk's worker (default :func:`chunk_workers`)."""
    sizes = tuple(np.diff(bounds).tolist())
    summary, parts = chunk_energy(blocks(arrays), cfg, bounds, validate, pl, workers)
    floats = {k: v for k, v in arrays.items() if np.issubdtype(v.dtype, np.inexact)}
    return summary, from_blocks(parts, None, floats, sizes)


def chunk_energy(
    parts: list,
    cfg,
    bounds: tuple[int, ...],
    validate: bool,
    pl: Plan | None = None,
    workers: list | None = None,
) -> tuple[Any, list]:
    """(summary, per-chunk gradients) of per-chunk state arrays ``parts`` (each a dict of arrays or a
    Delayed of one), not computed: ``summary`` a Delayed of (terms, recorded warnings), the gradients a
    Delayed dict per chunk. The graph of :func:`lazy_energy` without Dask arrays around it (cheaper to
    build inside a run's step)."""
    w = graph_workers(cfg, bounds, parts) if workers is None else workers
    results = _graph(parts, cfg, bounds, validate, pl, w)
    grads = [at(w[j], _pick_grads)(r) for j, r in enumerate(results)]
    terms = [at(w[j], _terms_of)(r) for j, r in enumerate(results)]  # not the chunks' gradients
    return dask.delayed(_sum_terms, pure=False)(*terms), grads


def _pick_grads(result):
    return result[1]


def _terms_of(result):
    """An assembly result without its gradients (what the terms' sum reads)."""
    return result[0], None, result[2]


def finish_terms(summary) -> dict[str, float]:
    """The terms of a computed summary, its warnings emitted; non-finite terms raise NonFiniteError."""
    terms, recorded = summary
    _emit(recorded)
    check_outputs(terms, {})
    return terms


@dataclasses.dataclass(frozen=True)
class DaskBackend(Backend):
    """The dask :class:`Backend`: raw arrays are evaluated chunk by chunk (:func:`energy_and_gradient_arrays`
    with ``chunks``, default :func:`default_chunk`, and ``inner``), so integrators step on it like on any
    host backend; ``dataclasses.replace(BACKEND, chunks=n)`` fixes the chunking of a run."""

    chunks: Any = None
    inner: str | None = None
    # Integrators keep the state chunked on the workers (vfesim.integrators.chunked).
    chunked: ClassVar[bool] = True

    def energy_and_gradient(self, arrays: dict[str, Any], cfg) -> tuple[dict[str, float], dict[str, Any]]:
        return energy_and_gradient_arrays(arrays, cfg, chunks=self.chunks, inner=self.inner)


BACKEND = DaskBackend(
    name="dask",
    array_module=lambda: np,
    to_device=to_device,
    to_host=to_host,
    pairwise_dense=_numba_dense,
    pairwise_sparse=_numba_sparse,
    updates=NumbaUpdates,
    dataset_energy_and_gradient=energy_and_gradient_dataset,
)
