"""The Born loss of rollouts (rule R7, spec/quantum.md §4): the observed outcomes on the state's device and
the terms -log <y_i| x_i |y_i> of the observed agents' floored states x = (1 - e) rho + e I/d, with their
cotangents.

Two implementations of one contract, :class:`BornOps`: the array code (:data:`ARRAY_BORN`, any array
module: a gather, a log and a sum per step forward, a gather and a scatter back) and a backend's kernels
(``QuantumOps.born``: :func:`vfesim.quantum.kernel_ops.kernel_born`, one launch per step each way), which
add each step's log-probabilities into one float64 accumulator per observed entry and sum it once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..arrays import array_module as _xp
from ..arrays import memory_flat
from ..config import ConfigError
from .energy import floor_eps

__all__ = [
    "Observations",
    "observed_outcomes",
    "own_outcomes",
    "is_own_outcomes",
    "born_prob",
    "born_logp",
    "born_add",
    "BornOps",
    "ARRAY_BORN",
]


class Observations:
    """The observed outcomes of a rollout (rule R7) on the state's device: step t's observed agents
    (y_ti >= 0) and outcomes (``self[t]``: a pair of int64 index arrays, or None where no agent is
    observed), and the places of their entries x_i[y_i, y_i] in a state's memory (:meth:`entries`).
    The outcomes travel once, in the narrowest integer type that holds them; a step observing every agent
    takes its row of one offsets table per memory layout (made once, one operation for all steps), so a
    step's gather or scatter is one operation on a flat view instead of an index triple."""

    def __init__(self, outcomes, d: int, xp):
        y = np.asarray(outcomes)
        if int(y.max(initial=-1)) >= d:
            t, i = np.argwhere(y >= d)[0]
            raise ConfigError(
                "outcomes", f"agent {i} has outcome {int(y[t, i])} at step {t}, outside [0, {d})"
            )
        self.xp, self.n = xp, y.shape[1]
        lo = int(y.min(initial=0))
        counts = (y >= 0).sum(axis=1) if lo < 0 else np.full(y.shape[0], self.n)
        narrow = np.promote_types(np.min_scalar_type(min(lo, -d)), np.int8)  # holds every outcome
        self.Y = xp.asarray(y.astype(narrow))  # a copy: kept observations must not hold their outcomes
        self.full = counts == self.n
        everyone = xp.arange(self.n, dtype=np.int64) if self.full.any() else None
        self.steps = []
        for t, n_seen in enumerate(counts.tolist()):
            if n_seen == 0:
                self.steps.append(None)
            elif n_seen == self.n:
                self.steps.append((everyone, None))  # outcomes: self.Y[t], widened when asked for
            else:
                obs = np.flatnonzero(y[t] >= 0)
                self.steps.append((xp.asarray(obs), xp.asarray(y[t, obs].astype(np.int64))))
        self.offsets: dict = {}  # memory layout -> per step offsets (entries)

    def __getitem__(self, t: int):
        step = self.steps[t]
        if step is None or step[1] is not None:
            return step
        return step[0], self.Y[t].astype(np.int64)

    def entries(self, a, t: int):
        """(flat, offsets): the entries a[i, y_i, y_i] of step t's observed agents as ``flat[offsets]``,
        flat a 1-D view of ``a`` (:func:`vfesim.arrays.memory_flat`); None where ``a`` is not one dense
        block. The offsets of every step are made once per memory layout (:meth:`_offsets`)."""
        mf = memory_flat(a)
        if mf is None:
            return None
        flat, (s0, s1, s2) = mf
        idx = np.int64 if flat.size > _INT32_MAX else np.int32
        key = (s0, s1 + s2, idx)
        offsets = self.offsets.get(key)
        if offsets is None:
            offsets = self.offsets[key] = self._offsets(s0, s1 + s2, idx)
        return flat, offsets[t]

    def _offsets(self, s0: int, s12: int, idx) -> list:
        """Per step, the offsets y_i (s1 + s2) + i s0 of its observed entries in a layout of strides (s0, s1,
        s2) (entries), or None (no agent observed): a step observing everyone a row of one table."""
        xp = self.xp
        table = None
        if self.full.any():
            table = self.Y.astype(idx) * idx(s12) + xp.arange(0, self.n * s0, s0, dtype=idx)
        out = []
        for t, step in enumerate(self.steps):
            if step is None:
                out.append(None)
            elif self.full[t]:
                out.append(table[t])
            else:
                oo, yy = step
                out.append((yy * s12 + oo * s0).astype(idx))
        return out


_INT32_MAX = np.iinfo(np.int32).max

# The schedules' own read-only copies of outcomes (id -> array, while some schedule holds it): a schedule
# made from another's outcomes (a fitting loop's) shares the copy, and rollouts keep its observations.
_OWN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def own_outcomes(y: np.ndarray) -> np.ndarray:
    """``y`` (a NumPy array the caller made or checked) made read-only and registered as a schedule's own
    copy of outcomes (:func:`is_own_outcomes`)."""
    y.setflags(write=False)
    _OWN[id(y)] = y
    return y


def is_own_outcomes(y) -> bool:
    """Whether ``y`` is a schedule's own read-only copy of outcomes (:func:`own_outcomes`; not a copy of
    one, such as a deep copy or an unpickled schedule's, and not made writable since)."""
    return _OWN.get(id(y)) is y and not y.flags.writeable


# (id of a schedule's outcomes, d, module, device) -> (a weak reference to the outcomes, their Observations):
# repeated rollouts of one schedule (a benchmark, a fitting loop: its schedules share the outcomes) check
# and move the outcomes once. An entry goes with its outcomes (so an id is never reused), the oldest past
# a few.
_OBSERVED: dict = {}
_OBSERVED_MAX = 4


def observed_outcomes(outcomes, d: int, xp, keep: bool = False) -> Observations:
    """The observations of a rollout on the state's device (:class:`Observations`). ``keep``: kept for the
    next call with the same array when ``outcomes`` is a :class:`~vfesim.quantum.rollout.Schedule`'s own
    read-only copy (:func:`own_outcomes`); made anew for any other array."""
    if not keep or not is_own_outcomes(outcomes):
        return Observations(outcomes, d, xp)
    cuda = getattr(xp, "cuda", None)
    key = (id(outcomes), d, xp.__name__, cuda.runtime.getDevice() if cuda is not None else -1)
    hit = _OBSERVED.get(key)
    if hit is None or hit[0]() is not outcomes:
        while len(_OBSERVED) >= _OBSERVED_MAX:
            _OBSERVED.pop(next(iter(_OBSERVED), None), None)
        hit = _OBSERVED[key] = (weakref.ref(outcomes), Observations(outcomes, d, xp))
        weakref.finalize(outcomes, _OBSERVED.pop, key, None)
    return hit[1]


def born_prob(rho, observed, t):
    """(x_i[y_i, y_i] of step t's observed agents (``observed``: :class:`Observations`), 1 - floor), x the
    floored state."""
    e = floor_eps(rho.dtype)
    entries = observed.entries(rho, t)
    if entries is None:
        oo, yy = observed[t]
        diag = rho[oo, yy, yy]
    else:
        diag = _xp(rho).take(*entries)
    return diag.real * (1.0 - e) + e / rho.shape[-1], 1.0 - e


def born_logp(rho, observed, t):
    """sum_i log x_i[y_i, y_i] over step t's observed agents (``observed``: :class:`Observations`; none:
    0.0): a float64 scalar of the state's array module (no transfer)."""
    if observed.steps[t] is None:
        return 0.0
    return _xp(rho).log(born_prob(rho, observed, t)[0]).sum(dtype=np.float64)


def born_add(bar, rho, observed, t, weight: float):
    """bar += the cotangent of weight sum_i -log x_i[y_i, y_i] over step t's observed agents (rule R7), in
    place (one entry per observed agent) -> bar."""
    if observed.steps[t] is not None and weight != 0:
        prob, scale = born_prob(rho, observed, t)
        entries = observed.entries(bar, t)
        if entries is None:
            oo, yy = observed[t]
            bar[oo, yy, yy] += (-weight * scale) / prob
        else:
            flat, offsets = entries
            flat[offsets] += (-weight * scale) / prob  # distinct agents: distinct entries
    return bar


class BornOps(NamedTuple):
    """The Born terms of a rollout: ``acc = start(xp, n)`` an accumulator for n agents; ``acc =
    logp(acc, rho, observed, t)`` adds step t's sum_i log x_i[y_i, y_i] (``observed``:
    :class:`Observations`); ``total(acc)`` the sum so far (a float: one transfer); ``bar = add(bar, rho,
    observed, t, weight)`` adds the cotangent of weight sum_i -log x_i[y_i, y_i] into ``bar`` in place."""

    start: Callable
    logp: Callable
    total: Callable
    add: Callable


ARRAY_BORN = BornOps(
    start=lambda xp, n: 0.0,
    logp=lambda acc, rho, observed, t: acc + born_logp(rho, observed, t),  # summed on the device
    total=float,
    add=born_add,
)
