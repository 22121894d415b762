"""Per-pair scalar math of the alignment energy, written once for every device (SPEC §2.2–2.4).

Plain Python over scalars and rows of 2-D arrays: explicit loops, no allocation, no numpy calls, only
``math.exp`` / ``math.log``. Drivers compile these functions themselves: ``numba.njit(inline="always")``
in :mod:`vfesim_kernels.pairwise_cpu`, ``numba.cuda.jit(device=True)`` in :mod:`vfesim_kernels.cuda`.
Every function keeps the dtype of its inputs (float32 stays float32): Numba types a Python float literal
as float64 and would promote, so no arithmetic here touches a literal (constants come from the inputs).
The caller passes ``kappa`` in the array dtype.

Model (features from :mod:`vfesim.gaussian.features`): ``KL_ij = 1/2 (A_i . B_j + c_i)``. The kernels take
the receiver features pre-halved, ``Ah = A / 2`` and ``ch = c / 2`` (exact: a power of two), so that
``KL_ij = Ah_i . B_j + ch_i`` needs no constant and ``sum_i W_ij Ah_i`` is exactly ``gB_j``. Logit
``x_ij = -KL_ij / kappa``, ``beta_ij = exp(x_ij - m_i) / s_i`` with the row max ``m_i`` and
``s_i = sum_j exp(x_ij - m_i)``; ``t_i = sum_j exp(x_ij - m_i) KL_ij`` so that ``abar_i = t_i / s_i``.

Stable API (names and signatures; all arguments positional):

    AGG_EXPECTED = 0, AGG_SOFTMIN = 1               aggregator codes
    aggregator_code(name) -> int                    host-side only (raises on an unknown name)
    feature_dot(A, i, B, j) -> float                sum_d A[i, d] * B[j, d], d ascending
    pair_kl(Ah, i, B, j, ch) -> float               Ah[i] . B[j] + ch[i]  (= 1/2 (A[i] . B[j] + c[i]))
    pair_logit(kl, kappa) -> float                  -kl / kappa
    lse_push(m, s, t, x, kl) -> (m, s, t)           add one logit x (with its KL) to row statistics;
                                                    start from (m, s, t) = (-inf, 0, 0)
    lse_push_e(m, s, t, x, kl, e, one)              the same with e = exp(-|x - m|) supplied by the caller
    lse_merge(m1, s1, t1, m2, s2, t2) -> (m, s, t)  combine two partial statistics (either may be empty)
    row_abar(s, t) -> float                         t / s, or 0 for an empty row (s == 0)
    row_energy(m, s, t, kappa, agg) -> float        the aggregator A_kappa of one row; 0 when s == 0
    pair_weight(kl, m, inv_s, abar, kappa, agg)     W_ij = dE/dKL_ij (expected: beta (1 - (kl - abar)/kappa);
                                                    softmin: beta), with inv_s = 1 / s_i
    pair_weight_e(e, kl, inv_s, abar, kappa, agg)   the same from e = exp(-kl/kappa - m) computed by the
                                                    caller (e.g. a vectorised exp over a tile row)
    accumulate_row(out, i, w, X, j) -> None         out[i, d] += w * X[j, d] for all d, d ascending

Pair weights outside the softmax (``vfesim.pairwise.weighted``: ``m_ij = u_i v_j``, the softmax unchanged).
Row statistics (m, s, t, b) with ``t_i = sum_j e_ij v_j KL_ij`` and ``b_i = sum_j e_ij v_j``; then
``abar_i = t_i / s_i = sum_j beta_ij v_j KL_ij``, ``bbar_i = b_i / s_i = sum_j beta_ij v_j`` and
``F_i = -kappa (m_i + log s_i)``. The row energy is ``E_i = u_i e_i`` with the unit energy ``e_i``
("expected": abar_i; "softmin": bbar_i F_i), so ``dE_i/du_i = e_i``:

    lse_push_w(m, s, t, b, x, kl, v) -> (m, s, t, b)   add sender j (logit x, KL kl, weight v = v_j)
    row_unit_energy_w(m, s, t, b, kappa, agg)          e_i; 0 when s == 0
    row_means_w(m, s, t, b, kappa) -> (abar, bbar, F)  zeros when s == 0
    pair_weight_w(kl, v, u, m, inv_s, abar, bbar, F, kappa, agg) -> (W, Wv)
        W = dE_i/dKL_ij (expected: u beta (v - (v kl - abar) / kappa); softmin: u beta (bbar - F (v -
        bbar) / kappa)) and Wv = dE_i/dv_j (expected: u beta kl; softmin: u beta F)

Masked (absent) pairs are never pushed: no infinite logit enters the statistics, so drivers may use
fastmath flags other than ``nnan``/``ninf`` on the sums. ``-inf`` appears only as the empty-row max.
No function calls another one, so each compiles on its own (a compiled function cannot call the plain
Python version of its neighbour); ``aggregator_code`` is host-only.
"""

from __future__ import annotations

import math

__all__ = [
    "AGG_EXPECTED",
    "AGG_SOFTMIN",
    "aggregator_code",
    "feature_dot",
    "pair_kl",
    "pair_logit",
    "lse_push",
    "lse_merge",
    "row_abar",
    "row_energy",
    "pair_weight",
    "pair_weight_e",
    "accumulate_row",
    "lse_push_w",
    "row_unit_energy_w",
    "row_means_w",
    "pair_weight_w",
]

AGG_EXPECTED = 0
AGG_SOFTMIN = 1


def aggregator_code(name: str) -> int:
    """'expected' -> AGG_EXPECTED, 'softmin' -> AGG_SOFTMIN (host side; not for compiled code)."""
    if name == "expected":
        return AGG_EXPECTED
    if name == "softmin":
        return AGG_SOFTMIN
    raise ValueError(f"aggregator: unknown {name!r}; choose 'expected' or 'softmin'")


def feature_dot(A, i, B, j):
    """sum_d A[i, d] * B[j, d] for A (N, D), B (M, D), summed in ascending d."""
    acc = A[i, 0] * B[j, 0]
    for d in range(1, A.shape[1]):
        acc += A[i, d] * B[j, d]
    return acc


def pair_kl(Ah, i, B, j, ch):
    """KL(q_i || Omega_ij q_j) = Ah[i] . B[j] + ch[i] with Ah = A / 2, ch = c / 2 (SPEC §2.3)."""
    acc = Ah[i, 0] * B[j, 0]
    for d in range(1, Ah.shape[1]):
        acc += Ah[i, d] * B[j, d]
    return acc + ch[i]


def pair_logit(kl, kappa):
    """Softmax logit -kl / kappa (kappa is a temperature: it divides)."""
    return -kl / kappa


def lse_push(m, s, t, x, kl):
    """Online log-sum-exp: add logit x with value kl to (max m, sum s, weighted sum t)."""
    if x > m:
        r = math.exp(m - x)  # 0 for the first element (m = -inf)
        return x, s * r + math.exp(x - x), t * r + kl  # exp(0) == 1 exactly, in the dtype of x
    e = math.exp(x - m)
    return m, s + e, t + e * kl


def lse_merge(m1, s1, t1, m2, s2, t2):
    """Combine two partial row statistics; an empty side has s == 0 (and m == -inf)."""
    if s2 == 0.0:
        return m1, s1, t1
    if s1 == 0.0:
        return m2, s2, t2
    if m1 >= m2:
        r = math.exp(m2 - m1)
        return m1, s1 + s2 * r, t1 + t2 * r
    r = math.exp(m1 - m2)
    return m2, s1 * r + s2, t1 * r + t2


def row_abar(s, t):
    """Attention-weighted mean KL of a row, t / s; 0 for a row without neighbours."""
    if s == 0.0:
        return s
    return t / s


def row_energy(m, s, t, kappa, agg):
    """Aggregated energy of one row: expected t / s, softmin -kappa (m + log s); 0 when s == 0."""
    if s == 0.0:
        return s
    if agg == AGG_SOFTMIN:
        return -kappa * (m + math.log(s))
    return t / s


def pair_weight(kl, m, inv_s, abar, kappa, agg):
    """W_ij = dE/dKL_ij from the row statistics (m, 1/s, abar) of receiver i."""
    beta = math.exp(-kl / kappa - m) * inv_s
    if agg == AGG_SOFTMIN:
        return beta
    return beta - beta * ((kl - abar) / kappa)


def pair_weight_e(e, kl, inv_s, abar, kappa, agg):
    """W_ij from e = exp(-kl / kappa - m_i) (pair_weight with the exponential supplied)."""
    beta = e * inv_s
    if agg == AGG_SOFTMIN:
        return beta
    return beta - beta * ((kl - abar) / kappa)


def accumulate_row(out, i, w, X, j):
    """out[i, d] += w * X[j, d] for every d (ascending; out and X have the same width)."""
    for d in range(X.shape[1]):
        out[i, d] += w * X[j, d]


def lse_push_e(m, s, t, x, kl, e, one):
    """lse_push with e = exp(-|x - m|) supplied by the caller (one exponential per element, computed
    before the branch, e.g. by a faster exponential of the target), ``one`` = 1 in the dtype of x."""
    if x > m:
        return x, s * e + one, t * e + kl
    return m, s + e, t + e * kl


def lse_push_w(m, s, t, b, x, kl, v):
    """Online log-sum-exp with a sender weight v: add logit x (KL kl) to (max m, sum s, sum of
    e v kl t, sum of e v b); start from (-inf, 0, 0, 0)."""
    if x > m:
        r = math.exp(m - x)  # 0 for the first element (m = -inf)
        return x, s * r + math.exp(x - x), t * r + v * kl, b * r + v
    e = math.exp(x - m)
    return m, s + e, t + e * v * kl, b + e * v


def row_unit_energy_w(m, s, t, b, kappa, agg):
    """The row energy per unit receiver weight: expected t / s, softmin (b / s) (-kappa (m + log s));
    0 when s == 0."""
    if s == 0.0:
        return s
    if agg == AGG_SOFTMIN:
        return (b / s) * (-kappa * (m + math.log(s)))
    return t / s


def row_means_w(m, s, t, b, kappa):
    """(abar, bbar, F) = (t / s, b / s, -kappa (m + log s)) of a weighted row; zeros when s == 0."""
    if s == 0.0:
        return s, s, s
    return t / s, b / s, -kappa * (m + math.log(s))


def pair_weight_w(kl, v, u, m, inv_s, abar, bbar, F, kappa, agg):
    """(W, Wv): dE_i/dKL_ij and dE_i/dv_j of pair (i, j) with weights u = u_i, v = v_j, from the row's
    (m, 1/s, abar, bbar, F)."""
    beta = math.exp(-kl / kappa - m) * inv_s
    ub = u * beta
    if agg == AGG_SOFTMIN:
        return ub * (bbar - F * (v - bbar) / kappa), ub * F
    return ub * (v - (v * kl - abar) / kappa), ub * kl
