"""Pairwise energy in feature form and its adjoint, the NumPy reference (SPEC §2.2–2.4).

Given per-agent features (A, B, c) with KL_ij = 1/2 (A_i . B_j + c_i), compute

    E = sum_i Agg_kappa({KL_ij}_{j in N(i)}),    beta_ij = softmax_j(-KL_ij / kappa)

and the cotangents gA = 1/2 W B, gB = 1/2 W^T A, gc_i = 1/2 sum_j W_ij with W_ij = dE/dKL_ij:
  "expected": Agg = sum_j beta_ij KL_ij,           W_ij = beta_ij (1 - (KL_ij - Abar_i) / kappa)
  "softmin":  Agg = -kappa log sum_j e^{-KL_ij/kappa},  W_ij = beta_ij
An agent without neighbours contributes 0.

Dense: receivers are processed in row blocks; each block's full softmax row fits in memory, so one
pass of GEMMs suffices and peak memory is O(block * N). Sparse: gathered (N, k) neighbour lists.
Sums run in a fixed order, so results are deterministic.
"""

from __future__ import annotations

import numpy as np

__all__ = ["aggregator_check", "row_weights", "pairwise_dense", "pairwise_sparse", "ROW_BLOCK_ELEMENTS"]

AGGREGATORS = ("expected", "softmin")

# Elements of one (block, N) row slab; 4M float64 = 32 MB per temporary.
ROW_BLOCK_ELEMENTS = 1 << 22


def aggregator_check(aggregator: str) -> None:
    """Raise ValueError naming an unknown aggregator."""
    if aggregator not in AGGREGATORS:
        raise ValueError(f"aggregator: unknown {aggregator!r}; choose one of {AGGREGATORS}")


def row_weights(L, valid, kappa: float, aggregator: str):
    """Per-row energy and weights for KL rows L (b, n) with a validity mask (b, n).

    Returns (energy (b,), beta (b, n), W (b, n)). Invalid entries get beta = W = 0; rows with no
    valid entry give energy 0.
    """
    has = valid.any(axis=1)
    logits = np.where(valid, -L / kappa, -np.inf)
    m = np.where(has, logits.max(axis=1, initial=-np.inf), 0.0)
    e = np.exp(logits - m[:, None])
    Z = e.sum(axis=1)
    beta = e / np.where(has, Z, 1.0)[:, None]
    L0 = np.where(valid, L, 0.0)
    if aggregator == "expected":
        abar = (beta * L0).sum(axis=1)
        W = beta * (1.0 - (L0 - abar[:, None]) / kappa)
        energy = abar
    elif aggregator == "softmin":
        W = beta
        with np.errstate(divide="ignore"):
            energy = np.where(has, -kappa * (m + np.log(np.where(has, Z, 1.0))), 0.0)
    else:
        raise ValueError(f"aggregator: unknown {aggregator!r}")
    return energy, beta, W


def pairwise_dense(A, B, c, kappa: float, aggregator: str, *, return_beta: bool = False):
    """All pairs j != i. A, B (N, D), c (N,) -> (E, gA, gB, gc[, beta (N, N)])."""
    N = A.shape[0]
    gA = np.zeros_like(A)
    gB = np.zeros_like(B)
    gc = np.zeros_like(c)
    beta_all = np.zeros((N, N), A.dtype) if return_beta else None
    E = 0.0
    if N > 1:
        block = max(1, min(N, ROW_BLOCK_ELEMENTS // N))
        for r0 in range(0, N, block):
            r1 = min(N, r0 + block)
            rows = np.arange(r0, r1)
            L = 0.5 * (A[r0:r1] @ B.T + c[r0:r1, None])
            valid = np.ones(L.shape, bool)
            valid[rows - r0, rows] = False
            energy, beta, W = row_weights(L, valid, kappa, aggregator)
            E += float(energy.sum(dtype=np.float64))
            gA[r0:r1] = 0.5 * (W @ B)
            gB += 0.5 * (W.T @ A[r0:r1])
            gc[r0:r1] = 0.5 * W.sum(axis=1)
            if return_beta:
                beta_all[r0:r1] = beta
    out = (E, gA, gB, gc)
    return out + (beta_all,) if return_beta else out


def pairwise_sparse(A, B, c, index, mask, kappa: float, aggregator: str, *, return_beta=False):
    """Fixed-width neighbour lists index/mask (N, k) -> (E, gA, gB, gc[, beta (N, k)])."""
    Bn = B[index]  # (N, k, D)
    L = 0.5 * (np.einsum("nd,nkd->nk", A, Bn) + c[:, None])
    energy, beta, W = row_weights(L, mask, kappa, aggregator)
    gA = 0.5 * np.einsum("nk,nkd->nd", W, Bn)
    gB = np.zeros_like(B)
    rows = np.broadcast_to(np.arange(A.shape[0])[:, None], index.shape)
    # np.add.at accumulates sequentially in index order: deterministic.
    np.add.at(gB, index[mask], 0.5 * W[mask][:, None] * A[rows[mask]])
    gc = 0.5 * W.sum(axis=1)
    out = (float(energy.sum(dtype=np.float64)), gA, gB, gc)
    return out + (beta,) if return_beta else out
