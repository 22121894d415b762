"""Numba CPU kernels of the pairwise alignment energy and its adjoint, tiled and streaming (SPEC §2.3–2.4).

Same contract as ``vfesim.pairwise.reference.pairwise_dense`` / ``pairwise_sparse`` (without
``return_beta``): features A, B (N, D), c (N,) with KL_ij = 1/2 (A_i . B_j + c_i) ->
(E: Python float, gA (N, D), gB (N, D), gc (N,)), computed in the input dtype (float32 or float64).

Dense (D < DOT_MIN_D, e.g. D = 10 at K = 3): two sweeps over (receiver tile) x (sender tile) blocks of the
KL matrix, never holding more than one tile row per thread (peak memory O(chunks N D + threads tile D),
no N x N array), in parallel over a fixed number of receiver chunks (:func:`chunks`):
  1. per receiver block: online log-sum-exp statistics (m, s, t) over sender tiles;
  2. the same receiver block, right after: recompute the tiles as weights W_ij, accumulate gA_i, gc_i per
     receiver and the chunk's partial gB_j = sum_i W_ij Ah_i (float64, (D, N) per chunk); the partials
     are summed over chunks in ascending order afterwards.
Each tile row is a vectorised pipeline: KL row (contiguous senders of B^T), logits, a vectorised exp
(:func:`exp_row_f64` / :func:`exp_row_f32`, in the input dtype), weights. float32 inputs run 8 lanes of
AVX2 throughout; partial sums in the input dtype span at most one tile and are carried on in float64.
Long features (D >= DOT_MIN_D, e.g. D = 253 at K = 21) take the BLAS path instead (:func:`_dense_blas`):
the KL tiles and the gA / gB products are (T, T) gemm calls small enough that OpenBLAS runs each on the
calling thread; sweep 1 keeps whole KL rows of a receiver block (T x N per thread, so no online
log-sum-exp and no second KL pass) and sweep 2 recomputes tiles per sender block for gB.
Every sum runs in a fixed order within fixed-size tiles and chunks (functions of N and D only); no thread
shares an output row and there are no atomics, so results are bitwise identical run to run and do not
depend on Numba's or OpenBLAS's thread count. For schedulers, :func:`pairwise_dense_rows` runs one
receiver range with its share of gB, and :func:`pairwise_dense_receivers` / :func:`pairwise_dense_senders`
split the pairs in two passes (receiver ranges with their row statistics, then sender ranges whose gB the
statistics of every receiver give: :func:`_tiled_senders` or the BLAS sender kernel). Sparse: per receiver
over its (N, k) list; senders through a CSC reverse index built by a stable counting sort, parallel over
senders, each summing its receivers in ascending order. Weighted pairs batched over grid points
(:func:`pairwise_points`, field agents): parallel over points, each point's receivers and senders owned by
one thread.

The scalar per-pair math (online LSE, weights) is :mod:`vfesim_kernels.pair_math`, compiled here with
``numba.njit(inline="always")``; only the tile loops are CPU-specific.
"""

from __future__ import annotations

import types

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.extending import intrinsic, overload

from . import pair_math as _pm

__all__ = [
    "pairwise_dense",
    "pairwise_sparse",
    "pairwise_dense_rows",
    "pairwise_dense_receivers",
    "pairwise_dense_senders",
    "pairwise_sparse_rows",
    "pairwise_points",
    "incoming_csr",
    "SENDER_TILE",
    "RECEIVER_TILE",
]

# Sender tile of sweeps 1-2. It fixes the grouping of the online log-sum-exp, so it is a constant (the
# results must not depend on the thread count). 256 columns x 32 rows of float64 = 64 KiB per thread.
SENDER_TILE = 256
# Receiver rows per tile: a float32 partial sum of gB spans one tile before it is added in float64.
RECEIVER_TILE = 32
# Receivers whose weights sweep 2 holds at once (see _dense_chunks).
ROW_GROUP = 4
# Receiver chunks of the tiled path (see chunks()): at most this many, and their float64 gB partials
# (chunks x D x N) within CHUNK_BYTES.
MAX_CHUNKS = 16
CHUNK_BYTES = 64 << 20
# Feature length from which pairwise_dense takes the BLAS path (below it the tiled kernels' contiguous
# sender loops are faster; the tiled kernels still handle any D, as one dot product per pair).
DOT_MIN_D = 32

_inline = numba.njit(inline="always", cache=True, nogil=True)
_lse_merge = _inline(_pm.lse_merge)
_lse_push = _inline(_pm.lse_push)
_row_abar = _inline(_pm.row_abar)
_row_energy = _inline(_pm.row_energy)
_pair_weight = _inline(_pm.pair_weight)
_pair_weight_e = _inline(_pm.pair_weight_e)
_pair_kl = _inline(_pm.pair_kl)
_pair_logit = _inline(_pm.pair_logit)
_accumulate_row = _inline(_pm.accumulate_row)
_lse_push_w = _inline(_pm.lse_push_w)
_row_unit_energy_w = _inline(_pm.row_unit_energy_w)
_row_means_w = _inline(_pm.row_means_w)
_pair_weight_w = _inline(_pm.pair_weight_w)

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_kernel = numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
_serial = numba.njit(nogil=True, cache=True)
_contract = numba.njit(nogil=True, cache=True, fastmath={"contract"})


# exp(x) for x <= 0 over a row, as Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a polynomial in r
# and 2^n assembled from its bits (n's own bits shifted into the exponent field, bit casts in registers).
# Unlike math.exp (one libm call per element) the loops vectorise, in the
# row's own dtype: 4 float64 or 8 float32 lanes of AVX2. n = round(x log2 e) comes from adding 1.5 * 2^52
# (2^23 in float32): the sum's low mantissa bits then hold n as an integer, so there is no float -> int
# conversion (AVX2 has none for 64-bit integers, and a scalar one per element costs more than the rest).
# float64: degree-11 Taylor polynomial (truncation < 1e-14), relative error < 5e-14 against np.exp;
# x clamped to [-708, 0] (exp(-708) ~ 3e-308 stays a normal number).
# float32: Cephes' expf polynomial (relative error ~1e-7, i.e. 1-2 ulp); x clamped to [-87, 0]
# (exp(-87) ~ 1.6e-38 stays normal). The clamped tail only ever adds to sums whose largest term is 1.
# Only contraction (multiply-adds) as fastmath, and it has to be said: a function that sets no fastmath
# inherits its caller's flags, and reassociation cancels the rounding constant (exp(x) = 2^n: measured).
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # trailing zeros: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_ROUND64 = 6755399441055744.0  # 1.5 * 2^52
_LOG2E_F = np.float32(_LOG2E)
_LN2_HI_F = np.float32(0.693359375)  # 9 significant bits: n * _LN2_HI_F is exact for |n| < 2^15
_LN2_LO_F = np.float32(-2.12194440e-4)
_ROUND32 = np.float32(12582912.0)  # 1.5 * 2^23
_F32 = {
    name: np.float32(v)
    for name, v in dict(
        lo=-87.0,
        zero=0.0,
        one=1.0,
        p0=1.9875691500e-4,
        p1=1.3981999507e-3,
        p2=8.3334519073e-3,
        p3=4.1665795894e-2,
        p4=1.6666665459e-1,
        p5=5.0000001201e-1,
    ).items()
}
_F32_LO, _F32_ZERO, _F32_ONE = _F32["lo"], _F32["zero"], _F32["one"]
_F32_P0, _F32_P1, _F32_P2, _F32_P3, _F32_P4, _F32_P5 = (_F32[f"p{k}"] for k in range(6))


@intrinsic
def _pow2(typingctx, t):
    """2^n from t = n + 1.5 * 2^52 (float64) or n + 1.5 * 2^23 (float32), whose low mantissa bits hold the
    integer n: n's bits shifted into the exponent field, with integer arithmetic of the float's width in
    registers (Numba's own integer arithmetic would widen 32-bit integers to 64 bits)."""
    if t == numba.types.float64:
        width, rounding_bits, bias, shift = 64, 0x4338000000000000, 1023, 52
    elif t == numba.types.float32:
        width, rounding_bits, bias, shift = 32, 0x4B400000, 127, 23
    else:
        return None

    def codegen(context, builder, sig, args):
        ity = llvm_ir.IntType(width)
        bits = builder.bitcast(args[0], ity)
        bits = builder.add(builder.sub(bits, ity(rounding_bits)), ity(bias))
        return builder.bitcast(builder.shl(bits, ity(shift)), args[0].type)

    return t(t), codegen


@_contract
def exp_row_f64(x, n, out):
    """out[:n] = exp(x[:n]) for float64 x <= 0 (out may be x)."""
    for k in range(n):
        v = min(max(x[k], -708.0), 0.0)
        t = v * _LOG2E + _ROUND64
        q = t - _ROUND64  # round(v log2 e), exactly
        r = (v - q * _LN2_HI) - q * _LN2_LO
        p = 1.0 / 39916800.0
        p = p * r + 1.0 / 3628800.0
        p = p * r + 1.0 / 362880.0
        p = p * r + 1.0 / 40320.0
        p = p * r + 1.0 / 5040.0
        p = p * r + 1.0 / 720.0
        p = p * r + 1.0 / 120.0
        p = p * r + 1.0 / 24.0
        p = p * r + 1.0 / 6.0
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        out[k] = p * _pow2(t)


@_contract
def exp_row_f32(x, n, out):
    """out[:n] = exp(x[:n]) for float32 x <= 0, in float32 (out may be x)."""
    for k in range(n):
        v = min(max(x[k], _F32_LO), _F32_ZERO)
        t = v * _LOG2E_F + _ROUND32
        q = t - _ROUND32
        r = (v - q * _LN2_HI_F) - q * _LN2_LO_F
        p = _F32_P0 * r + _F32_P1
        p = p * r + _F32_P2
        p = p * r + _F32_P3
        p = p * r + _F32_P4
        p = p * r + _F32_P5
        p = p * (r * r) + r + _F32_ONE
        out[k] = p * _pow2(t)


def _exp_row(x, n, out):
    """exp_row_f64 or exp_row_f32 by the dtype of x, chosen when a kernel compiles."""
    return (exp_row_f32 if x.dtype == np.float32 else exp_row_f64)(x, n, out)


@overload(_exp_row, jit_options={"nogil": True})
def _exp_row_typed(x, n, out):
    if x.dtype == numba.types.float32:
        return lambda x, n, out: exp_row_f32(x, n, out)
    return lambda x, n, out: exp_row_f64(x, n, out)


@_inline
def _kl_row(Ah, Bt, ch, i, j0, nj, out):
    """out[jj] = KL of receiver i and sender j0 + jj, jj < nj: ch[i] + Ah[i] . B[j] (pair_math.pair_kl).

    The loops run over contiguous senders of the transposed Bt (D, N) and vectorise; four features per
    pass keep four multiply-adds per load and store of ``out`` (one pass per feature would be bound by
    the stores). The sum is ch + the features in ascending groups of four, without reassociation.
    Rows are indexed through 1-D slices by the bare loop counter: an index like ``j0 + jj`` could be
    negative as far as Numba knows, and its wraparound check turns every vector load into a gather.
    """
    D = Ah.shape[1]
    c = ch[i]
    for jj in range(nj):
        out[jj] = c
    d = 0
    while d + 4 <= D:
        a0, a1, a2, a3 = Ah[i, d], Ah[i, d + 1], Ah[i, d + 2], Ah[i, d + 3]
        b0, b1 = Bt[d, j0 : j0 + nj], Bt[d + 1, j0 : j0 + nj]
        b2, b3 = Bt[d + 2, j0 : j0 + nj], Bt[d + 3, j0 : j0 + nj]
        for jj in range(nj):
            out[jj] += a0 * b0[jj] + a1 * b1[jj] + a2 * b2[jj] + a3 * b3[jj]
        d += 4
    if D - d == 3:
        a0, a1, a2 = Ah[i, d], Ah[i, d + 1], Ah[i, d + 2]
        b0, b1, b2 = Bt[d, j0 : j0 + nj], Bt[d + 1, j0 : j0 + nj], Bt[d + 2, j0 : j0 + nj]
        for jj in range(nj):
            out[jj] += a0 * b0[jj] + a1 * b1[jj] + a2 * b2[jj]
    elif D - d == 2:
        a0, a1 = Ah[i, d], Ah[i, d + 1]
        b0, b1 = Bt[d, j0 : j0 + nj], Bt[d + 1, j0 : j0 + nj]
        for jj in range(nj):
            out[jj] += a0 * b0[jj] + a1 * b1[jj]
    elif D - d == 1:
        a0 = Ah[i, d]
        b0 = Bt[d, j0 : j0 + nj]
        for jj in range(nj):
            out[jj] += a0 * b0[jj]


def _row_min(v, n, one):
    """min(v[:n]) for n >= 1 (compiled code only: _row_min_typed); ``one`` (1,) scratch, dtype of v."""
    raise NotImplementedError


@overload(_row_min, inline="always")
def _row_min_typed(v, n, one):
    """The minimum through the floats' bits as integers, mapped so that integer order is float order
    (negative floats have their magnitude bits flipped). LLVM vectorises an integer min reduction; a
    float one it vectorises only under the nnan flag, which the kernels do not set. A NaN maps above
    +inf, or below -inf with its sign bit set: either way it reaches the sums of the row and shows."""
    ity, shift, mask = (
        (np.int32, np.int32(31), np.int32(0x7FFFFFFF))
        if v.dtype == numba.types.float32
        else (np.int64, np.int64(63), np.int64(0x7FFFFFFFFFFFFFFF))
    )

    def impl(v, n, one):
        key = v.view(ity)
        r = key[0] ^ ((key[0] >> shift) & mask)
        for k in range(1, n):
            b = key[k]
            r = min(r, b ^ ((b >> shift) & mask))
        out = one.view(ity)
        out[0] = r ^ ((r >> shift) & mask)
        return one[0]

    return impl


@_inline
def _row_weights(Ah, Bt, ch, i, gi, j0, nj, m, inv_s, abar, kappa, agg, kl, xs, w):
    """w[:nj] = W_ij (pair_math.pair_weight_e) for receiver row i (global agent gi) and senders j0 + jj,
    0 on the diagonal (sender gi)."""
    _kl_row(Ah, Bt, ch, i, j0, nj, kl)
    mi, isi, ai = m[i], inv_s[i], abar[i]
    for jj in range(nj):
        xs[jj] = _pair_logit(kl[jj], kappa) - mi
    _exp_row(xs, nj, w)
    # One loop per aggregator: with a constant code the branch in pair_weight_e folds and the loop
    # vectorises (LLVM does not unswitch it).
    if agg == _pm.AGG_SOFTMIN:
        for jj in range(nj):
            w[jj] = _pair_weight_e(w[jj], kl[jj], isi, ai, kappa, _pm.AGG_SOFTMIN)
    else:
        for jj in range(nj):
            w[jj] = _pair_weight_e(w[jj], kl[jj], isi, ai, kappa, _pm.AGG_EXPECTED)
    if j0 <= gi < j0 + nj:
        w[gi - j0] = kappa - kappa


@_inline
def _group_weights(Ah, Bt, ch, i, ni, gi, j0, nj, m, inv_s, abar, kappa, agg, kl, xs, W):
    """Rows r of W: the weights of receivers i + r (global gi + r) against senders j0 .. j0 + nj - 1, for
    the ``ni`` receivers left from i; rows past them are 0 (a receiver group of the tiled kernels)."""
    zero = kappa - kappa
    for r in range(W.shape[0]):
        if r < ni:
            _row_weights(Ah, Bt, ch, i + r, gi + r, j0, nj, m, inv_s, abar, kappa, agg, kl, xs, W[r])
        else:
            for jj in range(nj):
                W[r, jj] = zero


@_inline
def _add_group(accB, W, Ah, i, last, d, nj):
    """accB[d, :nj] += sum_r W[r, :nj] Ah[i + r, d] over a group of ROW_GROUP = 4 receivers from row i
    (rows past ``last`` are padding: their W rows are 0, so any valid row of Ah stands in)."""
    a0, a1 = Ah[i, d], Ah[min(i + 1, last), d]
    a2, a3 = Ah[min(i + 2, last), d], Ah[min(i + 3, last), d]
    for jj in range(nj):
        accB[d, jj] += W[0, jj] * a0 + W[1, jj] * a1 + W[2, jj] * a2 + W[3, jj] * a3


@_kernel
def _dense_chunks(Ah, B, Bt, ch, r0, kappa, agg, P, m, inv_s, abar, erow, gA, gc, sends, gBp):
    """Sweeps 1-2 over P chunks of receiver blocks (parallel over chunks).

    Receivers are the rows of Ah, ch (n_r, D), (n_r,): global agents r0 .. r0 + n_r - 1 (the pair with
    sender r0 + i is excluded); senders are all columns of Bt (D, N). Per-receiver outputs (m, inv_s,
    abar, erow, gA, gc) are indexed by receiver row, gBp (P, D, N) by sender.

    Per block of RECEIVER_TILE receivers: sweep 1 gathers their row statistics by an online log-sum-exp
    over sender tiles, sweep 2 recomputes the tiles as weights W_ij and accumulates both gA_i and
    gc_i (per receiver) and this chunk's share of gB_j in gBp[chunk] (D, N). Row statistics, erow, gA,
    gc and gBp are float64: each float32 partial sum spans at most one tile (SENDER_TILE senders or
    RECEIVER_TILE receivers) and the tiles are summed in float64. ``sends`` False: no gB share (gBp is
    not touched; the receiver pass of a two-pass split, see :func:`pairwise_dense_receivers`).
    """
    NR, D = Ah.shape
    N = Bt.shape[1]
    TR, TS, RB = RECEIVER_TILE, SENDER_TILE, ROW_GROUP
    dt = Ah.dtype
    zero = kappa - kappa
    nblk = (NR + TR - 1) // TR
    for c in numba.prange(P):
        kl, xs, es = np.empty(TS, dt), np.empty(TS, dt), np.empty(TS, dt)
        W = np.empty((RB, TS), dt)
        one = np.empty(1, dt)
        accB = np.empty((D, TS), dt)
        accA = np.empty((TR, D), np.float64)
        wsum = np.empty(TR, np.float64)
        mr, sr, tr = np.empty(TR, np.float64), np.empty(TR, np.float64), np.empty(TR, np.float64)
        for b in range(c * nblk // P, (c + 1) * nblk // P):
            i0 = b * TR
            ni = min(TR, NR - i0)
            # Sweep 1: per receiver and sender tile, the tile's max logit, then one merge.
            for ii in range(ni):
                mr[ii], sr[ii], tr[ii] = -np.inf, 0.0, 0.0
            for j0 in range(0, N, TS):
                nj = min(TS, N - j0)
                for ii in range(ni):
                    i = i0 + ii
                    dj = r0 + i - j0
                    diag = 0 <= dj < nj
                    if diag and nj == 1:
                        continue  # only the diagonal in this tile
                    _kl_row(Ah, Bt, ch, i, j0, nj, kl)
                    if diag:
                        kl[dj] = kl[dj - 1] if dj > 0 else kl[1]  # a neighbour's value: no effect on min
                    kmin = _row_min(kl, nj, one)
                    mt = _pair_logit(kmin, kappa)  # the tile's max logit (x = -kl/kappa is monotone)
                    for jj in range(nj):
                        xs[jj] = _pair_logit(kl[jj], kappa) - mt
                    _exp_row(xs, nj, es)
                    if diag:
                        es[dj] = zero
                    st, tt = zero, zero
                    for jj in range(nj):
                        st += es[jj]
                        tt += es[jj] * kl[jj]
                    mr[ii], sr[ii], tr[ii] = _lse_merge(
                        mr[ii], sr[ii], tr[ii], np.float64(mt), np.float64(st), np.float64(tt)
                    )
            for ii in range(ni):
                i = i0 + ii
                erow[i] = _row_energy(mr[ii], sr[ii], tr[ii], np.float64(kappa), agg)
                m[i] = mr[ii]
                abar[i] = _row_abar(sr[ii], tr[ii])
                inv_s[i] = 1.0 / sr[ii] if sr[ii] != 0.0 else 0.0
                wsum[ii] = 0.0
                for d in range(D):
                    accA[ii, d] = 0.0
            # Sweep 2: ROW_GROUP receivers at a time, so that each load and store of the gB tile
            # accumulator (contiguous over senders: the loop vectorises) carries ROW_GROUP multiply-adds.
            for j0 in range(0, N, TS):
                nj = min(TS, N - j0)
                if sends:
                    for d in range(D):
                        for jj in range(nj):
                            accB[d, jj] = zero
                for g0 in range(0, ni, RB):
                    i = i0 + g0
                    _group_weights(
                        Ah, Bt, ch, i, ni - g0, r0 + i, j0, nj, m, inv_s, abar, kappa, agg, kl, xs, W
                    )  # fmt: skip
                    for r in range(min(RB, ni - g0)):
                        ws = zero
                        for jj in range(nj):
                            ws += W[r, jj]
                        wsum[g0 + r] += ws
                    last = min(i0 + ni - 1, i + RB - 1)  # padding rows of W are 0: any valid Ah row does
                    for d in range(D):
                        # gA_i += W_i,tile . B_tile for four receivers at once (one load of Bt per four).
                        b0, b1, b2, b3 = zero, zero, zero, zero
                        brow = Bt[d, j0 : j0 + nj]
                        for jj in range(nj):
                            bt = brow[jj]
                            b0 += W[0, jj] * bt
                            b1 += W[1, jj] * bt
                            b2 += W[2, jj] * bt
                            b3 += W[3, jj] * bt
                        accA[g0, d] += b0
                        if g0 + 1 < ni:
                            accA[g0 + 1, d] += b1
                        if g0 + 2 < ni:
                            accA[g0 + 2, d] += b2
                        if g0 + 3 < ni:
                            accA[g0 + 3, d] += b3
                        if sends:
                            _add_group(accB, W, Ah, i, last, d, nj)
                if sends:
                    for d in range(D):
                        part = gBp[c, d, j0 : j0 + nj]
                        for jj in range(nj):
                            part[jj] += accB[d, jj]
            for ii in range(ni):
                gc[i0 + ii] = wsum[ii]
                for d in range(D):
                    gA[i0 + ii, d] = accA[ii, d]


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)
def _tiled_senders(Ah, Bt, ch, r0, kappa, agg, m, inv_s, abar, gB):
    """Sender pass of the tiled path given the receivers' row statistics (serial): gB (n_s, D) float64,
    gB_j = sum_i W_ij Ah_i over every receiver i (rows of Ah, ch with statistics m, inv_s, abar from
    _dense_chunks; global index r0 + i) for the senders j, the columns of Bt (D, n_s); the pair with
    sender r0 + i is excluded (r0 may be negative: -s0 for senders s0 .. s0 + n_s - 1 of all agents).
    The weights are those of _dense_chunks' sweep 2 (_row_weights) and gB sums them as its gB share
    does: per sender tile, receiver tiles of RECEIVER_TILE in the dtype, added in float64 in ascending
    order."""
    NR, D = Ah.shape
    NS = Bt.shape[1]
    TR, TS, RB = RECEIVER_TILE, SENDER_TILE, ROW_GROUP
    dt = Ah.dtype
    zero = kappa - kappa
    kl, xs = np.empty(TS, dt), np.empty(TS, dt)
    W = np.empty((RB, TS), dt)
    accB = np.empty((D, TS), dt)
    acc = np.zeros((D, TS))
    for j0 in range(0, NS, TS):
        nj = min(TS, NS - j0)
        for d in range(D):
            for jj in range(nj):
                acc[d, jj] = 0.0
        for i0 in range(0, NR, TR):
            ni = min(TR, NR - i0)
            for d in range(D):
                for jj in range(nj):
                    accB[d, jj] = zero
            for g0 in range(0, ni, RB):
                i = i0 + g0
                _group_weights(Ah, Bt, ch, i, ni - g0, r0 + i, j0, nj, m, inv_s, abar, kappa, agg, kl, xs, W)
                last = min(i0 + ni - 1, i + RB - 1)  # padding rows of W are 0: any valid Ah row does
                for d in range(D):
                    _add_group(accB, W, Ah, i, last, d, nj)
            for d in range(D):
                for jj in range(nj):
                    acc[d, jj] += accB[d, jj]
        for jj in range(nj):
            for d in range(D):
                gB[j0 + jj, d] = acc[d, jj]


@numba.njit(nogil=True, cache=True)
def _sum_chunks(gBp, gB):
    """gB[j, d] = sum over chunks c (ascending) of gBp[c, d, j] (summed in place into gBp[0]), rounded to
    gB's dtype."""
    P, D, N = gBp.shape
    for c in range(1, P):
        for d in range(D):
            acc, part = gBp[0, d], gBp[c, d]
            for j in range(N):
                acc[j] += part[j]
    for j in range(N):
        for d in range(D):
            gB[j, d] = gBp[0, d, j]


def _serial_copy(kernel):
    """A non-parallel build of a kernel (prange runs as range). The copy gets its own qualname: Numba's
    on-disk cache is keyed by it and does not tell parallel from serial builds. The two builds may
    vectorise the reassociated sums differently (rounding-level differences); which one runs depends
    only on (N, D), never on the thread count, so results stay reproducible."""
    f = kernel.py_func
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial", f.__defaults__, f.__closure__)
    g.__qualname__ = f.__qualname__ + "_serial"
    return numba.njit(nogil=True, cache=True, fastmath=_FASTMATH)(g)


# Serial builds for small problems, where waking the thread pool costs more than the work.
_dense_chunks_serial = _serial_copy(_dense_chunks)
# Pair-feature products (N^2 D) below which the serial kernels run.
SERIAL_WORK = 1 << 21


def chunks(N: int, D: int) -> int:
    """Receiver chunks of the tiled path: work for MAX_CHUNKS threads, each chunk holding a float64
    partial gB (D, N). A function of (N, D) only: the thread count must not change the summation order,
    and so not a single rounding."""
    blocks = -(-N // RECEIVER_TILE)
    return int(max(1, min(MAX_CHUNKS, blocks, CHUNK_BYTES // (8 * D * N))))


def _prepare(A, B, c, kappa):
    dt = np.result_type(A.dtype, B.dtype, c.dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"features must be float32 or float64, got {dt}")
    # Halving is exact (a power of two): KL_ij = Ah_i . B_j + ch_i equals 1/2 (A_i . B_j + c_i) bitwise.
    Ah = np.ascontiguousarray(A, dt) * dt.type(0.5)
    ch = np.ascontiguousarray(c, dt) * dt.type(0.5)
    B = np.ascontiguousarray(B, dt)
    return dt, Ah, B, ch, dt.type(kappa)


# The BLAS path (D >= DOT_MIN_D). Tiles of T x T pairs with T^2 D <= BLAS_SERIAL_MNK: OpenBLAS runs a gemm
# of m n k <= 65536 * 4 (its GEMM_MULTITHREAD_THRESHOLD) on the calling thread, and only then does an
# element's rounding not depend on OpenBLAS's thread count (with 2 threads it splits larger products
# and rounds the edge rows of each part differently: measured, 1e-13 differences). T = 32 at D = 253.
BLAS_SERIAL_MNK = 1 << 18


def blas_tile(D: int) -> int:
    """Receivers and senders per BLAS tile: a function of D only."""
    return int(max(1, min(64, np.sqrt(BLAS_SERIAL_MNK // D))))


@_inline
def _dot_tile(X, i0, ni, Y, j0, nj, flat):
    """X[i0:i0+ni] @ Y[j0:j0+nj]^T as a (ni, nj) view of the scratch ``flat`` (one single-threaded gemm)."""
    out = flat[: ni * nj].reshape((ni, nj))
    np.dot(X[i0 : i0 + ni], Y[j0 : j0 + nj].T, out)
    return out


@_kernel
def _blas_receivers(Ah, B, ch, r0, kappa, one, agg, T, m, inv_s, abar, erow, gA, gc):
    """Per block of T receivers (parallel): the whole KL rows by (T, T) gemm tiles, exact row statistics,
    the weights, gc = sum_j W_ij and gA = sum_j W_ij B_j (gemm tiles accumulated in ascending j).
    Receivers: the rows of Ah (n_r, D), global agents r0 + i; senders: all rows of B (N, D)."""
    NR, D = Ah.shape
    N = B.shape[0]
    nblk = (NR + T - 1) // T
    for b in numba.prange(nblk):
        i0 = b * T
        ni = min(T, NR - i0)
        slab = np.empty((ni, N), Ah.dtype)
        flat = np.empty(T * max(T, D), Ah.dtype)
        wt = np.empty((ni, T), Ah.dtype)
        xs, es = np.empty(N, Ah.dtype), np.empty(N, Ah.dtype)
        zero = one - one
        for j0 in range(0, N, T):
            nj = min(T, N - j0)
            t = _dot_tile(Ah, i0, ni, B, j0, nj, flat)
            for ii in range(ni):
                ci = ch[i0 + ii]
                for jj in range(nj):
                    slab[ii, j0 + jj] = t[ii, jj] + ci
        for ii in range(ni):
            i = i0 + ii
            gi = r0 + i
            row = slab[ii]
            kmin = row[1] if gi == 0 else row[0]
            for j in range(gi):
                kmin = min(kmin, row[j])
            for j in range(gi + 1, N):
                kmin = min(kmin, row[j])
            mi = _pair_logit(kmin, kappa)
            for j in range(N):
                xs[j] = _pair_logit(row[j], kappa) - mi
            _exp_row(xs, N, es)
            es[gi] = zero
            si, ti = zero, zero
            for j in range(N):
                si += es[j]
                ti += es[j] * row[j]
            erow[i] = _row_energy(mi, si, ti, kappa, agg)
            ai = _row_abar(si, ti)
            isi = one / si
            m[i], inv_s[i], abar[i] = mi, isi, ai
            ws = zero
            for j in range(N):
                w = _pair_weight_e(es[j], row[j], isi, ai, kappa, agg)
                row[j] = w
                ws += w
            row[gi] = zero  # already 0 (es[gi] = 0); this also clears a -0
            gc[i] = ws
        acc = np.zeros((ni, D), Ah.dtype)
        for j0 in range(0, N, T):
            nj = min(T, N - j0)
            w = wt[:, :nj].copy() if nj < T else wt
            for ii in range(ni):
                for jj in range(nj):
                    w[ii, jj] = slab[ii, j0 + jj]
            prod = flat[: ni * D].reshape((ni, D))
            np.dot(w, B[j0 : j0 + nj], prod)
            for ii in range(ni):
                for d in range(D):
                    acc[ii, d] += prod[ii, d]
        gA[i0 : i0 + ni] = acc


@_kernel
def _blas_senders(Ah, B, ch, r0, kappa, agg, T, m, inv_s, abar, gB):
    """Per block of T senders (parallel): gB_j = sum_i W_ij Ah_i over receiver tiles in ascending i. The
    KL tiles are the same gemm calls as in _blas_receivers, so the same values bit for bit. Receivers and
    senders as in _blas_receivers: gB (N, D) is these receivers' share."""
    NR, D = Ah.shape
    N = B.shape[0]
    nblk = (N + T - 1) // T
    for b in numba.prange(nblk):
        j0 = b * T
        nj = min(T, N - j0)
        flat = np.empty(T * max(T, D), Ah.dtype)
        wt = np.empty((nj, T), Ah.dtype)
        xs, es = np.empty(T, Ah.dtype), np.empty(T, Ah.dtype)
        acc = np.zeros((nj, D), Ah.dtype)
        for i0 in range(0, NR, T):
            ni = min(T, NR - i0)
            t = _dot_tile(Ah, i0, ni, B, j0, nj, flat)
            w = wt[:, :ni].copy() if ni < T else wt
            for ii in range(ni):
                i = i0 + ii
                gi = r0 + i
                ci, mi, isi, ai = ch[i], m[i], inv_s[i], abar[i]
                for jj in range(nj):
                    xs[jj] = _pair_logit(t[ii, jj] + ci, kappa) - mi
                _exp_row(xs, nj, es)
                for jj in range(nj):
                    w[jj, ii] = _pair_weight_e(es[jj], t[ii, jj] + ci, isi, ai, kappa, agg)
                if j0 <= gi < j0 + nj:
                    w[gi - j0, ii] = w[gi - j0, ii] - w[gi - j0, ii]
            prod = flat[: nj * D].reshape((nj, D))
            np.dot(w, Ah[i0 : i0 + ni], prod)
            for jj in range(nj):
                for d in range(D):
                    acc[jj, d] += prod[jj, d]
        gB[j0 : j0 + nj] = acc


_blas_receivers_serial = _serial_copy(_blas_receivers)
_blas_senders_serial = _serial_copy(_blas_senders)


def _dense_blas(Ah, B, ch, r0, kappa, agg, dt, serial):
    """Long features (D >= DOT_MIN_D): KL tiles and the gA / gB products as (T, T) gemm calls (np.dot in
    Numba calls SciPy's BLAS), softmax and weights in Numba. Sweep 1 holds whole KL rows per block of T
    receivers (memory threads * T * N), so it needs no online log-sum-exp and no second KL pass; sweep
    2 recomputes the tiles per sender block for gB. 3 passes of N^2 D at gemm speed, against 5 passes
    of 2-3 FMA/cycle dot products in the tiled kernels. Receivers: rows of Ah (global r0 + i); senders:
    all rows of B. Returns (erow, gA, gB, gc) with gA, gc not yet halved."""
    NR, D = Ah.shape
    T = blas_tile(D)
    m, inv_s, abar, erow, gc = (np.empty(NR, dt) for _ in range(5))
    gA = np.empty((NR, D), dt)
    gB = np.empty(B.shape, dt)
    recv, send = (
        (_blas_receivers_serial, _blas_senders_serial) if serial else (_blas_receivers, _blas_senders)
    )
    recv(Ah, B, ch, r0, kappa, dt.type(1), agg, T, m, inv_s, abar, erow, gA, gc)
    send(Ah, B, ch, r0, kappa, agg, T, m, inv_s, abar, gB)
    return erow, gA, gB, gc


def range_error(side: str, start: int, n: int, N: int) -> str:
    """The message for a receiver or sender range that is not one of the N agents."""
    first, other = ("r0", "senders") if side == "receivers" else ("s0", "receivers")
    return f"{side} {first}={start} .. {start + n - 1} are not agents of the {N} {other}"


def pairwise_dense(A, B, c, kappa: float, aggregator: str):
    """All pairs j != i. A, B (N, D), c (N,) -> (E, gA (N, D), gB (N, D), gc (N,)); see module doc."""
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B, ch, kappa = _prepare(A, B, c, kappa)
    N, D = Ah.shape
    gA = np.zeros((N, D), dt)
    gB = np.zeros((N, D), dt)
    gc = np.zeros(N, dt)
    if N < 2:
        return 0.0, gA, gB, gc
    if D >= DOT_MIN_D:
        erow, gA, gB, gc = _dense_blas(Ah, B, ch, 0, kappa, agg, dt, N * N * D < SERIAL_WORK)
        gA *= dt.type(0.5)
        gc *= dt.type(0.5)
        return float(erow.sum(dtype=np.float64)), gA, gB, gc
    Bt = np.ascontiguousarray(B.T)
    m, inv_s, abar = np.empty(N, dt), np.empty(N, dt), np.empty(N, dt)
    erow, gc64 = np.empty(N), np.empty(N)
    gA64 = np.empty((N, D))
    P = chunks(N, D)
    gBp = np.zeros((P, D, N))
    kernel = _dense_chunks_serial if N * N * D < SERIAL_WORK else _dense_chunks
    kernel(Ah, B, Bt, ch, 0, kappa, agg, P, m, inv_s, abar, erow, gA64, gc64, True, gBp)
    gB = np.empty((N, D), dt)
    _sum_chunks(gBp, gB)
    # The halvings are exact; the float64 sums are rounded to the dtype once, here.
    return float(erow.sum()), (0.5 * gA64).astype(dt), gB, (0.5 * gc64).astype(dt)


def _receiver_range(A_r, B, c_r, r0: int, kappa: float):
    """:func:`_prepare` of receivers r0 .. r0 + n_r - 1 against every sender B (N, D), the range checked:
    (dtype, Ah, B, ch, kappa, n_r, D, N)."""
    dt, Ah, B, ch, kappa = _prepare(A_r, B, c_r, kappa)
    NR, D = Ah.shape
    N = B.shape[0]
    if not (0 <= r0 and r0 + NR <= N):
        raise ValueError(range_error("receivers", r0, NR, N))
    return dt, Ah, B, ch, kappa, NR, D, N


def pairwise_dense_rows(A_r, c_r, B, r0: int, kappa: float, aggregator: str):
    """One receiver range against all senders, j != i: the unit of work of a scheduler task.

    A_r (n_r, D), c_r (n_r,): receivers r0 .. r0 + n_r - 1 (global agent indices); B (N, D): every
    sender. Returns (erow (n_r,) float64 row energies, gA_r (n_r, D) and gc_r (n_r,) in the input dtype,
    gB_part (N, D) float64: these receivers' share of gB). The full gB is the sum of the shares over
    receiver ranges, taken in a fixed order and rounded to the dtype once.

    Runs the serial builds only (``nogil``): the scheduler's threads or processes are the parallelism,
    and Numba's parallel kernels must not be launched from inside them. Per receiver, the sums are those
    of :func:`pairwise_dense` (sender tiles at the same global offsets); gB's grouping over receivers,
    and on the BLAS path (D >= DOT_MIN_D) the gemm tile boundaries, follow the range, which changes
    results by rounding only.
    """
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B, ch, kappa, NR, D, N = _receiver_range(A_r, B, c_r, r0, kappa)
    if N < 2 or NR == 0:
        return np.zeros(NR), np.zeros((NR, D), dt), np.zeros(NR, dt), np.zeros((N, D))
    if D >= DOT_MIN_D:
        erow, gA, gB, gc = _dense_blas(Ah, B, ch, r0, kappa, agg, dt, True)
        return erow.astype(np.float64), gA * dt.type(0.5), gc * dt.type(0.5), gB.astype(np.float64)
    Bt = np.ascontiguousarray(B.T)
    m, inv_s, abar = np.empty(NR, dt), np.empty(NR, dt), np.empty(NR, dt)
    erow, gc64 = np.empty(NR), np.empty(NR)
    gA64 = np.empty((NR, D))
    gBp = np.zeros((1, D, N))
    _dense_chunks_serial(Ah, B, Bt, ch, r0, kappa, agg, 1, m, inv_s, abar, erow, gA64, gc64, True, gBp)
    return erow, (0.5 * gA64).astype(dt), (0.5 * gc64).astype(dt), np.ascontiguousarray(gBp[0].T)


def pairwise_dense_receivers(A_r, c_r, B, r0: int, kappa: float, aggregator: str):
    """Pass 1 of a two-pass split of the dense pairs (a scheduler task per receiver range): receivers
    r0 .. r0 + n_r - 1 (A_r (n_r, D), c_r (n_r,)) against every sender B (N, D), j != i, without any gB.

    Returns (erow (n_r,) float64, gA_r (n_r, D), gc_r (n_r,) in the input dtype, m, inv_s, abar (n_r,):
    the receivers' row statistics in the input dtype). :func:`pairwise_dense_senders` turns every
    receiver's statistics into the senders' gB. erow, gA_r, gc_r are those of :func:`pairwise_dense_rows`
    (the same kernels); serial builds only (``nogil``), as there. Memory O(n_r D + N D): no (N, D) share.
    """
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B, ch, kappa, NR, D, N = _receiver_range(A_r, B, c_r, r0, kappa)
    m, inv_s, abar = np.zeros(NR, dt), np.zeros(NR, dt), np.zeros(NR, dt)
    if N < 2 or NR == 0:
        return np.zeros(NR), np.zeros((NR, D), dt), np.zeros(NR, dt), m, inv_s, abar
    if D >= DOT_MIN_D:
        erow, gc = np.empty(NR, dt), np.empty(NR, dt)
        gA = np.empty((NR, D), dt)
        T = blas_tile(D)
        _blas_receivers_serial(Ah, B, ch, r0, kappa, dt.type(1), agg, T, m, inv_s, abar, erow, gA, gc)
        return erow.astype(np.float64), gA * dt.type(0.5), gc * dt.type(0.5), m, inv_s, abar
    Bt = np.ascontiguousarray(B.T)
    erow, gc64 = np.empty(NR), np.empty(NR)
    gA64 = np.empty((NR, D))
    none = np.zeros((1, D, 0))
    _dense_chunks_serial(Ah, B, Bt, ch, r0, kappa, agg, 1, m, inv_s, abar, erow, gA64, gc64, False, none)
    return erow, (0.5 * gA64).astype(dt), (0.5 * gc64).astype(dt), m, inv_s, abar


def pairwise_dense_senders(A, c, m, inv_s, abar, B_s, s0: int, kappa: float, aggregator: str):
    """Pass 2 of the two-pass split (a scheduler task per sender range): gB of senders s0 .. s0 + n_s - 1
    (B_s (n_s, D)) from every receiver's A (N, D), c (N,) and row statistics m, inv_s, abar (N,) (pass
    1's, :func:`pairwise_dense_receivers`, over any receiver ranges). Returns gB_s (n_s, D) float64: the
    sum over all receivers i != j of W_ij A_i / 2 in a fixed order (receiver tiles in ascending order;
    on the BLAS path gemm tiles, summed in the dtype). Serial builds only (``nogil``)."""
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B_s, ch, kappa = _prepare(A, B_s, c, kappa)
    N, D = Ah.shape
    NS = B_s.shape[0]
    if not (0 <= s0 and s0 + NS <= N):
        raise ValueError(range_error("senders", s0, NS, N))
    if not (m.shape == inv_s.shape == abar.shape == (N,)):
        raise ValueError(f"row statistics m, inv_s, abar must have shape ({N},) (one per receiver)")
    m, inv_s, abar = (np.ascontiguousarray(a, dt) for a in (m, inv_s, abar))
    gB = np.zeros((NS, D))
    if N < 2 or NS == 0:
        return gB
    # Receivers are all agents and senders a range: receiver i meets itself as sender i - s0, which is
    # what a receiver offset of -s0 says (global receiver index r0 + i compared with the local sender).
    if D >= DOT_MIN_D:
        gBd = np.empty((NS, D), dt)
        _blas_senders_serial(Ah, B_s, ch, -s0, kappa, agg, blas_tile(D), m, inv_s, abar, gBd)
        return gBd.astype(np.float64)
    _tiled_senders(Ah, np.ascontiguousarray(B_s.T), ch, -s0, kappa, agg, m, inv_s, abar, gB)
    return gB


@_kernel
def _sparse_receivers(Ah, B, ch, index, mask, kappa, one, ninf, agg, erow, W, gA, gc):
    """Per receiver over its list: statistics, row energy, W (N, k), gA = sum W B_j, gc = sum W."""
    N, k = index.shape
    for i in numba.prange(N):
        zero = one - one
        mi, si, ti = ninf, zero, zero
        for q in range(k):
            if mask[i, q]:
                kl = _pair_kl(Ah, i, B, index[i, q], ch)
                W[i, q] = kl
                mi, si, ti = _lse_push(mi, si, ti, _pair_logit(kl, kappa), kl)
        erow[i] = _row_energy(mi, si, ti, kappa, agg)
        if si == zero:
            continue
        ai = _row_abar(si, ti)
        isi = one / si
        wsum = zero
        for q in range(k):
            if mask[i, q]:
                w = _pair_weight(W[i, q], mi, isi, ai, kappa, agg)
                W[i, q] = w
                wsum += w
                _accumulate_row(gA, i, w, B, index[i, q])
        gc[i] = wsum


@_serial
def incoming_csr(index, mask, n_senders):
    """Reverse index by a stable counting sort: entries of sender j < n_senders are flat[ptr[j]:ptr[j+1]]
    (flat positions i * k + q of the (N, k) lists), in ascending receiver order."""
    N, k = index.shape
    ptr = np.zeros(n_senders + 1, np.int64)
    for i in range(N):
        for q in range(k):
            if mask[i, q]:
                ptr[index[i, q] + 1] += 1
    for j in range(n_senders):
        ptr[j + 1] += ptr[j]
    cur = ptr[:-1].copy()
    flat = np.empty(ptr[n_senders], np.int64)
    for i in range(N):
        for q in range(k):
            if mask[i, q]:
                j = index[i, q]
                flat[cur[j]] = i * k + q
                cur[j] += 1
    return ptr, flat


@_kernel
def _sparse_senders(Ah, W, k, ptr, flat, gB):
    """gB_j = sum over receivers i listing j (ascending) of W_iq Ah_i; W flattened (N * k,), gB (n_s, D)."""
    for j in numba.prange(gB.shape[0]):
        for e in range(ptr[j], ptr[j + 1]):
            p = flat[e]
            _accumulate_row(gB, j, W[p], Ah, p // k)


_sparse_receivers_serial = _serial_copy(_sparse_receivers)
_sparse_senders_serial = _serial_copy(_sparse_senders)


def _sparse(A, B, c, index, mask, kappa: float, aggregator: str, serial: bool):
    """Receivers A (N, D), c (N,) with lists index/mask (N, k) into the rows of B (n_s, D) ->
    (erow, gA, gB (n_s, D), gc) in the input dtype; gA, gc halved."""
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B, ch, kappa = _prepare(A, B, c, kappa)
    N, D = Ah.shape
    index = np.ascontiguousarray(index, np.int64)
    mask = np.ascontiguousarray(mask, np.bool_)
    if index.shape != mask.shape or index.ndim != 2 or index.shape[0] != N:
        raise ValueError(f"index/mask must both be (N={N}, k), got {index.shape} and {mask.shape}")
    k = index.shape[1]
    gA = np.zeros((N, D), dt)
    gB = np.zeros(B.shape, dt)
    gc = np.zeros(N, dt)
    erow = np.zeros(N, dt)
    W = np.zeros((N, k), dt)
    if k > 0:
        recv, send = (
            (_sparse_receivers_serial, _sparse_senders_serial)
            if serial
            else (_sparse_receivers, _sparse_senders)
        )
        recv(Ah, B, ch, index, mask, kappa, dt.type(1), dt.type(-np.inf), agg, erow, W, gA, gc)
        ptr, flat = incoming_csr(index, mask, B.shape[0])
        send(Ah, W.reshape(-1), k, ptr, flat, gB)
    gA *= dt.type(0.5)
    gc *= dt.type(0.5)
    return erow, gA, gB, gc


def pairwise_sparse(A, B, c, index, mask, kappa: float, aggregator: str):
    """Fixed-width neighbour lists index/mask (N, k) -> (E, gA, gB, gc); masked entries are ignored."""
    erow, gA, gB, gc = _sparse(A, B, c, index, mask, kappa, aggregator, False)
    return float(erow.sum(dtype=np.float64)), gA, gB, gc


def pairwise_sparse_rows(A_r, c_r, B_s, index, mask, kappa: float, aggregator: str):
    """Receivers A_r (n_r, D), c_r (n_r,) with lists index/mask (n_r, k) into the rows of B_s (n_s, D),
    a gathered subset of the senders (local row numbers): the unit of work of a scheduler task.

    Returns (erow (n_r,) float64, gA_r (n_r, D), gc_r (n_r,) in the input dtype, gB_part (n_s, D)
    float64: these receivers' share of the gathered senders' gB, each sender's sum over its receivers in
    ascending order). Serial kernels only (see :func:`pairwise_dense_rows`).
    """
    erow, gA, gB, gc = _sparse(A_r, B_s, c_r, index, mask, kappa, aggregator, True)
    return erow.astype(np.float64), gA, gc, gB.astype(np.float64)


@_kernel
def _points(
    Ah, B, ch, u, v, offsets, lists, rowmap, index, mask, kappa, one, ninf, agg, erow, gA, gB, gc, gu, gv
):
    """Per grid point p (parallel; every row of p, receiver or sender, is written by p's thread only):
    per receiver r, the weighted statistics over its senders at p (KLs kept in a k-row scratch), its
    energy, gu, then the weights: gA_r, gc_r and the senders' gB, gv in ascending r. Unhalved gA, gc."""
    P = offsets.shape[0] - 1
    k = index.shape[1]
    for p in numba.prange(P):
        zero = one - one
        kls = np.empty(k, Ah.dtype)
        snd = np.empty(k, np.int64)
        for r in range(offsets[p], offsets[p + 1]):
            li = lists[r]
            mi, si, ti, bi = ninf, zero, zero, zero
            n = 0
            for q in range(k):
                if mask[li, q]:
                    sr = rowmap[p, index[li, q]]
                    if sr >= 0:
                        kl = _pair_kl(Ah, r, B, sr, ch)
                        kls[n] = kl
                        snd[n] = sr
                        n += 1
                        mi, si, ti, bi = _lse_push_w(mi, si, ti, bi, _pair_logit(kl, kappa), kl, v[sr])
            ur = u[r]
            e1 = _row_unit_energy_w(mi, si, ti, bi, kappa, agg)
            erow[r] = ur * e1
            gu[r] = e1
            if si == zero:
                continue
            ab, bb, F = _row_means_w(mi, si, ti, bi, kappa)
            isi = one / si
            ws = zero
            for q in range(n):
                sr = snd[q]
                w, wv = _pair_weight_w(kls[q], v[sr], ur, mi, isi, ab, bb, F, kappa, agg)
                ws += w
                _accumulate_row(gA, r, w, B, sr)
                _accumulate_row(gB, sr, w, Ah, r)
                gv[sr] += wv
            gc[r] = ws


_points_serial = _serial_copy(_points)


def check_points(n_receivers: int, n_senders: int, offsets, lists, rowmap, index, mask) -> None:
    """ValueError naming the argument where a batched-pairs layout (see :func:`pairwise_points`) is
    inconsistent: shapes, ranges, and every sender row at one point only (host NumPy arrays)."""
    P = offsets.shape[0] - 1
    if (
        offsets.ndim != 1
        or P < 0
        or offsets[0] != 0
        or offsets[-1] != n_receivers
        or (np.diff(offsets) < 0).any()
    ):
        raise ValueError(f"offsets: must rise from 0 to the {n_receivers} receiver rows, (P + 1,)")
    if lists.shape != (n_receivers,) or (
        n_receivers and not (0 <= lists.min() and lists.max() < index.shape[0])
    ):
        raise ValueError(f"lists: must be ({n_receivers},) rows of index ({index.shape[0]} rows)")
    if index.ndim != 2 or mask.shape != index.shape:
        raise ValueError(f"index/mask must both be (n_lists, k), got {index.shape} and {mask.shape}")
    if rowmap.ndim != 2 or rowmap.shape[0] != P:
        raise ValueError(f"rowmap: must be (P={P}, n_agents), got {rowmap.shape}")
    listed = index[mask]
    if listed.size and not (0 <= listed.min() and listed.max() < rowmap.shape[1]):
        raise ValueError(f"index: listed agents must be columns 0 .. {rowmap.shape[1] - 1} of rowmap")
    rows = rowmap[rowmap >= 0]
    if rows.size and (rows.max() >= n_senders or np.bincount(rows, minlength=n_senders).max() > 1):
        raise ValueError(f"rowmap: each of the {n_senders} sender rows must appear at most once")


def pairwise_points(
    A, B, c, u, v, offsets, lists, rowmap, index, mask, kappa: float, aggregator: str, serial=None
):
    """Weighted pairs batched over grid points (the contract of
    :func:`vfesim.pairwise.weighted.pairwise_points_weighted`): receivers A (M_r, D), c, u (M_r,)
    point-major by ``offsets`` (P + 1,) with list rows ``lists`` (M_r,); senders B (M_s, D), v (M_s,)
    found through ``rowmap`` (P, n); neighbour agents index/mask (n_l, k).

    Returns (E, gA, gB, gc, gu, gv) in the input dtype (E a float). Parallel over points (serial builds
    when ``serial``, default: below SERIAL_WORK pair-feature products); each point's sums run in a fixed
    order on one thread, so results are bitwise reproducible and independent of the thread count.
    Memory: O((M_r + M_s) D + threads k).
    """
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B, ch, kappa = _prepare(A, B, c, kappa)
    u = np.ascontiguousarray(u, dt)
    v = np.ascontiguousarray(v, dt)
    offsets = np.ascontiguousarray(offsets, np.int64)
    lists = np.ascontiguousarray(lists, np.int64)
    rowmap = np.ascontiguousarray(rowmap, np.int64)
    index = np.ascontiguousarray(index, np.int64)
    mask = np.ascontiguousarray(mask, np.bool_)
    MR, D = Ah.shape
    MS = B.shape[0]
    if ch.shape != (MR,) or u.shape != (MR,) or v.shape != (MS,) or B.shape[1:] != (D,):
        raise ValueError(
            f"features: A (M_r, D), c and u (M_r,), B (M_s, D), v (M_s,); got A {Ah.shape}, c {ch.shape}, "
            f"u {u.shape}, B {B.shape}, v {v.shape}"
        )
    check_points(MR, MS, offsets, lists, rowmap, index, mask)
    erow = np.zeros(MR, dt)
    gA, gc, gu = np.zeros((MR, D), dt), np.zeros(MR, dt), np.zeros(MR, dt)
    gB, gv = np.zeros((MS, D), dt), np.zeros(MS, dt)
    if serial is None:
        serial = MR * index.shape[1] * D < SERIAL_WORK
    kernel = _points_serial if serial else _points
    one, ninf = dt.type(1), dt.type(-np.inf)
    kernel(
        Ah, B, ch, u, v, offsets, lists, rowmap, index, mask, kappa, one, ninf, agg, erow, gA, gB, gc, gu, gv
    )
    gA *= dt.type(0.5)
    gc *= dt.type(0.5)
    return float(erow.sum(dtype=np.float64)), gA, gB, gc, gu, gv
