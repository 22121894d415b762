"""Numba CPU kernels of the pairwise alignment energy and its adjoint, tiled and streaming (SPEC §2.3–2.4).

Same contract as ``vfesim.pairwise.reference.pairwise_dense`` / ``pairwise_sparse`` (without
``return_beta``): features A, B (N, D), c (N,) with KL_ij = 1/2 (A_i . B_j + c_i) ->
(E: Python float, gA (N, D), gB (N, D), gc (N,)), computed in the input dtype (float32 or float64).

Dense, three sweeps over (receiver tile) x (sender tile) blocks of the KL matrix, never holding more than
one tile per thread (peak memory O(N D + threads * tile^2), no N x N array):
  1. per receiver block (parallel): online log-sum-exp statistics (m, s, t) over sender tiles;
  2. the same receiver block, right after: recompute the tiles, W_ij, and accumulate gA_i, gc_i;
  3. per sender block (parallel): recompute the tiles and accumulate gB_j over receivers.
Long features (D >= DOT_MIN_D, e.g. D = 253 at K = 21) take the BLAS path instead (:func:`_dense_blas`):
the KL tiles and the gA / gB products are (T, T) gemm calls small enough that OpenBLAS runs each on the
calling thread; sweep 1 keeps whole KL rows of a receiver block (T x N per thread, so no online
log-sum-exp and no second KL pass) and sweep 2 recomputes tiles per sender block for gB.
Every per-receiver and per-sender sum runs in ascending index order within fixed-size tiles; no thread
shares an output row and there are no atomics, so results are bitwise identical run to run and do not
depend on Numba's or OpenBLAS's thread count. Sparse: per receiver over its (N, k) list; senders
through a CSC reverse index built by a stable counting sort, parallel over senders, each summing its
receivers in ascending order.

The scalar per-pair math (online LSE, weights) is :mod:`vfesim_kernels.pair_math`, compiled here with
``numba.njit(inline="always")``; only the tile loops are CPU-specific.
"""

from __future__ import annotations

import types

import numba
import numpy as np

from . import pair_math as _pm

__all__ = ["pairwise_dense", "pairwise_sparse", "SENDER_TILE", "RECEIVER_TILE"]

# Sender tile of sweeps 1-2. It fixes the grouping of the online log-sum-exp, so it is a constant (the
# results must not depend on the thread count). 256 columns x 32 rows of float64 = 64 KiB per thread.
SENDER_TILE = 256
# Receiver rows per tile (sweeps 1-3); it does not change any summation order.
RECEIVER_TILE = 32
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

_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_kernel = numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
_serial = numba.njit(nogil=True, cache=True)


# exp(x) for x <= 0 as Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a degree-13 Taylor polynomial
# (truncation < 2e-17) and 2^n assembled from its bits. Unlike math.exp (one libm call per element) the
# loops vectorise: 7.0 -> 1.9 ns per element, and the K = 3 sweeps drop from 12.4 / 10.6 to 9.0 / 7.0 ns
# per pair (one thread, N = 2048, on the 2-core machine of benchmarks/results/bench_energy_cpu.txt).
# Relative error vs np.exp < 5e-14 (tests/test_numba_backend.py). x is clamped to [-708, 0]:
# exp(-708) ~ 3e-308 stays a normal number, and it only ever adds to sums whose largest term is 1.
_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01  # trailing zeros: n * _LN2_HI is exact
_LN2_LO = 1.90821492927058770002e-10
_TWO52 = 4503599627370496  # 2^52: shifts a biased exponent into place


# No fastmath here: without contraction the vector body and the scalar remainder of the loop round
# identically, so exp(x) does not depend on the element's position in a tile.
@numba.njit(nogil=True, cache=True)
def _exp_row(x, n, out, nf, bits):
    """out[:n] = exp(x[:n]) for x <= 0 (out in x's dtype; nf float64 and bits int64 scratch)."""
    for k in range(n):
        v = np.float64(x[k])
        v = min(max(v, -708.0), 0.0)
        q = np.floor(v * _LOG2E + 0.5)
        r = (v - q * _LN2_HI) - q * _LN2_LO
        p = 1.0 / 6227020800.0
        p = p * r + 1.0 / 479001600.0
        p = p * r + 1.0 / 39916800.0
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
        nf[k] = p
        bits[k] = (np.int64(q) + 1023) * _TWO52
    two_n = bits.view(np.float64)
    for k in range(n):
        out[k] = nf[k] * two_n[k]


@_inline
def _kl_tile(Ah, B, Bt, ch, i0, ni, j0, nj, out):
    """out[ii, jj] = KL of receiver i0+ii and sender j0+jj: Ah[i] . B[j] + ch[i] (pair_math.pair_kl).

    Short rows (D < DOT_MIN_D): the inner loop runs over contiguous senders of the transposed Bt (D, N)
    and vectorises without reassociating any sum. Long rows: one dot product per pair over contiguous
    Ah[i] and B[j], vectorised by the kernels' reassoc flag (a fixed, deterministic order).
    """
    D = Ah.shape[1]
    if D >= DOT_MIN_D:
        for ii in range(ni):
            i = i0 + ii
            ci = ch[i]
            for jj in range(nj):
                j = j0 + jj
                acc = Ah[i, 0] * B[j, 0]
                for d in range(1, D):
                    acc += Ah[i, d] * B[j, d]
                out[ii, jj] = acc + ci
        return
    for ii in range(ni):
        i = i0 + ii
        a = Ah[i, 0]
        for jj in range(nj):
            out[ii, jj] = a * Bt[0, j0 + jj]
        for d in range(1, D):
            a = Ah[i, d]
            for jj in range(nj):
                out[ii, jj] += a * Bt[d, j0 + jj]
        a = ch[i]
        for jj in range(nj):
            out[ii, jj] += a


@_inline
def _weight_tile(kl, i0, ni, j0, nj, m, inv_s, abar, kappa, agg, xs, es, nf, bits):
    """kl (tile) -> W in place, with the receivers' row statistics; the diagonal i == j gets 0.

    xs, es (TS,) in the tile dtype and nf (TS,) float64, bits (TS,) int64 are per-thread scratch rows.
    """
    for ii in range(ni):
        i = i0 + ii
        mi, isi, ai = m[i], inv_s[i], abar[i]
        for jj in range(nj):
            xs[jj] = _pair_logit(kl[ii, jj], kappa) - mi
        _exp_row(xs, nj, es, nf, bits)
        for jj in range(nj):
            kl[ii, jj] = _pair_weight_e(es[jj], kl[ii, jj], isi, ai, kappa, agg)
        if j0 <= i < j0 + nj:
            kl[ii, i - j0] = kl[ii, i - j0] - kl[ii, i - j0]


@_kernel
def _dense_receivers(Ah, B, Bt, ch, kappa, one, ninf, agg, m, inv_s, abar, erow, gA, gc):
    """Sweeps 1-2 over receiver blocks: row statistics, row energies, gA = sum_j W_ij B_j, gc = sum_j W_ij."""
    N, D = Ah.shape
    TR, TS = RECEIVER_TILE, SENDER_TILE
    nblk = (N + TR - 1) // TR
    for b in numba.prange(nblk):
        i0 = b * TR
        ni = min(TR, N - i0)
        tile = np.empty((TR, TS), Ah.dtype)
        xs, es = np.empty(TS, Ah.dtype), np.empty(TS, Ah.dtype)
        nf, bits = np.empty(TS, np.float64), np.empty(TS, np.int64)
        zero = one - one
        for ii in range(ni):
            m[i0 + ii], inv_s[i0 + ii], abar[i0 + ii] = ninf, zero, zero
        # Sweep 1: online log-sum-exp per receiver, one sender tile at a time (tile max, then one merge).
        for j0 in range(0, N, TS):
            nj = min(TS, N - j0)
            _kl_tile(Ah, B, Bt, ch, i0, ni, j0, nj, tile)
            for ii in range(ni):
                i = i0 + ii
                # Columns [0, dj) and (dj, nj) skip the diagonal without a branch in the loops.
                lo, hi = (i - j0, i - j0 + 1) if j0 <= i < j0 + nj else (nj, nj)
                if lo == 0 and hi == nj:
                    continue  # only the diagonal in this tile
                kmin = tile[ii, 0] if lo > 0 else tile[ii, hi]
                for jj in range(lo):
                    kmin = min(kmin, tile[ii, jj])
                for jj in range(hi, nj):
                    kmin = min(kmin, tile[ii, jj])
                mt = _pair_logit(kmin, kappa)  # the tile's max logit (x = -kl/kappa is monotone)
                for jj in range(nj):
                    xs[jj] = _pair_logit(tile[ii, jj], kappa) - mt
                _exp_row(xs, nj, es, nf, bits)
                if hi > lo:
                    es[lo] = zero  # the diagonal
                st, tt = zero, zero
                for jj in range(nj):
                    st += es[jj]
                    tt += es[jj] * tile[ii, jj]
                # m, inv_s, abar hold (m, s, t) until the sweep ends.
                m[i], inv_s[i], abar[i] = _lse_merge(m[i], inv_s[i], abar[i], mt, st, tt)
        for ii in range(ni):
            i = i0 + ii
            mi, si, ti = m[i], inv_s[i], abar[i]
            erow[i] = _row_energy(mi, si, ti, kappa, agg)
            abar[i] = _row_abar(si, ti)
            inv_s[i] = one / si if si != zero else zero
        # Sweep 2: recompute tiles, turn them into weights, accumulate gA and gc per receiver.
        acc = np.zeros((TR, D), Ah.dtype)
        wsum = np.zeros(TR, Ah.dtype)
        for j0 in range(0, N, TS):
            nj = min(TS, N - j0)
            _kl_tile(Ah, B, Bt, ch, i0, ni, j0, nj, tile)
            _weight_tile(tile, i0, ni, j0, nj, m, inv_s, abar, kappa, agg, xs, es, nf, bits)
            for ii in range(ni):
                ws = tile[ii, 0]
                for jj in range(1, nj):
                    ws += tile[ii, jj]
                wsum[ii] += ws
            # gA_i += W_i,tile . Bt[:, tile]: contiguous dots, vectorised by the reassoc flag (fixed order).
            for ii in range(ni):
                for d in range(D):
                    dot = tile[ii, 0] * Bt[d, j0]
                    for jj in range(1, nj):
                        dot += tile[ii, jj] * Bt[d, j0 + jj]
                    acc[ii, d] += dot
        for ii in range(ni):
            gc[i0 + ii] = wsum[ii]
            for d in range(D):
                gA[i0 + ii, d] = acc[ii, d]


@_kernel
def _dense_senders(Ah, B, Bt, ch, kappa, agg, m, inv_s, abar, TSB, gB):
    """Sweep 3 over sender blocks of TSB: gB_j = sum_i W_ij Ah_i (= 1/2 sum_i W_ij A_i), i ascending."""
    N, D = Ah.shape
    TR = RECEIVER_TILE
    nblk = (N + TSB - 1) // TSB
    for b in numba.prange(nblk):
        j0 = b * TSB
        nj = min(TSB, N - j0)
        tile = np.empty((TR, TSB), Ah.dtype)
        xs, es = np.empty(TSB, Ah.dtype), np.empty(TSB, Ah.dtype)
        nf, bits = np.empty(TSB, np.float64), np.empty(TSB, np.int64)
        acc = np.zeros((D, TSB), Ah.dtype)  # gB^T of the block: the update below runs over senders
        for i0 in range(0, N, TR):
            ni = min(TR, N - i0)
            _kl_tile(Ah, B, Bt, ch, i0, ni, j0, nj, tile)
            _weight_tile(tile, i0, ni, j0, nj, m, inv_s, abar, kappa, agg, xs, es, nf, bits)
            for ii in range(ni):
                for d in range(D):
                    a = Ah[i0 + ii, d]
                    for jj in range(nj):
                        acc[d, jj] += tile[ii, jj] * a
        for jj in range(nj):
            for d in range(D):
                gB[j0 + jj, d] = acc[d, jj]


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
_dense_receivers_serial = _serial_copy(_dense_receivers)
_dense_senders_serial = _serial_copy(_dense_senders)
# Pair-feature products (N^2 D) below which the serial kernels run.
SERIAL_WORK = 1 << 21


def _sender_block(N: int) -> int:
    """Senders per block of sweep 3: N / 16 in [8, SENDER_TILE] (work for 16 threads). A function of N
    only: the thread count must not change the tiling, and so not a single rounding."""
    return int(min(SENDER_TILE, max(8, -(-N // 16))))


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
def _blas_receivers(Ah, B, ch, kappa, one, agg, T, m, inv_s, abar, erow, gA, gc):
    """Per block of T receivers (parallel): the whole KL rows by (T, T) gemm tiles, exact row statistics,
    the weights, gc = sum_j W_ij and gA = sum_j W_ij B_j (gemm tiles accumulated in ascending j)."""
    N, D = Ah.shape
    nblk = (N + T - 1) // T
    for b in numba.prange(nblk):
        i0 = b * T
        ni = min(T, N - i0)
        slab = np.empty((ni, N), Ah.dtype)
        flat = np.empty(T * max(T, D), Ah.dtype)
        wt = np.empty((ni, T), Ah.dtype)
        xs, es = np.empty(N, Ah.dtype), np.empty(N, Ah.dtype)
        nf, bits = np.empty(N, np.float64), np.empty(N, np.int64)
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
            row = slab[ii]
            kmin = row[1] if i == 0 else row[0]
            for j in range(i):
                kmin = min(kmin, row[j])
            for j in range(i + 1, N):
                kmin = min(kmin, row[j])
            mi = _pair_logit(kmin, kappa)
            for j in range(N):
                xs[j] = _pair_logit(row[j], kappa) - mi
            _exp_row(xs, N, es, nf, bits)
            es[i] = zero
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
            row[i] = zero  # already 0 (es[i] = 0); this also clears a -0
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
def _blas_senders(Ah, B, ch, kappa, agg, T, m, inv_s, abar, gB):
    """Per block of T senders (parallel): gB_j = sum_i W_ij Ah_i over receiver tiles in ascending i. The
    KL tiles are the same gemm calls as in _blas_receivers, so the same values bit for bit."""
    N, D = Ah.shape
    nblk = (N + T - 1) // T
    for b in numba.prange(nblk):
        j0 = b * T
        nj = min(T, N - j0)
        flat = np.empty(T * max(T, D), Ah.dtype)
        wt = np.empty((nj, T), Ah.dtype)
        xs, es = np.empty(T, Ah.dtype), np.empty(T, Ah.dtype)
        nf, bits = np.empty(T, np.float64), np.empty(T, np.int64)
        acc = np.zeros((nj, D), Ah.dtype)
        for i0 in range(0, N, T):
            ni = min(T, N - i0)
            t = _dot_tile(Ah, i0, ni, B, j0, nj, flat)
            w = wt[:, :ni].copy() if ni < T else wt
            for ii in range(ni):
                i = i0 + ii
                ci, mi, isi, ai = ch[i], m[i], inv_s[i], abar[i]
                for jj in range(nj):
                    xs[jj] = _pair_logit(t[ii, jj] + ci, kappa) - mi
                _exp_row(xs, nj, es, nf, bits)
                for jj in range(nj):
                    w[jj, ii] = _pair_weight_e(es[jj], t[ii, jj] + ci, isi, ai, kappa, agg)
                if j0 <= i < j0 + nj:
                    w[i - j0, ii] = w[i - j0, ii] - w[i - j0, ii]
            prod = flat[: nj * D].reshape((nj, D))
            np.dot(w, Ah[i0 : i0 + ni], prod)
            for jj in range(nj):
                for d in range(D):
                    acc[jj, d] += prod[jj, d]
        gB[j0 : j0 + nj] = acc


_blas_receivers_serial = _serial_copy(_blas_receivers)
_blas_senders_serial = _serial_copy(_blas_senders)


def _dense_blas(Ah, B, ch, kappa, agg, dt):
    """Long features (D >= DOT_MIN_D): KL tiles and the gA / gB products as (T, T) gemm calls (np.dot in
    Numba calls SciPy's BLAS), softmax and weights in Numba. Sweep 1 holds whole KL rows per block of T
    receivers (memory threads * T * N), so it needs no online log-sum-exp and no second KL pass; sweep
    2 recomputes the tiles per sender block for gB. 3 passes of N^2 D at gemm speed, against 5 passes
    of 2-3 FMA/cycle dot products in the tiled kernels."""
    N, D = Ah.shape
    T = blas_tile(D)
    m, inv_s, abar, erow, gc = (np.empty(N, dt) for _ in range(5))
    gA = np.empty((N, D), dt)
    gB = np.empty((N, D), dt)
    serial = N * N * D < SERIAL_WORK
    recv, send = (
        (_blas_receivers_serial, _blas_senders_serial) if serial else (_blas_receivers, _blas_senders)
    )
    recv(Ah, B, ch, kappa, dt.type(1), agg, T, m, inv_s, abar, erow, gA, gc)
    send(Ah, B, ch, kappa, agg, T, m, inv_s, abar, gB)
    return erow, gA, gB, gc


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
        erow, gA, gB, gc = _dense_blas(Ah, B, ch, kappa, agg, dt)
        gA *= dt.type(0.5)
        gc *= dt.type(0.5)
        return float(erow.sum(dtype=np.float64)), gA, gB, gc
    Bt = np.ascontiguousarray(B.T)
    m = np.empty(N, dt)
    inv_s = np.empty(N, dt)
    abar = np.empty(N, dt)
    erow = np.empty(N, dt)
    serial = N * N * D < SERIAL_WORK
    recv, send = (
        (_dense_receivers_serial, _dense_senders_serial) if serial else (_dense_receivers, _dense_senders)
    )
    recv(Ah, B, Bt, ch, kappa, dt.type(1), dt.type(-np.inf), agg, m, inv_s, abar, erow, gA, gc)
    send(Ah, B, Bt, ch, kappa, agg, m, inv_s, abar, SENDER_TILE if serial else _sender_block(N), gB)
    gA *= dt.type(0.5)
    gc *= dt.type(0.5)
    return float(erow.sum(dtype=np.float64)), gA, gB, gc


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
def _csc(index, mask):
    """Reverse index by a stable counting sort: entries of sender j are flat[ptr[j]:ptr[j+1]] (flat
    positions i * k + q of the (N, k) lists), in ascending receiver order."""
    N, k = index.shape
    ptr = np.zeros(N + 1, np.int64)
    for i in range(N):
        for q in range(k):
            if mask[i, q]:
                ptr[index[i, q] + 1] += 1
    for j in range(N):
        ptr[j + 1] += ptr[j]
    cur = ptr[:-1].copy()
    flat = np.empty(ptr[N], np.int64)
    for i in range(N):
        for q in range(k):
            if mask[i, q]:
                j = index[i, q]
                flat[cur[j]] = i * k + q
                cur[j] += 1
    return ptr, flat


@_kernel
def _sparse_senders(Ah, W, k, ptr, flat, gB):
    """gB_j = sum over receivers i listing j (ascending) of W_iq Ah_i; W flattened (N * k,)."""
    N = Ah.shape[0]
    for j in numba.prange(N):
        for e in range(ptr[j], ptr[j + 1]):
            p = flat[e]
            _accumulate_row(gB, j, W[p], Ah, p // k)


def pairwise_sparse(A, B, c, index, mask, kappa: float, aggregator: str):
    """Fixed-width neighbour lists index/mask (N, k) -> (E, gA, gB, gc); masked entries are ignored."""
    agg = _pm.aggregator_code(aggregator)
    dt, Ah, B, ch, kappa = _prepare(A, B, c, kappa)
    N, D = Ah.shape
    index = np.ascontiguousarray(index, np.int64)
    mask = np.ascontiguousarray(mask, np.bool_)
    if index.shape != mask.shape or index.ndim != 2 or index.shape[0] != N:
        raise ValueError(f"index/mask must both be (N={N}, k), got {index.shape} and {mask.shape}")
    k = index.shape[1]
    gA = np.zeros((N, D), dt)
    gB = np.zeros((N, D), dt)
    gc = np.zeros(N, dt)
    erow = np.zeros(N, dt)
    W = np.zeros((N, k), dt)
    if k > 0:
        _sparse_receivers(Ah, B, ch, index, mask, kappa, dt.type(1), dt.type(-np.inf), agg, erow, W, gA, gc)
        ptr, flat = _csc(index, mask)
        _sparse_senders(Ah, W.reshape(-1), k, ptr, flat, gB)
    gA *= dt.type(0.5)
    gc *= dt.type(0.5)
    return float(erow.sum(dtype=np.float64)), gA, gB, gc
