"""Dense streaming pair kernels in float64 on the tensor cores: the contract of
:func:`vfesim_kernels.cuda.pairwise.make_dense_kernels` (same arguments and outputs; their own threads and
owners per block), with each warp's pair work as 16 x 8 tiles of float64 matrix products (:mod:`.warp`).

Per pair, the SIMT kernels spend about 49 double-precision operations per pass: the logit's D-wide dot
product, the D-wide update of the owner's weighted sums, and the exponential between them. Both D-wide
parts are matrix products over a tile of owners x others: the logits X = own . other^T (k over the
features) and the sums acc += E . other (k over the others). Here they run on the tensor cores, and the
float64 pipe keeps the exponentials and the bookkeeping.

One warp owns G groups of 16 owners (rows); the block's warps share tiles of TS other rows in shared
memory, stored twice in the lane order of the two products' B operands (no bank conflicts, no shuffles):
``sL[t, kc, i, 4 g + q] = X[8 t + g, 8 kc + q + 4 i]`` (logits: k = feature) and ``sA[t, nc, i, 4 g + q]
= X[8 t + 2 q + i, 8 nc + g]`` (sums: k = other). Per tile of 8 others and group, ceil(D / 8) m16n8k8
products (an m16n8k4 for a last chunk of at most 4 features) give lane (g, q) the logits of owner rows
g and g + 8 against others 2q and 2q + 1; their exponentials are that lane's A operand of the sums'
m16n8k8 products as they stand (the others in the order 0, 2, 4, 6, 1, 3, 5, 7 along k), so no value
moves between lanes. Feature columns are padded with zeros.

``stats`` keeps the online log-sum-exp per owner row: the row's maximum over each tile of 8 others by two
shuffles, the sums rescaled when it moves (at most once per tile, rarely after the first tiles), one
exponential per pair. The pair i == j and others past the slice's end get logit -inf, weight 0 (the rows
past the end are zeros in shared memory; the row j = i is not, so a NaN or infinite feature of agent i
also reaches its own sums, as 0 * NaN: such a state's energy is NaN either way). ``expected`` adds the
sums of e (m - x) (B, 1) and e KL: one more product per tile and feature chunk. ``grads`` needs no
maximum: the weights come from the receivers' merged statistics. Each step runs for all of a warp's
groups before the next (independent products and exponentials in flight). Every sum runs in a fixed
order: bitwise reproducible on one device.
"""

from __future__ import annotations

import functools

import numpy as np

from .core import AGG_CODES, SHARED_BYTES, SIMULATOR, compile_kernels, cuda, device, pair_weight_e
from .pair_exp import PAIR_EXPB
from .warp import dmma_k4, dmma_k8, fmax, quad_max, quad_sum

__all__ = ["make_mma_kernels", "mma_layout", "MMA_WARPS"]

# Warps per block (the simulator runs one: it spawns a Python thread per CUDA thread).
MMA_WARPS = 1 if SIMULATOR else 4


def _chunks(D: int) -> tuple[int, int, int]:
    """(k8, k4, nc): the logits' m16n8k8 feature chunks, whether an m16n8k4 takes the last <= 4
    features, and the sums' 8-column chunks, for feature width D."""
    k8, rem = divmod(D, 8)
    k4 = 0 < rem <= 4
    if rem > 4:
        k8 += 1
    return k8, int(k4), -(-D // 8)


def _groups(D: int) -> int:
    """Groups of 16 owners per warp: 2 up to D = 16, else 1 (registers); 1 in the simulator."""
    return 1 if SIMULATOR or D > 16 else 2


def mma_layout(D: int) -> tuple[int, int]:
    """(threads, owners) per block of the tensor-core kernels for feature width D."""
    return 32 * MMA_WARPS, 16 * _groups(D) * MMA_WARPS


def _tile_rows(D: int) -> int:
    """Other rows per shared tile (a multiple of 8): both operand copies and four scalars per row fit."""
    k8, k4, nc = _chunks(D)
    per_row = ((k8 + k4) * 8 + nc * 8 + 4) * 8  # (float64)
    return int(max(8, min(128, SHARED_BYTES // per_row) // 8 * 8))


@functools.cache
def make_mma_kernels(D: int, aggregator: str) -> dict:
    """``stats`` and ``grads`` for float64 feature rows of width D (launch and arguments: those of
    :func:`vfesim_kernels.cuda.pairwise.make_dense_kernels`, with ``threads`` and ``per_block`` from
    :func:`mma_layout`; its ``merge`` completes them)."""
    dt = np.float64
    zero = dt(0.0)
    ninf = dt(-np.inf)
    one = dt(1.0)
    agg = AGG_CODES[aggregator]
    expected = aggregator == "expected"
    ex, LB = PAIR_EXPB[np.dtype(dt)]
    assert LB == 1  # (natural logits: float64's exponential takes them as they are)
    K8, K4, NC = _chunks(D)
    KL = K8 + K4
    G = _groups(D)
    NT, PB = mma_layout(D)
    TS = _tile_rows(D)
    T8 = TS // 8

    def clear(sL, sA):
        """Zero both operand copies (the padding columns are never written again)."""
        tid = cuda.threadIdx.x
        for r in range(tid, T8 * KL * 64, NT):
            t = r // (KL * 64)
            u = r - t * KL * 64
            sL[t, u // 64, (u // 32) % 2, r % 32] = zero
        for r in range(tid, T8 * NC * 64, NT):
            t = r // (NC * 64)
            u = r - t * NC * 64
            sA[t, u // 64, (u // 32) % 2, r % 32] = zero

    def load(X, f, j0, j_end, scale, sL, sA):
        """Rows j0 .. j0 + TS - 1 of X[f] times ``scale`` (zeros past j_end) into both operand copies."""
        tid = cuda.threadIdx.x
        for r in range(tid, TS * D, NT):
            row = r // D
            col = r - row * D
            v = X[f, j0 + row, col] * scale if j0 + row < j_end else zero
            t = row // 8
            rr = row - 8 * t
            sL[t, col // 8, (col % 8) // 4, 4 * rr + col % 4] = v
            sA[t, col // 8, rr % 2, 4 * (col % 8) + rr // 2] = v

    def load_owners(X, f, first, n, scale, own, gr, g, q):
        """Group gr's A operands of the logits: rows first + g (+ 8) of X[f] (clamped to n - 1) times
        ``scale``."""
        lo = min(first + g, n - 1)
        hi = min(first + g + 8, n - 1)
        for kc in range(KL):
            for i in range(4):
                col = 8 * kc + q + 4 * (i // 2)
                own[gr, kc, i] = X[f, hi if i % 2 else lo, col] * scale if col < D else zero

    def logits(own, gr, sL, t, lane):
        """d_i = owner row g + 8 (i // 2) (group gr) . other 2q + i % 2 of tile t, for lane (g, q): the
        feature chunks alternately in two chains (half the dependent products), then added."""
        x0, x1, x2, x3 = zero, zero, zero, zero
        y0, y1, y2, y3 = zero, zero, zero, zero
        for kc in range(K8):
            a0, a1, a2, a3 = own[gr, kc, 0], own[gr, kc, 1], own[gr, kc, 2], own[gr, kc, 3]
            b0, b1 = sL[t, kc, 0, lane], sL[t, kc, 1, lane]
            if kc % 2:
                y0, y1, y2, y3 = dmma_k8(a0, a1, a2, a3, b0, b1, y0, y1, y2, y3)
            else:
                x0, x1, x2, x3 = dmma_k8(a0, a1, a2, a3, b0, b1, x0, x1, x2, x3)
        if K4:
            y0, y1, y2, y3 = dmma_k4(own[gr, K8, 0], own[gr, K8, 1], sL[t, K8, 0, lane], y0, y1, y2, y3)
        return x0 + y0, x1 + y1, x2 + y2, x3 + y3

    def accumulate(acc, gr, e, sA, t, lane):
        """acc[gr] += E . others of tile t, lane (g, q)'s weights e[gr, i] those of owner row g + 8 (i //
        2) and other 2q + i % 2 (along k: others 2q, then 2q + 1, four lanes apart)."""
        for nc in range(NC):
            acc[gr, nc, 0], acc[gr, nc, 1], acc[gr, nc, 2], acc[gr, nc, 3] = dmma_k8(
                e[gr, 0], e[gr, 2], e[gr, 1], e[gr, 3], sA[t, nc, 0, lane], sA[t, nc, 1, lane],
                acc[gr, nc, 0], acc[gr, nc, 1], acc[gr, nc, 2], acc[gr, nc, 3],
            )  # fmt: skip

    def store_rows(out, sl, f, first, acc, gr, g, q, n):
        """Lane (g, q)'s columns 8 nc + 2 q + e of rows first + g (+ 8) into out[sl, f, row, :D]."""
        for hh in range(2):
            i = first + g + 8 * hh
            if i < n:
                for nc in range(NC):
                    for e in range(2):
                        col = 8 * nc + 2 * q + e
                        if col < D:
                            out[sl, f, i, col] = acc[gr, nc, 2 * hh + e]

    def coords(f0, chunk, n_others):
        """(lane, g, q, term f, slice, the warp's first owner, the slice's others begin .. end) of this
        thread."""
        tid = cuda.threadIdx.x
        lane = tid % 32
        base = cuda.blockIdx.x * PB + (tid // 32) * (16 * G)
        sl = cuda.blockIdx.y
        begin = sl * chunk
        return lane, lane // 4, lane % 4, f0 + cuda.blockIdx.z, sl, base, begin, min(n_others, begin + chunk)

    def stats(A, B, c, scale, r0, f0, chunk, pm, ps, pt, gAr, gAx):
        """Receiver pass over one slice of senders (the contract of the SIMT ``stats``)."""
        NR = A.shape[1]
        N = B.shape[1]
        lane, g, q, f, sl, base, j_begin, j_end = coords(f0, chunk, N)  # (base: a receiver's local index)
        own = cuda.local.array((G, KL, 4), dt)
        acc = cuda.local.array((G, NC, 4), dt)
        accx = cuda.local.array((G, NC, 4), dt)
        oc = cuda.local.array((G, 2), dt)  # per owner row (g, g + 8): c, running max, sums
        m = cuda.local.array((G, 2), dt)
        s = cuda.local.array((G, 2), dt)
        t_ = cuda.local.array((G, 2), dt)
        px = cuda.local.array((G, 2), dt)
        tm = cuda.local.array((G, 2), dt)
        kl = cuda.local.array((G, 4), dt)  # per tile: the lane's KL', logits, weights, weighted deltas
        xs = cuda.local.array((G, 4), dt)
        es = cuda.local.array((G, 4), dt)
        ds = cuda.local.array((G, 4), dt)
        for gr in range(G):
            first = base + 16 * gr
            load_owners(A, f, first, NR, scale, own, gr, g, q)
            for hh in range(2):
                oc[gr, hh] = c[f, min(first + g + 8 * hh, NR - 1)] * scale
                m[gr, hh] = ninf
                s[gr, hh] = zero
                t_[gr, hh] = zero
                px[gr, hh] = zero
            for nc in range(NC):
                for i in range(4):
                    acc[gr, nc, i] = zero
                    accx[gr, nc, i] = zero
        sL = cuda.shared.array((T8, KL, 2, 32), dt)
        sA = cuda.shared.array((T8, NC, 2, 32), dt)
        clear(sL, sA)
        for j0 in range(j_begin, j_end, TS):
            cuda.syncthreads()
            load(B, f, j0, j_end, one, sL, sA)
            cuda.syncthreads()
            for t in range(-(-min(TS, j_end - j0) // 8)):
                jb = j0 + 8 * t + 2 * q  # the lane's first sender (global index)
                for gr in range(G):
                    i_lo = r0 + base + 16 * gr + g  # the lane's receivers (global index): i_lo, i_lo + 8
                    kl[gr, 0], kl[gr, 1], kl[gr, 2], kl[gr, 3] = logits(own, gr, sL, t, lane)
                    for i in range(4):
                        k = kl[gr, i] + oc[gr, i // 2]
                        kl[gr, i] = k
                        j = jb + i % 2
                        xs[gr, i] = -k if j < j_end and j != i_lo + 8 * (i // 2) else ninf
                for gr in range(G):
                    for hh in range(2):
                        tm[gr, hh] = quad_max(fmax(xs[gr, 2 * hh], xs[gr, 2 * hh + 1]))
                for gr in range(G):
                    for hh in range(2):
                        mo = m[gr, hh]
                        if tm[gr, hh] > mo:  # the row's maximum moves: rescale (exp(-inf) = 0 at first)
                            sc = ex(mo - tm[gr, hh])
                            # every delta so far grows by the shift; a row-wide test (the lane's own s is 0
                            # where its senders so far underflowed, while acc holds the row's sums)
                            if expected and mo != ninf:
                                sh = tm[gr, hh] - mo
                                for nc in range(NC):
                                    for e in range(2 * hh, 2 * hh + 2):
                                        accx[gr, nc, e] = sc * (accx[gr, nc, e] + sh * acc[gr, nc, e])
                                px[gr, hh] = sc * (px[gr, hh] + sh * s[gr, hh])
                            for nc in range(NC):
                                for e in range(2 * hh, 2 * hh + 2):
                                    acc[gr, nc, e] *= sc
                            s[gr, hh] *= sc
                            t_[gr, hh] *= sc
                            m[gr, hh] = tm[gr, hh]
                for gr in range(G):
                    for i in range(4):
                        x = xs[gr, i]
                        es[gr, i] = ex(x - m[gr, i // 2] if x != ninf else ninf)  # (NaN stays NaN)
                    for hh in range(2):
                        s[gr, hh] += es[gr, 2 * hh] + es[gr, 2 * hh + 1]
                for gr in range(G):
                    accumulate(acc, gr, es, sA, t, lane)
                if expected:
                    for gr in range(G):
                        for i in range(4):
                            x = xs[gr, i]
                            ds[gr, i] = es[gr, i] * (m[gr, i // 2] - x) if x != ninf else zero
                            t_[gr, i // 2] += es[gr, i] * kl[gr, i] if x != ninf else zero
                        for hh in range(2):
                            px[gr, hh] += ds[gr, 2 * hh] + ds[gr, 2 * hh + 1]
                        accumulate(accx, gr, ds, sA, t, lane)
        for gr in range(G):
            first = base + 16 * gr
            for hh in range(2):
                ssum = quad_sum(s[gr, hh])
                tsum = quad_sum(t_[gr, hh])
                psum = quad_sum(px[gr, hh])
                i = first + g + 8 * hh
                if i < NR and q == 0:
                    pm[sl, f, i] = m[gr, hh]
                    ps[sl, f, i] = ssum
                    pt[sl, f, i] = tsum
                    if expected:
                        gAx[sl, f, i, D] = psum
            store_rows(gAr, sl, f, first, acc, gr, g, q, NR)
            if expected:
                store_rows(gAx, sl, f, first, accx, gr, g, q, NR)

    def grads(A, B, c, scale, m, inv_s, abar, r0, f0, chunk, gBs):
        """Sender pass over one slice of receivers (the contract of the SIMT ``grads``)."""
        NR = A.shape[1]
        N = B.shape[1]
        lane, g, q, f, sl, base, k_begin, k_end = coords(f0, chunk, NR)  # (base: a sender)
        own = cuda.local.array((G, KL, 4), dt)
        acc = cuda.local.array((G, NC, 4), dt)
        kl = cuda.local.array((G, 4), dt)  # per tile: the lane's KL' and weights
        ws = cuda.local.array((G, 4), dt)
        for gr in range(G):
            load_owners(B, f, base + 16 * gr, N, one, own, gr, g, q)
            for nc in range(NC):
                for i in range(4):
                    acc[gr, nc, i] = zero
        sL = cuda.shared.array((T8, KL, 2, 32), dt)
        sA = cuda.shared.array((T8, NC, 2, 32), dt)
        sc = cuda.shared.array(TS, dt)
        sm = cuda.shared.array(TS, dt)
        si = cuda.shared.array(TS, dt)
        sa = cuda.shared.array(TS, dt)
        clear(sL, sA)
        for k0 in range(k_begin, k_end, TS):
            cuda.syncthreads()
            load(A, f, k0, k_end, scale, sL, sA)
            for r in range(cuda.threadIdx.x, TS, NT):
                ok = k0 + r < k_end
                sc[r] = c[f, k0 + r] * scale if ok else zero
                sm[r] = m[f, k0 + r] if ok else zero
                si[r] = inv_s[f, k0 + r] if ok else zero
                sa[r] = abar[f, k0 + r] if ok else zero
            cuda.syncthreads()
            for t in range(-(-min(TS, k_end - k0) // 8)):
                kk = 8 * t + 2 * q  # the lane's first receiver in the tile
                for gr in range(G):
                    kl[gr, 0], kl[gr, 1], kl[gr, 2], kl[gr, 3] = logits(own, gr, sL, t, lane)
                for gr in range(G):
                    j_lo = base + 16 * gr + g  # the lane's senders: j_lo, j_lo + 8
                    for i in range(4):
                        r = kk + i % 2
                        k = kl[gr, i] + sc[r]
                        j = j_lo + 8 * (i // 2)  # (senders past N: computed, not stored)
                        ok = k0 + r < k_end and r0 + k0 + r != j and j < N
                        ws[gr, i] = pair_weight_e(ex(-k - sm[r] if ok else ninf), k, si[r], sa[r], one, agg)
                for gr in range(G):
                    accumulate(acc, gr, ws, sA, t, lane)
        for gr in range(G):
            store_rows(gBs, sl, f, base + 16 * gr, acc, gr, g, q, N)

    coords = device(coords)
    clear = device(clear)
    load = device(load)
    load_owners = device(load_owners)
    logits = device(logits)
    accumulate = device(accumulate)
    store_rows = device(store_rows)
    ks = compile_kernels({"stats": stats, "grads": grads})
    return ks | {"tile": TS, "threads": NT, "per_block": PB, "groups": G}
