"""Field agents on the dask backend: the agent axis in chunks, each chunk with its whole grid.

The field assembly (:func:`vfesim.fields.energy.energy_and_gradient_arrays`) calls the weighted pairs
batched over grid points once per alignment term, with the covered (point, agent) rows of its agents;
every pairwise interaction goes through those rows, so an evaluation splits into tasks over agent
chunks as for point agents (:mod:`.dask_backend`):

0. *lists* (one task): the neighbour lists of the whole support (the overlap rule needs every agent);
   *centre* (one task per chunk, one sum): the mean of nu = R^T mu over all covered rows, the common
   shift of the features (:mod:`vfesim.gaussian.chunks`);
1. *features* (one task per chunk): the assembly on the chunk's arrays, its pairs recorded (receiver
   rows A, c, chi, the layout, senders' B) and answered with zeros;
2. *pairs* (one task per receiver chunk): the chunk's receivers against the sender rows it needs, those
   of the agents its lists name at the points its receivers cover, gathered from every chunk, in the
   serial kernels (``inner`` "numba"; "cuda": the worker's GPU): the receivers' E, gA, gc, gu and, per
   sender chunk, the gathered rows' share of gB and gv (float64);
3. *sender sums* (one task per chunk): the shares of its rows from every receiver chunk, added in
   ascending order (fixed by the chunking: deterministic);
4. *assembly* (one task per chunk): the assembly again, its pairs answered with the precomputed
   results: the chain rule back to the state variables, and the per-agent terms.

The per-agent stages run twice (steps 1 and 4), as the array-generic NumPy stages with the common
centre. No task holds an N x N x P array: a pair task holds its chunk's rows, the gathered sender rows
(at most every covered row) and a (P, N) row map.
"""

from __future__ import annotations

from functools import partial

import dask
import numpy as np

from ..arrays import host_array
from ..fields.energy import energy_and_gradient_arrays as field_energy
from ..fields.supports import neighbour_lists
from ..gaussian.chunks import chunk_agent_ops
from ..gaussian.energy import NUMPY_AGENT_OPS
from ..gaussian.features import feature_dim
from ..state import StateError
from . import check_outputs
from .dask_backend import device_task

__all__ = ["field_graph", "field_chunk"]


def field_chunk(cfg, n_agents: int, arrays: dict, task_work: int, agent_work: int) -> int:
    """Agents per chunk of a field population: about ``task_work`` pair-feature products per task, an
    agent's work being its covered points times (its pairs per point D + ``agent_work``)."""
    chi = np.asarray(arrays["support"]).reshape(n_agents, -1) > 0
    rows = max(1.0, chi.sum() / n_agents)
    pairs = max(0.0, float(chi.sum(axis=0).mean()) - 1.0) if chi.size else 0.0
    per_agent = rows * (pairs * feature_dim(cfg.K) + agent_work)
    return int(min(n_agents, max(1, -(-task_work // int(per_agent)))))


def _task_cfg(cfg):
    """The config of a chunk's own checks: explicit lists name every agent, a chunk holds some."""
    return cfg if cfg.dense else cfg.replace(neighbours="overlap")


# ---- step 0 ---------------------------------------------------------------------------------------------
def _lists_task(cfg, *supports):
    return neighbour_lists(np.concatenate([np.asarray(s) for s in supports]), cfg)


def _rows_of(arrays: dict, key: str):
    """(M, *tail) covered rows of one variable (agent-major)."""
    chi = arrays["support"]
    n = chi.shape[0]
    cov = chi.reshape(n, -1) > 0
    agent, point = np.nonzero(cov)
    a = arrays[key]
    return a.reshape(n, cov.shape[1], *a.shape[chi.ndim :])[agent, point]


def _centre_sum_task(arrays: dict, cfg):
    """Per mean variable, the sum over the chunk's covered rows of nu = R^T mu (float64), and the rows."""
    R = NUMPY_AGENT_OPS.frames(_rows_of(arrays, "phi"), cfg.irreps)
    out = {k: np.einsum("nkl,nk->l", R, _rows_of(arrays, k)).astype(np.float64) for k in ("mu_q", "mu_p")}
    return out, int(R.shape[0])


def _centre(*sums):
    """The population mean of nu over every covered row: chunk sums added in chunk order."""
    rows = sum(s[1] for s in sums)
    return {
        k: sum((s[0][k] for s in sums[1:]), start=sums[0][0][k].copy()) / max(1, rows) for k in sums[0][0]
    }


# ---- steps 1 and 4: the assembly with recorded / replayed pairs ----------------------------------------
class _Record:
    def __init__(self):
        self.terms: list[dict] = []

    def __call__(self, A, B, c, u, v, offsets, lists, rowmap, index, mask, kappa, aggregator):
        self.terms.append(dict(A=A, B=B, c=c, u=u, offsets=offsets, lists=lists, index=index, mask=mask,
                               kappa=float(kappa), aggregator=aggregator))  # fmt: skip
        z = np.zeros_like
        return 0.0, z(A), z(B), z(c), z(u), z(v)


class _Replay:
    def __init__(self, results: list[tuple]):
        self.results = list(results)

    def __call__(self, A, B, c, u, v, offsets, lists, rowmap, index, mask, kappa, aggregator):
        out = self.results.pop(0)
        if out[1].shape != A.shape or out[2].shape != B.shape:
            raise RuntimeError("dask backend: the field assembly asked for other pairs than it recorded")
        return out


def _own(arrays: dict) -> dict:
    return {k: np.array(v, order="C", copy=True) for k, v in arrays.items()}


def _assembly(arrays, cfg, centres, lists, r0: int, pairs):
    r1 = r0 + arrays["mu_q"].shape[0]
    index, mask = lists
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return field_energy(
            arrays,
            cfg,
            agent_ops=chunk_agent_ops(centres),
            neighbours=(index[r0:r1], mask[r0:r1]),
            pairwise_points=pairs,
        )


def _features_task(arrays, cfg, centres, lists, r0: int, validate: bool):
    """Step 1: ([per term: the recorded rows], recorded warnings)."""
    from .dask_backend import ChunkError, _shift_warning, task_warnings

    arrays = _own(arrays)
    caught: list = []
    try:
        if validate:
            from ..fields.state import validate_state

            with task_warnings(record=True) as caught:
                validate_state(arrays, _task_cfg(cfg))
        rec = _Record()
        _assembly(arrays, cfg, centres, lists, r0, rec)
    except StateError as e:
        raise ChunkError.wrap(e, r0) from None
    for t in rec.terms:
        t["point"] = np.repeat(np.arange(t["offsets"].size - 1), np.diff(t["offsets"]))
        t["agent"] = r0 + np.asarray(t["lists"])
    return rec.terms, [_shift_warning(w, r0) for w in caught]


def _assembly_task(arrays, cfg, centres, lists, r0: int, pairs, sender_sums, feats):
    """Step 4: (terms, grads, warnings) of the chunk."""
    from .dask_backend import ChunkError

    arrays = _own(arrays)
    results = []
    for (E, gA, gc, gu, _), (gB, gv), t in zip(pairs, sender_sums, feats[0], strict=True):
        dt = t["B"].dtype
        results.append((E, gA, gB.astype(dt), gc, gu, gv.astype(dt)))
    try:
        terms, grads = _assembly(arrays, cfg, centres, lists, r0, _Replay(results))
        check_outputs({}, grads)
    except StateError as e:
        raise ChunkError.wrap(e, r0) from None
    return terms, grads, feats[1]


# ---- steps 2 and 3 --------------------------------------------------------------------------------------
def _points_kernel(inner: str):
    """The batched weighted pairs of a task: numba's serial kernel, or the cuda backend's (host in, host
    out)."""
    if inner == "cuda":
        from . import cuda_backend as cb

        xp = cb.array_module()

        def run(A, B, c, u, v, *layout_and_rest):
            out = cb._pairwise_points(xp.asarray(A), xp.asarray(B), xp.asarray(c), xp.asarray(u),
                                      xp.asarray(v), *layout_and_rest)  # fmt: skip
            return (out[0],) + tuple(host_array(a) for a in out[1:])

        return run
    from vfesim_kernels.pairwise_cpu import pairwise_points

    return partial(pairwise_points, serial=True)


@device_task
def _pairs_task(feats, n_agents: int, inner: str, *all_feats):
    """Step 2 for one receiver chunk: per term (E, gA, gc, gu, [per sender chunk: (rows, gB share, gv
    share)]), the shares float64 over the gathered rows of that chunk."""
    kernel = _points_kernel(inner)
    out = []
    for t, recv in enumerate(feats[0]):
        P = recv["offsets"].size - 1
        here = np.zeros(P, bool)
        here[recv["point"]] = True  # points the receivers cover
        named = np.zeros(n_agents, bool)
        named[recv["index"][recv["mask"]]] = True  # agents the receivers list
        sel = []
        for f in all_feats:
            s = f[0][t]
            sel.append(np.flatnonzero(here[s["point"]] & named[s["agent"]]))
        B = np.concatenate([f[0][t]["B"][r] for f, r in zip(all_feats, sel, strict=True)])
        v = np.concatenate([f[0][t]["u"][r] for f, r in zip(all_feats, sel, strict=True)])
        pts = np.concatenate([f[0][t]["point"][r] for f, r in zip(all_feats, sel, strict=True)])
        ags = np.concatenate([f[0][t]["agent"][r] for f, r in zip(all_feats, sel, strict=True)])
        rowmap = np.full((P, n_agents), -1, np.int64)
        rowmap[pts, ags] = np.arange(pts.size)
        E, gA, gB, gc, gu, gv = kernel(
            recv["A"], B, recv["c"], recv["u"], v, recv["offsets"], recv["lists"], rowmap,
            recv["index"], recv["mask"], recv["kappa"], recv["aggregator"],
        )  # fmt: skip
        offs = np.cumsum([0] + [r.size for r in sel])
        shares = [
            (r, gB[a:b].astype(np.float64), gv[a:b].astype(np.float64))
            for r, a, b in zip(sel, offs[:-1], offs[1:], strict=True)
        ]
        out.append((E, gA, gc, gu, shares))
    return out


def _sender_sums_task(s: int, feats, *pairs):
    """Step 3 for sender chunk s: per term (gB (M_s, D), gv (M_s,)) float64, the shares of the receiver
    chunks added in ascending order."""
    out = []
    for t, f in enumerate(feats[0]):
        gB = np.zeros(f["B"].shape)
        gv = np.zeros(f["u"].shape)
        for p in pairs:
            rows, sb, sv = p[t][4][s]
            gB[rows] += sb
            gv[rows] += sv
        out.append((gB, gv))
    return out


# ---- the graph ------------------------------------------------------------------------------------------
def field_graph(
    chunk_arrays: list, cfg, bounds: tuple[int, ...], validate: bool, inner: str = "numba"
) -> list:
    """Delayed (terms, grads, warnings) of every chunk (steps 0-4 of the module docstring)."""
    from .dask_backend import _identity

    delayed = lambda f: dask.delayed(f, pure=False)  # noqa: E731
    cfg_d = delayed(_identity)(cfg)
    n = bounds[-1]
    starts = bounds[:-1]
    lists = delayed(_lists_task)(cfg_d, *(a["support"] for a in chunk_arrays))
    centres = delayed(_centre)(*(delayed(_centre_sum_task)(a, cfg_d) for a in chunk_arrays))
    feats = [
        delayed(_features_task)(a, cfg_d, centres, lists, r0, validate)
        for a, r0 in zip(chunk_arrays, starts, strict=True)
    ]
    pairs = [delayed(_pairs_task)(f, n, inner, *feats) for f in feats]
    sums = [delayed(_sender_sums_task)(s, f, *pairs) for s, f in enumerate(feats)]
    return [
        delayed(_assembly_task)(a, cfg_d, centres, lists, r0, p, sm, f)
        for a, r0, p, sm, f in zip(chunk_arrays, starts, pairs, sums, feats, strict=True)
    ]
