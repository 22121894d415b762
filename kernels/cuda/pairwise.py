"""Pairwise kernels over feature rows (SPEC §2.3–2.4), free of any agent family: keyed by the feature
width D, with a leading batch axis f (the belief and prior terms of Gaussian agents today).

Features: ``KL_ij / kappa = A_i . B_j + c_i`` with A and c pre-scaled by ``1 / (2 kappa)`` (the per-pair math
of :mod:`vfesim_kernels.pair_math` takes halved receiver features), so the logits are ``-KL / kappa`` with
no division in the inner loops: the weights W_ij are unchanged, energies scale by kappa and the sender
cotangent by 2 kappa.

Dense pairs (flash-attention pattern, no N x N array, no float atomics):
  1. ``stats``: owner thread = receiver, others = sender tiles in shared memory; online log-sum-exp
     over one slice of the senders (grid axis y splits the senders, for parallelism at moderate N);
  2. ``merge``: per receiver, merge the slices' statistics in slice order (``lse_merge``); energies;
  3. ``grads``: grid axis y < S: receiver role, sum_j W_ij B_j (and sum_j W_ij) per slice;
     y >= S: sender role, sum_i W_ij A_i per slice. Slices are summed, in order, by the caller's adjoint.
Sparse pairs: fixed-width neighbour lists, receivers and (through a CSC reverse index) senders.
Long features (the GEMM path): :func:`make_gemm_row_kernel`, one block per receiver row of a logit slab.
Every sum runs in a fixed order, so results are bitwise reproducible on one device.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .core import (
    _NB,
    AGG_CODES,
    PAIR_EXP,
    PAIR_OPT,
    PAIR_THREADS,
    SHARED_BYTES,
    SIMULATOR,
    TARGET_BLOCKS,
    accumulate_row,
    compile_kernels,
    cuda,
    device,
    lse_merge,
    lse_push,
    lse_push_e,
    pair_kl,
    pair_logit,
    pair_weight,
    pair_weight_e,
    row_abar,
    row_energy,
)

__all__ = [
    "make_dense_kernels",
    "make_sparse_kernels",
    "make_gemm_row_kernel",
    "dense_splits",
    "ROW_THREADS",
]

_device = device

# Threads per block of the GEMM-path row kernel (a power of two: tree reductions).
ROW_THREADS = 8 if SIMULATOR else 256


def _block_reduce(red, v, t, nt, is_min):
    """Sum (or min) of v over the block by a fixed tree over shared ``red`` (nt, a power of two):
    deterministic. Every thread gets the result; ends with a barrier (red reusable)."""
    red[t] = v
    cuda.syncthreads()
    h = nt // 2
    while h > 0:
        if t < h:
            red[t] = min(red[t], red[t + h]) if is_min else red[t] + red[t + h]
        cuda.syncthreads()
        h //= 2
    r = red[0]
    cuda.syncthreads()
    return r


_block_reduce = _device(_block_reduce)


@functools.cache
def make_gemm_row_kernel(dtype: str, aggregator: str):
    """Row kernel of the GEMM pair path: one block per receiver row of a (rows, N) logit slab.

    rows[n_rows, ROW_THREADS](L, ch, r0, e_rows, wsum): with x_j = L[r, j] + ch[i] = KL_ij / kappa
    (i = r0 + r, j != i), overwrites L[r] with the pair weights W_ij (SPEC §2.2; W_ii = 0) and writes
    the row energy / kappa to e_rows[i] and sum_j W_ij to wsum[i]. Replaces ~15 CuPy element-wise and
    reduction launches per row block (0.4 ms of host-bound launches at N = 1024, K = 21).
    """
    dt = _NB[np.dtype(dtype)]
    inf = np.dtype(dtype).type(np.inf)
    one = np.dtype(dtype).type(1.0)
    zero = np.dtype(dtype).type(0.0)  # typed constants: a float literal would promote float32 to float64
    expected = aggregator == "expected"
    RT = ROW_THREADS
    reduce = _block_reduce

    def rows(L, ch, r0, e_rows, wsum):
        r = cuda.blockIdx.x
        i = r0 + r
        t = cuda.threadIdx.x
        N = L.shape[1]
        red = cuda.shared.array(RT, dt)
        cr = ch[i]
        mn = inf
        for j in range(t, N, RT):
            if j != i:
                mn = min(mn, L[r, j] + cr)
        mn = reduce(red, mn, t, RT, True)
        acc = zero
        for j in range(t, N, RT):
            if j != i:
                acc += math.exp(mn - (L[r, j] + cr))
        s = reduce(red, acc, t, RT, False)
        inv = one / s
        abar = zero
        if expected:
            acc = zero
            for j in range(t, N, RT):
                if j != i:
                    x = L[r, j] + cr
                    acc += math.exp(mn - x) * inv * x
            abar = reduce(red, acc, t, RT, False)
        acc = zero
        for j in range(t, N, RT):
            w = zero
            if j != i:
                x = L[r, j] + cr
                w = math.exp(mn - x) * inv
                if expected:
                    w *= one - (x - abar)
            L[r, j] = w
            acc += w
        ws = reduce(red, acc, t, RT, False)
        if t == 0:
            wsum[i] = ws
            e_rows[i] = abar if expected else mn - math.log(s)

    return compile_kernels({"rows": rows})


def _tile_rows(D: int, itemsize: int, threads: int) -> int:
    """Sender/receiver rows per shared tile: the feature rows plus four per-row scalars fit SHARED_BYTES."""
    rows = SHARED_BYTES // ((D + 4) * itemsize)
    return int(max(1, min(threads, rows)))


def dense_splits(N: int, opt: int = PAIR_OPT, threads: int = PAIR_THREADS) -> tuple[int, int]:
    """(S, chunk): the others axis is cut into S slices of ``chunk`` rows (a multiple of the thread count)
    so that the grads launch has about TARGET_BLOCKS blocks even at moderate N."""
    nb = -(-N // (threads * opt))
    S = max(1, min(-(-TARGET_BLOCKS // (2 * nb)), 2 if SIMULATOR else N // (4 * threads)))
    chunk = -(-N // S)
    chunk = -(-chunk // threads) * threads
    return S, chunk


@functools.cache
def make_dense_kernels(D: int, dtype: str, aggregator: str, threads: int = PAIR_THREADS, opt: int = PAIR_OPT):
    """Dense streaming kernels ``stats``, ``merge``, ``grads`` for one (feature width D, dtype, aggregator).

    Receivers are a contiguous range of the agents: A (nf, NR, D), c (nf, NR) hold receivers r0 ..
    r0 + NR - 1 (global indices; r0 = 0, NR = N for all pairs), B (nf, N, D) every sender. Launch (S
    slices of the other side, ``chunk_s`` senders and ``chunk_r`` receivers per slice, nf terms,
    nb(n) = ceil(n / (threads * opt))):
      stats[(nb(NR), S, nf), threads](A, B, c, r0, f0, chunk_s, pm, ps, pt)         pm, ps, pt (S, nf, NR)
      merge[(ceil(NR / BLOCK), nf), BLOCK](pm, ps, pt, kappa, f0, m, inv_s, abar, energy)   (nf, NR) each
      grads[(nb(max(NR, N)), 2 S, nf), threads](A, B, c, m, inv_s, abar, r0, f0, chunk_s, chunk_r, gAr, gBs)
    gAr (S, nf, NR, D + 1): per slice of senders, sum_j W_ij B_j and sum_j W_ij per receiver; gBs (S, nf, N,
    D): per slice of receivers, sum_i W_ij A'_i per sender. With KL' = KL / kappa = A'_i . B_j + c'_i
    (A' = A / (2 kappa), c' likewise) and kappa' = 1: W'_ij = W_ij, energy = kappa E',
    sum_i W_ij A'_i = (sum_i W_ij A_i) / (2 kappa).
    The pair i == j is skipped by a per-pair test only in the shared tiles that hold one of the block's
    own agents (and, in ``grads``, owners past the end only in the last block); every other tile runs
    the same loop without the tests.
    """
    dt = _NB[np.dtype(dtype)]
    one = np.dtype(dtype).type(1.0)
    ninf = np.dtype(dtype).type(-np.inf)
    agg = AGG_CODES[aggregator]
    ex = PAIR_EXP[np.dtype(dtype)]
    TS = _tile_rows(D, np.dtype(dtype).itemsize, threads)
    OPT = opt
    NT = threads

    def push(own, o, rw, oc, m, s, t):
        """Online log-sum-exp of owner o over one more sender (row rw)."""
        kl = pair_kl(own, o, rw, 0, oc)
        x = pair_logit(kl, one)
        mm, ss, tt = lse_push_e(m[o], s[o], t[o], x, kl, ex(-abs(x - m[o])), one)
        m[o] = mm
        s[o] = ss
        t[o] = tt

    def stats(A, B, c, r0, f0, chunk, pm, ps, pt):
        """Partial row statistics (max, sum, weighted sum) of receivers over one slice of senders."""
        tid = cuda.threadIdx.x
        f = f0 + cuda.blockIdx.z
        sl = cuda.blockIdx.y
        NR = A.shape[1]
        N = B.shape[1]
        b0 = cuda.blockIdx.x * (NT * OPT)
        i0 = b0 + tid
        g0 = r0 + i0  # global index of owner 0
        lo = r0 + b0  # the block's owners, global: lo .. hi - 1
        hi = r0 + min(NR, b0 + NT * OPT)
        j_begin = sl * chunk
        j_end = min(N, j_begin + chunk)
        own = cuda.local.array((OPT, D), dt)
        oc = cuda.local.array(OPT, dt)
        m = cuda.local.array(OPT, dt)
        s = cuda.local.array(OPT, dt)
        t = cuda.local.array(OPT, dt)
        rw = cuda.local.array((1, D), dt)
        for o in range(OPT):
            ii = min(i0 + o * NT, NR - 1)
            for d in range(D):
                own[o, d] = A[f, ii, d]
            oc[o] = c[f, ii]
            m[o] = ninf
            s[o] = 0.0
            t[o] = 0.0
        sX = cuda.shared.array((TS, D), dt)
        for j0 in range(j_begin, j_end, TS):
            cuda.syncthreads()
            for r in range(tid, TS * D, NT):
                row = r // D
                if j0 + row < j_end:
                    sX[row, r - row * D] = B[f, j0 + row, r - row * D]
            cuda.syncthreads()
            nj = min(TS, j_end - j0)
            if j0 < hi and j0 + nj > lo:  # a tile with the block's own agents: skip i == j
                for jj in range(nj):
                    for d in range(D):  # the sender's row once into registers, for all OPT owners
                        rw[0, d] = sX[jj, d]
                    for o in range(OPT):
                        if j0 + jj != g0 + o * NT:
                            push(own, o, rw, oc, m, s, t)
            else:
                for jj in range(nj):
                    for d in range(D):
                        rw[0, d] = sX[jj, d]
                    for o in range(OPT):
                        push(own, o, rw, oc, m, s, t)
        for o in range(OPT):
            i = i0 + o * NT
            if i < NR:
                pm[sl, f, i] = m[o]
                ps[sl, f, i] = s[o]
                pt[sl, f, i] = t[o]

    def merge(pm, ps, pt, kappa, f0, m, inv_s, abar, energy):
        """Merge the slices' statistics in slice order; per-receiver energy kappa * A_kappa'."""
        i = cuda.grid(1)
        f = f0 + cuda.blockIdx.y
        if i >= pm.shape[2]:
            return
        mm = pm[0, f, i]
        ss = ps[0, f, i]
        tt = pt[0, f, i]
        for sl in range(1, pm.shape[0]):
            mm, ss, tt = lse_merge(mm, ss, tt, pm[sl, f, i], ps[sl, f, i], pt[sl, f, i])
        m[f, i] = mm
        inv_s[f, i] = one / ss if ss > 0.0 else 0.0 * ss
        abar[f, i] = row_abar(ss, tt)
        energy[f, i] = kappa[f] * row_energy(mm, ss, tt, one, agg)

    def recv_acc(own, o, rw, oc, om, oi, oa, acc, accw):
        """Receiver role: W of owner o (a receiver) and sender row rw; acc += W B_j, accw += W."""
        kl = pair_kl(own, o, rw, 0, oc)
        e = ex(pair_logit(kl, one) - om[o])
        w = pair_weight_e(e, kl, oi[o], oa[o], one, agg)
        accumulate_row(acc, o, w, rw, 0)
        accw[o] += w

    def send_acc(own, o, rw, rc, rm, ri, ra, acc):
        """Sender role: W of receiver row rw (statistics rc, rm, ri, ra) and owner o (a sender)."""
        kl = pair_kl(rw, 0, own, o, rc)
        e = ex(pair_logit(kl, one) - rm)
        w = pair_weight_e(e, kl, ri, ra, one, agg)
        accumulate_row(acc, o, w, rw, 0)

    def grads(A, B, c, m, inv_s, abar, r0, f0, chunk_s, chunk_r, gAr, gBs):
        """Blocks y < S: receiver sums over a slice of senders; y >= S: sender sums over a slice of
        receivers."""
        tid = cuda.threadIdx.x
        f = f0 + cuda.blockIdx.z
        S = gAr.shape[0]
        NR = A.shape[1]
        N = B.shape[1]
        sender = cuda.blockIdx.y >= S
        sl = cuda.blockIdx.y - S if sender else cuda.blockIdx.y
        n_own = N if sender else NR
        b0 = cuda.blockIdx.x * (NT * OPT)
        if b0 >= n_own:
            return  # the whole block: the grid covers the larger side
        i0 = b0 + tid
        # Owners and others as global agent indices (receivers are r0 + local index).
        g_off = 0 if sender else r0  # global = local + g_off for the owners
        o_off = r0 if sender else 0  # ... and for the others
        lo = g_off + b0
        hi = g_off + min(n_own, b0 + NT * OPT)
        n_oth = NR if sender else N
        chunk = chunk_r if sender else chunk_s
        k_begin = sl * chunk
        k_end = min(n_oth, k_begin + chunk)
        own = cuda.local.array((OPT, D), dt)
        oc = cuda.local.array(OPT, dt)
        om = cuda.local.array(OPT, dt)
        oi = cuda.local.array(OPT, dt)
        oa = cuda.local.array(OPT, dt)
        acc = cuda.local.array((OPT, D), dt)
        accw = cuda.local.array(OPT, dt)
        rw = cuda.local.array((1, D), dt)
        rc = cuda.local.array(1, dt)
        for o in range(OPT):
            ii = min(i0 + o * NT, n_own - 1)
            for d in range(D):
                own[o, d] = B[f, ii, d] if sender else A[f, ii, d]
                acc[o, d] = 0.0
            if not sender:
                oc[o] = c[f, ii]
                om[o] = m[f, ii]
                oi[o] = inv_s[f, ii]
                oa[o] = abar[f, ii]
            accw[o] = 0.0
        sX = cuda.shared.array((TS, D), dt)
        sc = cuda.shared.array(TS, dt)
        sm = cuda.shared.array(TS, dt)
        si = cuda.shared.array(TS, dt)
        sa = cuda.shared.array(TS, dt)
        for k0 in range(k_begin, k_end, TS):
            cuda.syncthreads()
            for r in range(tid, TS * D, NT):
                row = r // D
                if k0 + row < k_end:
                    col = r - row * D
                    sX[row, col] = A[f, k0 + row, col] if sender else B[f, k0 + row, col]
            if sender:
                for r in range(tid, TS, NT):
                    if k0 + r < k_end:
                        sc[r] = c[f, k0 + r]
                        sm[r] = m[f, k0 + r]
                        si[r] = inv_s[f, k0 + r]
                        sa[r] = abar[f, k0 + r]
            cuda.syncthreads()
            nk = min(TS, k_end - k0)
            # Checked pairs: tiles with the block's own agents (skip i == j) and the last, partial block
            # (skip owners past the end, whose clamped loads would meet empty statistics).
            checked = (o_off + k0 < hi and o_off + k0 + nk > lo) or b0 + NT * OPT > n_own
            for kk in range(nk):
                for d in range(D):  # the other side's row once into registers, for all OPT owners
                    rw[0, d] = sX[kk, d]
                kg = o_off + k0 + kk
                if sender:  # own = B_j; rw is receiver k's A_k with its statistics
                    rc[0] = sc[kk]
                    rm, ri, ra = sm[kk], si[kk], sa[kk]
                    if checked:
                        for o in range(OPT):
                            if kg != lo + tid + o * NT and i0 + o * NT < n_own:
                                send_acc(own, o, rw, rc, rm, ri, ra, acc)
                    else:
                        for o in range(OPT):
                            send_acc(own, o, rw, rc, rm, ri, ra, acc)
                elif checked:  # own = A_i with its statistics; rw is sender k's B_k
                    for o in range(OPT):
                        if kg != lo + tid + o * NT and i0 + o * NT < n_own:
                            recv_acc(own, o, rw, oc, om, oi, oa, acc, accw)
                else:
                    for o in range(OPT):
                        recv_acc(own, o, rw, oc, om, oi, oa, acc, accw)
        for o in range(OPT):
            i = i0 + o * NT
            if i < n_own:
                if sender:
                    for d in range(D):
                        gBs[sl, f, i, d] = acc[o, d]
                else:
                    for d in range(D):
                        gAr[sl, f, i, d] = acc[o, d]
                    gAr[sl, f, i, D] = accw[o]

    push = device(push)
    recv_acc = device(recv_acc)
    send_acc = device(send_acc)
    pyfuncs = {"stats": stats, "merge": merge, "grads": grads}
    return compile_kernels(pyfuncs) | {"tile": TS, "threads": NT, "opt": OPT}


@functools.cache
def make_sparse_kernels(D: int, dtype: str, aggregator: str):
    """Sparse neighbour-list kernels for one (feature width D, dtype, aggregator); one thread per agent,
    grid y = batch index (term).

    rows[(ceil(N / BLOCK), nf), BLOCK](A, B, c, index, mask, kappa, f0, W, energy, gAr)
        receiver i: statistics over its listed senders, W (2, N, k), energy (2, N),
        gAr (1, 2, N, D+1) = [sum_j W_ij B_j, sum_j W_ij]
    senders[(ceil(N_s / BLOCK), nf), BLOCK](A, W, ptr, src_row, src_slot, f0, gBs)
        sender j < N_s: sum over its incoming edges e in ptr[j] .. ptr[j+1] (ordered by receiver, then
        slot) of W[src_row[e], src_slot[e]] A_{src_row[e]} into gBs (1, 2, N_s, D); N_s = N, or the
        rows of a gathered sender subset B (n_s, D) that ``index`` numbers locally
    """
    dt = _NB[np.dtype(dtype)]
    one = np.dtype(dtype).type(1.0)
    ninf = np.dtype(dtype).type(-np.inf)
    agg = AGG_CODES[aggregator]

    def rows(A, B, c, index, mask, kappa, f0, W, energy, gAr):
        i = cuda.grid(1)
        f = f0 + cuda.blockIdx.y
        if i >= A.shape[1]:
            return
        Af = A[f]
        Bf = B[f]
        cf = c[f]
        m = ninf
        s = 0.0 * cf[i]
        t = 0.0 * cf[i]
        for k in range(index.shape[1]):
            if mask[i, k]:
                kl = pair_kl(Af, i, Bf, index[i, k], cf)
                m, s, t = lse_push(m, s, t, pair_logit(kl, one), kl)
        energy[f, i] = kappa[f] * row_energy(m, s, t, one, agg)
        inv_s = one / s if s > 0.0 else 0.0 * s
        ab = row_abar(s, t)
        acc = cuda.local.array((1, D), dt)
        for d in range(D):
            acc[0, d] = 0.0
        accw = 0.0 * s
        for k in range(index.shape[1]):
            w = 0.0 * s
            if mask[i, k]:
                j = index[i, k]
                kl = pair_kl(Af, i, Bf, j, cf)
                w = pair_weight(kl, m, inv_s, ab, one, agg)
                accumulate_row(acc, 0, w, Bf, j)
                accw += w
            W[f, i, k] = w
        for d in range(D):
            gAr[0, f, i, d] = acc[0, d]
        gAr[0, f, i, D] = accw

    def senders(A, W, ptr, src_row, src_slot, f0, gBs):
        j = cuda.grid(1)
        f = f0 + cuda.blockIdx.y
        if j >= gBs.shape[2]:  # the senders (A's receivers, or a gathered subset of senders)
            return
        Af = A[f]
        acc = cuda.local.array((1, D), dt)
        for d in range(D):
            acc[0, d] = 0.0
        for e in range(ptr[j], ptr[j + 1]):
            i = src_row[e]
            accumulate_row(acc, 0, W[f, i, src_slot[e]], Af, i)
        for d in range(D):
            gBs[0, f, j, d] = acc[0, d]

    pyfuncs = {"rows": rows, "senders": senders}
    return compile_kernels(pyfuncs)
