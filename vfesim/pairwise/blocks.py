"""Block API of the pairwise layer: one receiver block against one sender block (SPEC §2.4).

For a scheduler task (Dask, or any loop over blocks) that holds a block of receivers and streams over
blocks of senders. Features as everywhere in :mod:`vfesim.pairwise`: ``KL_ij = 1/2 (A_i . B_j + c_i)``,
logits ``x_ij = -KL_ij / kappa``. Receivers ``r0 .. r0 + n_r - 1`` and senders ``s0 .. s0 + n_s - 1`` are
global agent indices, so the pair ``i == j`` is excluded wherever the blocks overlap::

    stats = empty_stats(n_r, dtype)
    for s0, B_s in sender blocks:                        # any order: merge_stats is exact up to rounding
        stats = merge_stats(stats, block_stats(A_r, c_r, B_s, kappa, r0, s0))
    rows = finish_rows(stats, kappa, aggregator)         # energy, 1/s and abar per receiver
    for s0, B_s in sender blocks:
        gA_r, gc_r, gB_s = block_grads(A_r, c_r, B_s, rows, kappa, aggregator, r0, s0)
        # gA_r, gc_r: this block's part of the receiver cotangents (add over sender blocks);
        # gB_s: this receiver block's part of the sender cotangents (add over receiver blocks)

Peak memory of one call is O(n_r * n_s) (one KL tile). :func:`pairwise_blocked` runs the loops above in
a fixed order (ascending blocks), the pattern a distributed task follows; its results equal
:func:`vfesim.pairwise.reference.pairwise_dense` to rounding for every block size. NumPy arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..arrays import total
from .reference import aggregator_check

__all__ = [
    "RowStats",
    "RowSummary",
    "empty_stats",
    "block_stats",
    "merge_stats",
    "finish_rows",
    "block_grads",
    "pairwise_blocked",
]


class RowStats(NamedTuple):
    """Online log-sum-exp statistics per receiver: max logit m, s = sum e^(x - m), t = sum e^(x - m) KL.
    A receiver with no pair yet has m = -inf, s = t = 0."""

    m: np.ndarray
    s: np.ndarray
    t: np.ndarray


class RowSummary(NamedTuple):
    """Per receiver: aggregated energy, m, 1/s (0 for no pair) and the attention-weighted mean KL."""

    energy: np.ndarray
    m: np.ndarray
    inv_s: np.ndarray
    abar: np.ndarray


def empty_stats(n: int, dtype) -> RowStats:
    """Statistics of ``n`` receivers that have seen no sender."""
    return RowStats(np.full(n, -np.inf, dtype), np.zeros(n, dtype), np.zeros(n, dtype))


def _tile(A_r, c_r, B_s, r0: int, s0: int):
    """KL tile (n_r, n_s) and the mask of pairs i != j."""
    L = 0.5 * (A_r @ B_s.T + c_r[:, None])
    i = np.arange(r0, r0 + A_r.shape[0])[:, None]
    j = np.arange(s0, s0 + B_s.shape[0])[None, :]
    return L, i != j


def block_stats(A_r, c_r, B_s, kappa: float, r0: int = 0, s0: int = 0) -> RowStats:
    """Statistics of receivers A_r (n_r, D), c_r (n_r,) over senders B_s (n_s, D)."""
    L, valid = _tile(A_r, c_r, B_s, r0, s0)
    x = np.where(valid, -L / kappa, -np.inf)
    m = x.max(axis=1, initial=-np.inf)
    has = valid.any(axis=1)
    e = np.exp(np.where(valid, x - np.where(has, m, 0.0)[:, None], -np.inf))
    return RowStats(m, e.sum(axis=1), (e * np.where(valid, L, 0.0)).sum(axis=1))


def merge_stats(a: RowStats, b: RowStats) -> RowStats:
    """Combine two partial statistics of the same receivers (either side may be empty)."""
    m = np.maximum(a.m, b.m)
    finite = np.isfinite(m)
    shift = np.where(finite, m, 0.0)
    # An empty side (s = 0) gets factor 0; its m is replaced by the shift so exp sees 0, not -inf - -inf.
    ra = np.where(a.s > 0, np.exp(np.where(a.s > 0, a.m, shift) - shift), 0.0)
    rb = np.where(b.s > 0, np.exp(np.where(b.s > 0, b.m, shift) - shift), 0.0)
    return RowStats(m, a.s * ra + b.s * rb, a.t * ra + b.t * rb)


def finish_rows(stats: RowStats, kappa: float, aggregator: str) -> RowSummary:
    """Energies and weight parameters from complete statistics; rows without a pair give energy 0."""
    aggregator_check(aggregator)
    has = stats.s > 0
    s1 = np.where(has, stats.s, 1.0)
    inv_s = np.where(has, 1.0 / s1, 0.0)
    abar = np.where(has, stats.t / s1, 0.0)
    if aggregator == "expected":
        energy = abar
    else:
        energy = np.where(has, -kappa * (np.where(has, stats.m, 0.0) + np.log(s1)), 0.0)
    return RowSummary(energy.astype(stats.s.dtype), stats.m, inv_s, abar)


def block_grads(A_r, c_r, B_s, rows: RowSummary, kappa: float, aggregator: str, r0: int = 0, s0: int = 0):
    """This block's parts of the cotangents: gA_r = 1/2 W B_s (n_r, D), gc_r = 1/2 sum_j W (n_r,) and
    gB_s = 1/2 W^T A_r (n_s, D), with W_ij = dE/dKL_ij from the receivers' row summary."""
    L, valid = _tile(A_r, c_r, B_s, r0, s0)
    shift = np.where(np.isfinite(rows.m), rows.m, 0.0)[:, None]
    beta = np.where(valid, np.exp(np.where(valid, -L / kappa - shift, -np.inf)), 0.0) * rows.inv_s[:, None]
    if aggregator == "expected":
        W = beta * (1.0 - (np.where(valid, L, 0.0) - rows.abar[:, None]) / kappa)
    else:
        W = beta
    return 0.5 * (W @ B_s), 0.5 * W.sum(axis=1), 0.5 * (W.T @ A_r)


def pairwise_blocked(A, B, c, kappa: float, aggregator: str, block: int):
    """Dense pairs through the block API with blocks of ``block`` agents: (E, gA, gB, gc) as
    :func:`vfesim.pairwise.reference.pairwise_dense`. Every sum runs over blocks in ascending order."""
    aggregator_check(aggregator)
    N = A.shape[0]
    if block < 1:
        raise ValueError(f"block: must be >= 1, got {block}")
    starts = range(0, N, block)
    gA, gB, gc = np.zeros_like(A), np.zeros_like(B), np.zeros_like(c)
    E = 0.0
    for r0 in starts:
        r1 = min(N, r0 + block)
        stats = empty_stats(r1 - r0, A.dtype)
        for s0 in starts:
            s1 = min(N, s0 + block)
            stats = merge_stats(stats, block_stats(A[r0:r1], c[r0:r1], B[s0:s1], kappa, r0, s0))
        rows = finish_rows(stats, kappa, aggregator)
        E += total(rows.energy)
        for s0 in starts:
            s1 = min(N, s0 + block)
            a, g, b = block_grads(A[r0:r1], c[r0:r1], B[s0:s1], rows, kappa, aggregator, r0, s0)
            gA[r0:r1] += a
            gc[r0:r1] += g
            gB[s0:s1] += b
    return E, gA, gB, gc
