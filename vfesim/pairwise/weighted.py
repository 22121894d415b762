"""Pair weights outside the softmax: the pairwise layer with per-pair factors ``m_ij = u_i v_j``.

Features as everywhere in :mod:`vfesim.pairwise`: ``KL_ij = 1/2 (A_i . B_j + c_i)``, attention
``beta_ij = softmax_{j valid}(-KL_ij / kappa)``. The weights multiply the pair terms and are not part of
the softmax (field agents: ``u = v = chi`` at one grid point). Row energies::

    "expected": E_i = sum_j m_ij beta_ij KL_ij
    "softmin":  E_i = s_i F_i,  s_i = sum_j m_ij beta_ij,  F_i = -kappa log sum_j exp(-KL_ij / kappa)

(``sum_j beta_ij (KL_ij + kappa ln beta_ij) = F_i`` for every row: "softmin" puts the weights outside
that identity). With all weights 1 both are the plain aggregators of :mod:`.reference`. Derivatives::

    "expected": dE_i/dKL_ij = beta_ij (m_ij - (m_ij KL_ij - E_i) / kappa),  dE_i/dm_ij = beta_ij KL_ij
    "softmin":  dE_i/dKL_ij = beta_ij (s_i - F_i (m_ij - s_i) / kappa),     dE_i/dm_ij = beta_ij F_i

Rows without a valid pair give energy 0 and zero derivatives. NumPy arrays; sums in a fixed order.

Pairs batched over grid points (:func:`pairwise_points_weighted`, field agents): receiver and sender rows
grouped by point, neighbour lists per agent, pairs only between rows of one point. Its contract is the
backends' ``pairwise_points`` (the kernels: :func:`vfesim_kernels.pairwise_cpu.pairwise_points`, the
cuda backend's); memory O(rows D + block), never agents x agents x points.
"""

from __future__ import annotations

import numpy as np

from ..arrays import total
from .reference import aggregator_check, row_weights

__all__ = ["weighted_row_weights", "pairwise_sparse_weighted", "pairwise_points_weighted", "point_blocks"]

# Gathered sender features (rows, k, D) of one block of grid points: 4M elements (32 MB in float64).
BLOCK_ELEMENTS = 1 << 22


def weighted_row_weights(L, valid, m, kappa: float, aggregator: str):
    """Rows of KLs L (b, n) with a validity mask (b, n) and pair weights m (b, n).

    Returns (energy (b,), beta (b, n), W = dE/dL (b, n), Wm = dE/dm (b, n)); invalid entries get 0.
    """
    aggregator_check(aggregator)
    F, beta, _ = row_weights(L, valid, kappa, "softmin")
    L0 = np.where(valid, L, 0.0)
    m0 = np.where(valid, m, 0.0)
    if aggregator == "expected":
        a = m0 * L0
        abar = (beta * a).sum(axis=1)
        W = beta * (m0 - (a - abar[:, None]) / kappa)
        return abar, beta, W, beta * L0
    s = (beta * m0).sum(axis=1)
    W = beta * (s[:, None] - F[:, None] * (m0 - s[:, None]) / kappa)
    return s * F, beta, W, beta * F[:, None]


def pairwise_sparse_weighted(A, B, c, index, mask, u, v, kappa: float, aggregator: str, *, return_beta=False):
    """Receiver rows A (n_r, D), c (n_r,) against sender rows B (n_s, D) through lists index/mask
    (n_r, k) (entries under ``mask == False`` ignored), with pair weights ``u_r v_index[r, s]``:
    u (n_r,), v (n_s,).

    Returns (E, gA, gB, gc, gu, gv[, beta (n_r, k)]): E summed in float64, the cotangents
    gA = 1/2 sum_s W B, gB = 1/2 scattered W A, gc = 1/2 sum_s W, and gu, gv of the weights.
    """
    Bn = B[index]  # (n_r, k, D)
    L = 0.5 * (np.einsum("nd,nkd->nk", A, Bn) + c[:, None])
    vn = v[index]
    energy, beta, W, Wm = weighted_row_weights(L, mask, u[:, None] * vn, kappa, aggregator)
    gA = 0.5 * np.einsum("nk,nkd->nd", W, Bn)
    gc = 0.5 * W.sum(axis=1)
    gu = (Wm * vn).sum(axis=1)
    rows = np.broadcast_to(np.arange(A.shape[0])[:, None], index.shape)
    sel, r = index[mask], rows[mask]
    # Sender sums as sparse (n_s, n_r) products (no duplicate senders in a row): deterministic, and
    # about 10x faster than np.add.at at (rows, k, D) = (6e4, 15, 10). (scipy.sparse loads on first use.)
    from scipy import sparse

    WT = sparse.csr_matrix((W[mask], (sel, r)), shape=(B.shape[0], A.shape[0]))
    gB = (0.5 * (WT @ A)).astype(B.dtype, copy=False)
    gv = sparse.csr_matrix((Wm[mask] * u[r], (sel, r)), shape=(v.shape[0], A.shape[0])).sum(axis=1)
    gv = np.asarray(gv, dtype=v.dtype).reshape(-1)
    out = (total(energy), gA, gB, gc, gu, gv)
    return out + (beta,) if return_beta else out


def point_blocks(offsets, width: int, D: int):
    """Blocks of whole grid points (p0, p1) of about BLOCK_ELEMENTS gathered elements (rows x width x D)
    each; offsets (P + 1,): the rows of point p are offsets[p]:offsets[p+1]."""
    P = offsets.size - 1
    target = max(1, BLOCK_ELEMENTS // max(1, width * D))
    p0 = 0
    while p0 < P:
        p1 = int(np.searchsorted(offsets, offsets[p0] + target, side="right")) - 1
        p1 = min(P, max(p0 + 1, p1))
        yield p0, p1
        p0 = p1


def pairwise_points_weighted(
    A, B, c, u, v, offsets, lists, rowmap, index, mask, kappa: float, aggregator: str, *, return_beta=False
):
    """Weighted pairs batched over grid points, pairs only between rows of one point.

    Receivers: rows A (M_r, D), c (M_r,), u (M_r,), point-major: the receivers at point p are rows
    offsets[p]:offsets[p+1] (offsets (P + 1,)); lists (M_r,): the row of index/mask (n_l, k) listing
    receiver r's neighbour agents. Senders: rows B (M_s, D), v (M_s,); rowmap (P, n): the sender row of
    agent j at point p, -1 where it has none. Receiver r at point p pairs with s = rowmap[p, index[
    lists[r], q]] for every q with mask and s >= 0, pair weight u_r v_s (outside the softmax).

    Returns (E, gA, gB, gc, gu, gv[, beta (M_r, k)]) as :func:`pairwise_sparse_weighted`, computed per
    block of points (:func:`point_blocks`).
    """
    offsets = np.asarray(offsets)
    gA, gB, gc = np.zeros_like(A), np.zeros_like(B), np.zeros_like(c)
    gu, gv = np.zeros_like(u), np.zeros_like(v)
    beta = np.zeros((A.shape[0], index.shape[1]), A.dtype) if return_beta else None
    E = 0.0
    for p0, p1 in point_blocks(offsets, index.shape[1], A.shape[1]):
        s, e = int(offsets[p0]), int(offsets[p1])
        if e == s:
            continue
        pt = np.repeat(np.arange(p0, p1), np.diff(offsets[p0 : p1 + 1]))
        lst = lists[s:e]
        senders = rowmap[pt[:, None], index[lst]]  # (rows, k): sender rows, -1 where absent
        valid = mask[lst] & (senders >= 0)
        if not valid.any():
            continue
        lo, hi = int(senders[valid].min()), int(senders[valid].max()) + 1
        local = np.where(valid, senders - lo, 0)
        out = pairwise_sparse_weighted(
            A[s:e], B[lo:hi], c[s:e], local, valid, u[s:e], v[lo:hi], kappa, aggregator,
            return_beta=return_beta,
        )  # fmt: skip
        E += out[0]
        gA[s:e], gc[s:e], gu[s:e] = out[1], out[3], out[4]
        gB[lo:hi] += out[2]
        gv[lo:hi] += out[5]
        if return_beta:
            beta[s:e] = out[6]
    out = (E, gA, gB, gc, gu, gv)
    return out + (beta,) if return_beta else out
