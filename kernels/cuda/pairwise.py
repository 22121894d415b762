"""Pairwise kernels over feature rows (SPEC §2.3–2.4), free of any agent family: keyed by the feature
width D, with a leading batch axis f (the belief and prior terms of Gaussian agents today).

Features: ``KL_ij / kappa = A_i . B_j + c_i`` with A and c scaled by ``1 / (2 kappa)`` (the per-pair math
of :mod:`vfesim_kernels.pair_math` takes halved receiver features), so the logits are ``-KL / kappa`` with
no division in the inner loops: the weights W_ij are unchanged, energies scale by kappa and the sender
cotangent by 2 kappa. The dense kernels apply that scale (``scale``) as they load the receivers' rows (the
same product as a scaled copy; callers whose features come scaled pass 1); the other kernels take scaled
features.

Dense pairs (flash-attention pattern, no N x N array, no float atomics):
  1. ``stats``: owner thread = receiver, others = sender tiles in shared memory; online log-sum-exp
     over one slice of the senders (grid axis y splits the senders, for parallelism at moderate N), and
     the receiver's sums of sender rows weighted by exp(x - m) in the same sweep;
  2. ``merge``: per receiver, merge the slices' statistics in slice order (``lse_merge``); energies; the
     slices' weighted sums rescaled and summed, in slice order, into sum_j W_ij (B_j, 1);
  3. ``grads``: sender role, sum_i W_ij A_i per slice of receivers (summed in slice order by the caller:
     :func:`vfesim_kernels.cuda.reduce.fold_slices`, or the family's adjoint kernel).
Sparse pairs: fixed-width neighbour lists, receivers and (through a CSC reverse index) senders.
Weighted pairs batched over grid points (field agents, :func:`make_points_kernels`): one thread per
receiver row, then one per sender row through the reverse index of the neighbour lists.
Long features (the GEMM path): :func:`make_gemm_row_kernel`, one block per receiver row of a logit slab.
float64 dense pairs run the same contract on the tensor cores (:mod:`.pair_mma`; :data:`DENSE_MMA`); the
kernels below serve float32 (and float64 on request, ``mma=False``).
Every sum runs in a fixed order, so results are bitwise reproducible on one device.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import int64, uint32

from .core import (
    _NB,
    AGG_CODES,
    BLOCK,
    PAIR_THREADS,
    SHARED_BYTES,
    SIMULATOR,
    accumulate_row,
    compile_kernels,
    cuda,
    device,
    lse_merge,
    lse_push,
    lse_push_w,
    pair_kl,
    pair_logit,
    pair_opt,
    pair_weight,
    pair_weight_w,
    row_abar,
    row_energy,
    row_means_w,
    row_unit_energy_w,
)
from .pair_exp import PAIR_EXPB
from .pair_mma import make_mma_kernels, mma_layout
from .warp import warp_any

__all__ = [
    "make_dense_kernels",
    "dense_layout",
    "DENSE_MMA",
    "dense_registers",
    "DENSE_REGISTERS",
    "make_sparse_kernels",
    "make_gemm_row_kernel",
    "make_points_kernels",
    "dense_splits",
    "dense_slices",
    "merge_blocks",
    "split_budget",
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


def merge_blocks(n_rows: int, D: int) -> int:
    """Blocks of BLOCK threads of the dense ``merge`` kernel over n_rows receivers of feature width D: one
    thread per receiver and column of (B_j, 1)."""
    return -(-n_rows * (D + 1) // BLOCK)


def _tile_rows(D: int, itemsize: int, threads: int) -> int:
    """Sender/receiver rows per shared tile: the feature rows plus four per-row scalars fit SHARED_BYTES."""
    rows = SHARED_BYTES // ((D + 4) * itemsize)
    return int(max(1, min(threads, rows)))


# Dense grids: about SPLIT_BLOCKS blocks of owners x slices of the others. With few blocks per SM resident
# (3-5 at D = 10), a grid of a few waves idles most SMs during its last, partial wave: on an H200 the receiver
# pass of 2^18 receivers x 2^20 senders takes 526 ms in 1 slice (1024 blocks, 1.55 waves) and 466 ms in 10-16,
# the sender pass 579 -> 487 ms, and at N = 2^16 both passes lose 15-30 % in 2 slices against 24
# (benchmarks/results/gpu_splits_h200.txt). At most SPLIT_MAX slices, each of at least four tiles, and the
# slices' partial-sum buffers (S x owners x row_bytes: the caller counts its buffers) within
# :func:`split_budget`: SPLIT_BYTES, or SPLIT_OWNER_BYTES per owner for many owners (a fixed 128 MiB left the
# in-process Gaussian passes at N = 2^20, 280 B per owner and slice, in one slice: 1.55 waves per pass). The
# block count bounds the buffers too: S x owners stays near SPLIT_BLOCKS x threads x opt (3.1e6 at 2 owners
# per thread, 4.7e6 at 3), so the float32 Gaussian workspace keeps 3 slices up to 2^21 agents (1.8 GB), 2 at
# 2^22 and one from 2^23. Not done: slices by whole waves of the kernel's own occupancy. At N = 16 384 on an
# H100 (gpu_splits_h100_stop31*.txt) the passes ran up to 20 % faster in the fewest slices that fill one or
# two waves (float64 D = 16: 4 slices, 1.93 / 1.86 ms, against 2.45 / 2.00 in the default 22), but at 4096
# (16-43 owner blocks) the most slices win (8: 0.52 / 0.34 ms against 2: 0.96 / 0.82), and a floor of 2048
# rows per slice made whole evaluations no faster at 16 384 (gpu_ab_h100_stop31.txt); the occupancy is known
# only once a kernel is compiled, and the slice count must not change between a process's first and later
# calls (bitwise resumption).
SPLIT_BLOCKS = 4 if SIMULATOR else 12288
SPLIT_MAX = 2 if SIMULATOR else 24
SPLIT_BYTES = 128 << 20
SPLIT_OWNER_BYTES = 1024


def split_budget(n_owners: int) -> int:
    """Bytes the slices' partial sums of a launch over ``n_owners`` owners may take (see SPLIT_BLOCKS)."""
    return max(SPLIT_BYTES, n_owners * SPLIT_OWNER_BYTES)


def dense_splits(
    n_owners: int,
    n_others: int | None = None,
    row_bytes: int = 0,
    per_block: int = 2 * PAIR_THREADS,
    threads: int = PAIR_THREADS,
) -> tuple[int, int]:
    """(S, chunk): the others axis (``n_others`` rows, default ``n_owners``) cut into S slices of ``chunk``
    rows (a multiple of ``threads``) for a launch over ``n_owners`` owners, ``per_block`` per block of
    ``threads`` threads (the kernels' :func:`dense_layout`; default: the SIMT kernels at 2 owners per
    thread), whose slices each keep ``row_bytes`` per owner of partial sums (see SPLIT_BLOCKS)."""
    n_others = n_owners if n_others is None else n_others
    S = -(-SPLIT_BLOCKS // -(-n_owners // per_block))
    if not SIMULATOR:
        S = min(S, n_others // (4 * threads), split_budget(n_owners) // max(1, n_owners * row_bytes))
    return dense_slices(n_others, max(1, min(S, SPLIT_MAX)), threads)


def dense_slices(N: int, S: int, threads: int = PAIR_THREADS) -> tuple[int, int]:
    """(S', chunk): N others cut into slices of ``chunk`` rows, a multiple of ``threads``, at most S of
    them (S' <= S: rounding the slices up may leave fewer, none empty)."""
    chunk = -(-N // S)
    chunk = -(-chunk // threads) * threads
    return max(1, -(-N // chunk)), chunk


# Register caps (max_registers) of the SIMT dense kernels, (dtype, D) -> (stats, grads); absent or None: the
# compiler's choice (the tensor-core float64 kernels take none). Kept here, in the kernels' source file:
# changing it invalidates their disk cache. ptxas
# (sm_90, 128 threads) gives D = 10 float32 stats 124 / grads 128 registers, float64 161 / 160, D = 16 float32
# 122 / 122, float64 233 / 216 (4 blocks of 128 threads per SM at 128 registers, 3 at 161, 2 above 168); stop
# 27 measured the caps below on the kernels before their per-pair work was interleaved across owners (stop
# 30), which changed these counts (from 94 / 154, 156 / 164, 121 / 121, 222 / 221). benchmarks/bench_gpu.py
# --tune-registers measures caps. On an H100 (benchmarks/results/gpu_registers_h100_stop27.txt, the pair
# kernels alone at N = 65 536 in 24 slices, against no cap) the best were D = 10 float32 (80, 128) 0.953,
# float64 (128, 128) 0.903, D = 16 float32 (96, 128) 0.948, float64 (168, 168) 0.930; caps below these spill
# (D = 16 float64 at 96: 4.3x). In whole calls (gpu_registers_ab_h100_stop27.txt, two alternations) the D = 10
# caps made the Gaussian K = 3 energy slower (float32 19.8 -> 23.2 ms in the 7 slices of its workspace), and
# the D = 16 float32 cap sped the density-matrix pairs (d = 4, complex64) up at N = 65 536 (21.5 -> 20.5 ms)
# but slowed them down at 16 384 (2.65 -> 3.17 ms). Only the D = 16 float64 cap won at every size (complex128
# pairs 65 536: 57.9 -> 53.9 ms; 16 384: 5.56 -> 5.09 ms) and was kept. On the interleaved kernels of stop 30
# it spills (264 bytes in stats) and lost: the pairs alone at N = 65 536 on an H200 took 52.6 ms under it
# against 51.4 free, 57.5 under (184, 168), 61.8 under (200, 200) (gpu_registers_h200_stop30.txt). There, D =
# 10 float64 (128, 128) gave 0.955 of free alone (35.9 against 37.6 ms) but made whole Gaussian K = 3 calls at
# 65 536 on an H100 far slower (65.8 / 66.0 ms against 44.2-45.0; gpu_caps_ab_h100_stop30.txt); D = 10 float32
# (96, 96) 0.947 and (80, 128) 0.952 alone are the caps stop 27 found slower in whole calls (above), not tried
# again. No cap was kept until stop 39, whose kernels (logits in the exponential's units, a warp vote for the
# rescaling, unsigned while loops) gave the float32 D = 10 ``grads`` 156 registers (110 before; its tile loads
# unroll), 3 blocks per SM: capped at 128 it keeps 4, and whole Gaussian K = 3 calls at N = 65 536 on an H100
# took 12.9-13.1 ms against 14.2 uncapped at 3 owners per thread (expected: 16.7 against 16.9-17.2; 2 owners
# came later, core.PAIR_OPTS_NARROW), while the D = 16 density-matrix
# pairs (complex64, d = 4) lost under the same cap (18.0-18.6 ms against 17.6): kept for D = 10 only
# (benchmarks/results/gpu_pairs_h100_stop39.txt).
DENSE_REGISTERS: dict = {("float32", 10): (None, 128)}


def dense_registers(D: int, dtype) -> tuple:
    """(stats, grads) register caps of the dense kernels for feature width D and ``dtype``."""
    return DENSE_REGISTERS.get((np.dtype(dtype).name, D), (None, None))


# Dtypes whose dense pairs run on the tensor cores (:mod:`.pair_mma`, float64 matrix products of 16 x 8
# tiles), the others on the SIMT kernels of :func:`_dense_kernels`. float32 stays there: one tf32 product
# keeps 10 bits (outside the 1e-4 contract), and three per product (hi/lo splits, within 4e-5 of numpy)
# made whole calls slower on an H100 (density-matrix d = 4 complex64 at N = 65 536: 21.7 -> 25.0 ms;
# Gaussian K = 3 float32 two terms 34.8 -> 45.6 ms; benchmarks/results/gpu_mma_h100_stop32.txt).
DENSE_MMA = frozenset({"float64"})


def dense_layout(D: int, dtype) -> tuple[int, int]:
    """(threads, owners) per block of the dense kernels :func:`make_dense_kernels` picks for feature width D
    and ``dtype`` (their ``threads`` and ``per_block``), known before they are made."""
    if np.dtype(dtype).name in DENSE_MMA:
        return mma_layout(D)
    return PAIR_THREADS, PAIR_THREADS * pair_opt(dtype, D)


def make_dense_kernels(
    D: int,
    dtype: str,
    aggregator: str,
    threads: int | None = None,
    opt: int | None = None,
    registers=None,
    mma: bool | None = None,
):
    """The dense streaming kernels ``stats``, ``merge``, ``grads`` (contract: :func:`_dense_kernels`) for
    feature width D, ``dtype`` and ``aggregator``, with their launch layout: ``threads`` per block,
    ``per_block`` owners per block. ``mma`` (None: ``dtype`` in DENSE_MMA): the float64 tensor-core
    kernels of :mod:`.pair_mma`; otherwise the SIMT kernels with ``threads`` (PAIR_THREADS) and ``opt``
    owners per thread (:func:`~.core.pair_opt` of ``dtype`` and D) and register caps ``registers``."""
    dtype = np.dtype(dtype).name
    mma = dtype in DENSE_MMA if mma is None else mma
    if mma:
        if dtype != "float64" or threads is not None or opt is not None or registers is not None:
            raise ValueError(
                f"the tensor-core dense kernels are float64 (got {dtype}), with their own layout and no "
                "register caps"
            )
        return _mma_dense_kernels(D, aggregator)
    threads = PAIR_THREADS if threads is None else threads
    opt = pair_opt(dtype, D) if opt is None else opt
    return _dense_kernels(D, dtype, aggregator, threads, opt, registers)


@functools.cache
def _mma_dense_kernels(D: int, aggregator: str) -> dict:
    """:func:`.pair_mma.make_mma_kernels` completed by the SIMT set's ``merge`` (the same statistics)."""
    simt = _dense_kernels(D, "float64", aggregator, PAIR_THREADS, pair_opt("float64", D), None)
    ks = make_mma_kernels(D, aggregator)
    py = ks["_py"] | {"merge": simt["_py"]["merge"]}
    return ks | {"merge": simt["merge"], "_py": py, "registers": (None, None), "mma": True}


@functools.cache
def _dense_kernels(D: int, dtype: str, aggregator: str, threads: int, opt: int, registers):
    """Dense streaming kernels ``stats``, ``merge``, ``grads`` for one (feature width D, dtype, aggregator).

    Receivers are a contiguous range of the agents: A (nf, NR, D), c (nf, NR) hold receivers r0 ..
    r0 + NR - 1 (global indices; r0 = 0, NR = N for all pairs), B (nf, N, D) every sender. Launch (S
    slices of the other side, ``chunk_s`` senders and ``chunk_r`` receivers per slice, nf terms,
    nb(n) = ceil(n / per_block), per_block = threads * opt here):
      stats[(nb(NR), S, nf), threads](A, B, c, scale, r0, f0, chunk_s, pm, ps, pt, gAr, gAx)
      merge[(merge_blocks(NR, D), nf), BLOCK](pm, ps, pt, kappa, f0, m, inv_s, abar, energy, gAr, gAx)
      grads[(nb(N), S, nf), threads](A, B, c, scale, m, inv_s, abar, r0, f0, chunk_r, gBs)
    pm, ps, pt (S, nf, NR) and m, inv_s, abar, energy (nf, NR). ``stats`` is the receiver pass: per slice of
    senders, the online log-sum-exp of each receiver and, in the same sweep, its weighted sums of sender
    rows relative to the slice's running maximum (rescaled when the maximum moves): gAr[sl, :, :, :D] =
    sum_j e_j B_j, and for ``expected`` gAx[sl] = sum_j e_j delta_j (B_j, 1) with e_j = exp(x_j - m_sl),
    delta_j = m_sl - x_j >= 0 (gAx may be a dummy for ``softmin``). ``merge`` combines the slices in order
    and sums their parts of sum_j W_ij B_j (columns :D) and of sum_j W_ij (column D), in slice order, into
    gAr[0]. ``grads`` is the sender pass: per slice of receivers, gBs (S, nf, N, D) = sum_i W_ij A'_i; the
    caller sums gBs over slices in slice order. With KL' = KL / kappa = A'_i . B_j + c'_i (A' = scale A,
    scale = 1 / (2 kappa), c' likewise, scaled where loaded) and kappa' = 1: W'_ij = W_ij, energy = kappa
    E', sum_i W_ij A'_i = (sum_i W_ij A_i) / (2 kappa). Per pair: two exponentials and three D-wide
    dot/axpy passes (three and five before the receiver sums moved into the statistics sweep).
    Each sender (receiver) row meets all OPT owners of a thread at once: their logits as two partial sums
    each (even and odd features), then their exponentials, then the updates, so that 2 OPT independent
    FMA chains are in flight instead of one (the order of every sum is still fixed).
    The pair i == j is skipped by a per-pair test only in the shared tiles that hold one of the block's
    own agents (and, in ``grads``, owners past the end only in the last block); every other tile runs
    the same loop without the tests.
    Inside the passes the logits are in the exponential's units (:data:`.pair_exp.PAIR_EXPB`: base 2 in
    float32, so each exponential is one ex2): the owners' (and, in ``grads``, the receivers') rows are
    loaded times -scale LB, their constant is the first term of each dot product (in ``grads`` less the
    receiver's maximum), and the outputs go back to natural units as they are stored. In ``stats`` a warp
    whose owners all stay below their running maxima (after the first senders, nearly always) skips the
    rescaling branch on a warp vote.
    ``registers``: (stats, grads) register caps; None: :func:`dense_registers` (the tuned table, cached
    on disk); given: this variant only, not cached on disk (a sweep's).
    """
    dt = _NB[np.dtype(dtype)]
    one = np.dtype(dtype).type(1.0)
    zero = np.dtype(dtype).type(0.0)
    ninf = np.dtype(dtype).type(-np.inf)
    agg = AGG_CODES[aggregator]
    expected = aggregator == "expected"
    ex, LB = PAIR_EXPB[np.dtype(dtype)]
    inv_lb = one / LB
    TS = _tile_rows(D, np.dtype(dtype).itemsize, threads)
    OPT = opt
    NT = threads
    one_u = np.uint32(1)
    if not SIMULATOR and threads % 32:
        raise ValueError(f"threads: whole warps (the stats kernel votes over all 32 lanes), got {threads}")

    def dots(own, rw, kl):
        """kl[o, 0] + kl[o, 1] += own[o] . rw[0] for every owner o, as two partial sums (even and odd
        features; the caller sets their first terms): 2 OPT independent FMA chains in flight instead of
        one chain of D dependent FMAs at a time."""
        for d in range(0, D - 1, 2):
            for o in range(OPT):
                kl[o, 0] += own[o, d] * rw[0, d]
                kl[o, 1] += own[o, d + 1] * rw[0, d + 1]
        if D % 2:
            for o in range(OPT):
                kl[o, 0] += own[o, D - 1] * rw[0, D - 1]

    def add(o, rw, x, y, e, s, t, acc, accx, px):
        """Owner o meets a sender (row rw, logit x, y = x - m[o] <= 0, e = ex(y)) below its maximum."""
        for d in range(D):
            acc[o, d] += e * rw[0, d]
        if expected:  # delta = m - x = -y >= 0; t sums e x
            ed = -(e * y)
            for d in range(D):
                accx[o, d] += ed * rw[0, d]
            px[o] += ed
            t[o] += e * x
        s[o] += e

    def push(o, rw, x, y, e, m, s, t, acc, accx, px):
        """Owner o (a receiver) meets one more sender (row rw, logit x, y = x - m[o], e = ex(-|y|)):
        online log-sum-exp statistics and the sums of sender rows weighted by ex(x - m), rescaled when
        the maximum m moves."""
        if y > zero:  # a new maximum: the sums so far scale by e = ex(m_old - x); this row has weight 1
            if expected and s[o] > zero:  # every delta so far grows by the shift y
                for d in range(D):
                    accx[o, d] = e * (accx[o, d] + y * acc[o, d])
                px[o] = e * (px[o] + y * s[o])
            for d in range(D):
                acc[o, d] = acc[o, d] * e + rw[0, d]
            m[o] = x
            s[o] = s[o] * e + one
            if expected:  # (softmin needs no mean KL: its t, and abar, stay 0)
                t[o] = t[o] * e + x
        else:
            add(o, rw, x, y, e, s, t, acc, accx, px)

    def owner(q):
        """The number of the thread's owner that is the agent q rows after its first owner (its owners are
        NT rows apart), or -1: the pair that owner would skip (i == j)."""
        return q // NT if q >= 0 and q % NT == 0 and q < NT * OPT else -1

    def meet(own, rw, oc, kl, xe, m, s, t, acc, accx, px, skip):
        """Every owner but number ``skip`` (-1: none) meets sender row rw: the logits and exponentials of
        all owners first (independent work in flight), then the updates. The maximum of an owner moves
        rarely after its first senders: a warp whose owners all stay below theirs takes the updates
        without the rescaling branch (one vote per sender instead of a divergent branch per owner)."""
        for o in range(OPT):
            kl[o, 0] = oc[o]
            kl[o, 1] = zero
        dots(own, rw, kl)
        up = False
        for o in range(OPT):
            x = kl[o, 0] + kl[o, 1]
            y = x - m[o]
            xe[o, 0] = x
            xe[o, 1] = y
            xe[o, 2] = ex(-abs(y))
            up = up | ((y > zero) & (o != skip))
        if warp_any(up):
            for o in range(OPT):
                if o != skip:
                    push(o, rw, xe[o, 0], xe[o, 1], xe[o, 2], m, s, t, acc, accx, px)
        else:
            for o in range(OPT):
                if o != skip:
                    add(o, rw, xe[o, 0], xe[o, 1], xe[o, 2], s, t, acc, accx, px)

    def stats(A, B, c, scale, r0, f0, chunk, pm, ps, pt, gAr, gAx):
        """Receiver pass over one slice of senders: row statistics and weighted sums of sender rows."""
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
        acc = cuda.local.array((OPT, D), dt)
        accx = cuda.local.array((OPT, D), dt)
        px = cuda.local.array(OPT, dt)
        rw = cuda.local.array((1, D), dt)
        kl = cuda.local.array((OPT, 2), dt)
        xe = cuda.local.array((OPT, 3), dt)
        nsl = -(scale * LB)  # logits in the exponential's units: x = -KL' LB = (-scale LB) (A . B + c)
        for o in range(OPT):
            ii = min(i0 + o * NT, NR - 1)
            for d in range(D):
                own[o, d] = A[f, ii, d] * nsl
                acc[o, d] = zero
                accx[o, d] = zero
            oc[o] = c[f, ii] * nsl
            m[o] = ninf
            s[o] = zero
            t[o] = zero
            px[o] = zero
        sX = cuda.shared.array((TS, D), dt)
        for j0 in range(j_begin, j_end, TS):
            cuda.syncthreads()
            for r in range(tid, TS * D, NT):
                row = r // D
                if j0 + row < j_end:
                    sX[row, r - row * D] = B[f, j0 + row, r - row * D]
            cuda.syncthreads()
            # (unsigned 32-bit counters in while loops: 4 instructions of loop control and addressing per
            # sender, against 12 for a range loop over int32, which also wraps negative indices)
            nj = uint32(min(TS, j_end - j0))
            jj = uint32(0)
            if j0 < hi and j0 + int64(nj) > lo:  # a tile with the block's own agents: skip i == j
                while jj < nj:
                    for d in range(D):  # the sender's row once into registers, for all OPT owners
                        rw[0, d] = sX[jj, d]
                    skip = owner(j0 - g0 + int64(jj))  # the owner that is this sender, if any
                    meet(own, rw, oc, kl, xe, m, s, t, acc, accx, px, skip)
                    jj = uint32(jj + one_u)
            else:
                while jj < nj:
                    for d in range(D):
                        rw[0, d] = sX[jj, d]
                    meet(own, rw, oc, kl, xe, m, s, t, acc, accx, px, -1)
                    jj = uint32(jj + one_u)
        for o in range(OPT):  # back to natural units: logits, KL' and deltas divide by LB (t sums e x)
            i = i0 + o * NT
            if i < NR:
                pm[sl, f, i] = m[o] * inv_lb
                ps[sl, f, i] = s[o]
                pt[sl, f, i] = -(t[o] * inv_lb)
                for d in range(D):
                    gAr[sl, f, i, d] = acc[o, d]
                if expected:
                    for d in range(D):
                        gAx[sl, f, i, d] = accx[o, d] * inv_lb
                    gAx[sl, f, i, D] = px[o] * inv_lb

    def merge(pm, ps, pt, kappa, f0, m, inv_s, abar, energy, gAr, gAx):
        """Merge the slices' statistics in slice order; per-receiver energy kappa * A_kappa'; the slices'
        weighted sums become sum_j W_ij (B_j, 1) in gAr[0] (each slice's part added in slice order).
        One thread per receiver and column of (B_j, 1) (:func:`merge_blocks`): each merges its receiver's
        statistics (the column-0 thread writes them) and sums its column over the slices in a register."""
        q = cuda.grid(1)
        f = f0 + cuda.blockIdx.y
        i = q // (D + 1)
        col = q - i * (D + 1)
        if i >= pm.shape[2]:
            return
        S = pm.shape[0]
        mm = pm[0, f, i]
        ss = ps[0, f, i]
        tt = pt[0, f, i]
        for sl in range(1, S):
            mm, ss, tt = lse_merge(mm, ss, tt, pm[sl, f, i], ps[sl, f, i], pt[sl, f, i])
        inv = one / ss if ss > zero else zero * ss
        if col == 0:
            m[f, i] = mm
            inv_s[f, i] = inv
            abar[f, i] = row_abar(ss, tt)
            energy[f, i] = kappa[f] * row_energy(mm, ss, tt, one, agg)
        # expected: ap = sum_j beta_j (m - x_j), the mean KL' above the row's least (no cancellation)
        ap = zero
        if expected:
            for sl in range(S):
                sk = ps[sl, f, i]
                if sk > zero:
                    ap += math.exp(pm[sl, f, i] - mm) * (gAx[sl, f, i, D] + (mm - pm[sl, f, i]) * sk)
            ap *= inv
        total = zero
        for sl in range(S):  # this column of the slices' parts of sum_j W_ij (B_j, 1), in slice order
            sk = ps[sl, f, i]
            if sk > zero:
                w = math.exp(pm[sl, f, i] - mm) * inv  # this slice's exp(x - m_sl) -> beta
            else:
                w = zero
            g = gAr[sl, f, i, col] if col < D else sk
            if expected:  # W_j = beta_j (1 + ap - delta_j), delta_j = m - x_j
                sh = mm - pm[sl, f, i] if sk > zero else zero
                v = w * (one + ap) * g - w * (gAx[sl, f, i, col] + sh * g)
            else:
                v = w * g
            total = v if sl == 0 else total + v
        gAr[0, f, i, col] = total

    def send(own, rw, rc, ri, rq, acc, kl, skip, n_own):
        """Receiver row rw (rc: its logits' constant, less its maximum; ri = 1 / s; rq: ``expected``'s
        constant) meets owners o < n_own but ``skip`` (senders): acc[o] += W LB^e A''_i (A'' = -scale LB A,
        the row as loaded; e = 1 for ``expected``), the logits and exponentials of all owners first. (The
        exponent keeps no log s: a rounded y of magnitude log2 s would cost its weights precision.)"""
        for o in range(OPT):
            kl[o, 0] = rc
            kl[o, 1] = zero
        dots(own, rw, kl)
        for o in range(OPT):
            y = kl[o, 0] + kl[o, 1]  # = LB (x - m) <= 0
            w = ex(y) * ri  # beta
            if expected:  # W LB = beta LB (1 + abar - KL') = beta (y + rq), KL' = -(y / LB + m)
                w *= y + rq
            kl[o, 0] = w
        for o in range(OPT):
            if o != skip and o < n_own:
                accumulate_row(acc, o, kl[o, 0], rw, 0)

    def grads(A, B, c, scale, m, inv_s, abar, r0, f0, chunk, gBs):
        """Sender pass: per slice of receivers, sum_i W_ij A'_i for each sender j."""
        tid = cuda.threadIdx.x
        f = f0 + cuda.blockIdx.z
        sl = cuda.blockIdx.y
        NR = A.shape[1]
        N = B.shape[1]
        b0 = cuda.blockIdx.x * (NT * OPT)
        i0 = b0 + tid
        lo = b0  # the block's owners (senders, global indices) lo .. hi - 1
        hi = min(N, b0 + NT * OPT)
        k_begin = sl * chunk
        k_end = min(NR, k_begin + chunk)
        own = cuda.local.array((OPT, D), dt)
        acc = cuda.local.array((OPT, D), dt)
        rw = cuda.local.array((1, D), dt)
        kl = cuda.local.array((OPT, 2), dt)
        n_own = min(OPT, max(0, -(-(N - i0) // NT)))  # owners of this thread inside the senders
        for o in range(OPT):
            ii = min(i0 + o * NT, N - 1)
            for d in range(D):
                own[o, d] = B[f, ii, d]
                acc[o, d] = zero
        sX = cuda.shared.array((TS, D), dt)
        sc = cuda.shared.array(TS, dt)
        si = cuda.shared.array(TS, dt)
        sq = cuda.shared.array(TS, dt)
        nsl = -(scale * LB)
        for k0 in range(k_begin, k_end, TS):
            cuda.syncthreads()
            for r in range(tid, TS * D, NT):
                row = r // D
                if k0 + row < k_end:
                    col = r - row * D
                    sX[row, col] = A[f, k0 + row, col] * nsl
            for r in range(tid, TS, NT):
                if k0 + r < k_end:
                    k = k0 + r
                    sc[r] = c[f, k] * nsl - LB * m[f, k]
                    si[r] = inv_s[f, k]
                    if expected:
                        sq[r] = LB * ((one + abar[f, k]) + m[f, k])
            cuda.syncthreads()
            nk = uint32(min(TS, k_end - k0))
            # Checked pairs: tiles with the block's own agents (skip i == j) and the last, partial block
            # (skip owners past the end, whose clamped loads would count a sender twice).
            checked = (r0 + k0 < hi and r0 + k0 + int64(nk) > lo) or b0 + NT * OPT > N
            kk = uint32(0)
            if checked:
                while kk < nk:
                    for d in range(D):  # the receiver's row once into registers, for all OPT owners
                        rw[0, d] = sX[kk, d]
                    skip = owner(r0 + k0 - lo - tid + int64(kk))  # the owner that is this receiver, if any
                    send(own, rw, sc[kk], si[kk], sq[kk], acc, kl, skip, n_own)
                    kk = uint32(kk + one_u)
            else:
                while kk < nk:
                    for d in range(D):
                        rw[0, d] = sX[kk, d]
                    send(own, rw, sc[kk], si[kk], sq[kk], acc, kl, -1, OPT)
                    kk = uint32(kk + one_u)
        out = -(inv_lb * inv_lb) if expected else -inv_lb  # W A' = (W LB^e) A'' (-1 / LB^(1 + e))
        for o in range(OPT):
            i = i0 + o * NT
            if i < N:
                for d in range(D):
                    gBs[sl, f, i, d] = acc[o, d] * out

    dots = device(dots)
    owner = device(owner)
    add = device(add)
    push = device(push)
    meet = device(meet)
    send = device(send)
    pyfuncs = {"stats": stats, "merge": merge, "grads": grads}
    caps = dense_registers(D, dtype) if registers is None else registers
    stats_cap, grads_cap = caps
    ks = compile_kernels(pyfuncs, cache=registers is None, registers={"stats": stats_cap, "grads": grads_cap})
    layout = {"tile": TS, "threads": NT, "opt": OPT, "per_block": NT * OPT}
    return ks | layout | {"registers": caps, "mma": False}


def _clear_dense_caches() -> None:
    _dense_kernels.cache_clear()
    _mma_dense_kernels.cache_clear()


make_dense_kernels.cache_clear = _clear_dense_caches  # (a sweep's or a test's patched tables)


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


@functools.cache
def make_points_kernels(D: int, dtype: str, aggregator: str):
    """Weighted pairs batched over grid points (the contract of ``vfesim.pairwise.weighted.
    pairwise_points_weighted``) for one (feature width D, dtype, aggregator): pair weights u_r v_s
    outside the softmax, pairs only between rows of one point. Receiver features pre-halved (Ah, ch).

    rows[ceil(M_r / BLOCK), BLOCK](Ah, B, ch, u, v, point, lists, rowmap, index, mask, kappa, stats, erow,
        gA, gc, gu)
        receiver r at point[r]: senders s = rowmap[point[r], index[lists[r], q]] >= 0 under mask; the
        weighted statistics, stats (5, M_r) = (m, 1/s, abar, bbar, F), erow = u e, gu = e,
        gA = sum_s W B_s (unhalved), gc = sum_s W (unhalved); the KLs are recomputed, not stored
    senders[ceil(M_s / BLOCK), BLOCK](Ah, B, ch, u, v, s_point, s_agent, r_rowmap, ptr, src_list, kappa,
        stats, gB, gv)
        sender s (agent s_agent[s] at s_point[s]; s_agent < 0: no point, zeros): over the incoming edges
        e in ptr[j] .. ptr[j + 1] of agent j (list row src_list[e], ascending), the receiver
        r = r_rowmap[point, src_list[e]] >= 0: gB_s = sum_r W Ah_r, gv_s = sum_r dE_r/dv_s
    Memory O((M_r + M_s) D); every sum in a fixed order.
    """
    dt = _NB[np.dtype(dtype)]
    one = np.dtype(dtype).type(1.0)
    zero = np.dtype(dtype).type(0.0)
    ninf = np.dtype(dtype).type(-np.inf)
    agg = AGG_CODES[aggregator]

    def rows(Ah, B, ch, u, v, point, lists, rowmap, index, mask, kappa, stats, erow, gA, gc, gu):
        r = cuda.grid(1)
        if r >= Ah.shape[0]:
            return
        p = point[r]
        li = lists[r]
        m, s, t, b = ninf, zero, zero, zero
        for q in range(index.shape[1]):
            if mask[li, q]:
                sr = rowmap[p, index[li, q]]
                if sr >= 0:
                    kl = pair_kl(Ah, r, B, sr, ch)
                    m, s, t, b = lse_push_w(m, s, t, b, pair_logit(kl, kappa), kl, v[sr])
        ur = u[r]
        e1 = row_unit_energy_w(m, s, t, b, kappa, agg)
        erow[r] = ur * e1
        gu[r] = e1
        ab, bb, F = row_means_w(m, s, t, b, kappa)
        inv = one / s if s > zero else zero
        stats[0, r] = m
        stats[1, r] = inv
        stats[2, r] = ab
        stats[3, r] = bb
        stats[4, r] = F
        acc = cuda.local.array((1, D), dt)
        for d in range(D):
            acc[0, d] = zero
        ws = zero
        if s > zero:
            for q in range(index.shape[1]):
                if mask[li, q]:
                    sr = rowmap[p, index[li, q]]
                    if sr >= 0:
                        kl = pair_kl(Ah, r, B, sr, ch)
                        w, wv = pair_weight_w(kl, v[sr], ur, m, inv, ab, bb, F, kappa, agg)
                        accumulate_row(acc, 0, w, B, sr)
                        ws += w
        for d in range(D):
            gA[r, d] = acc[0, d]
        gc[r] = ws

    def senders(Ah, B, ch, u, v, s_point, s_agent, r_rowmap, ptr, src_list, kappa, stats, gB, gv):
        sr = cuda.grid(1)
        if sr >= B.shape[0]:
            return
        j = s_agent[sr]
        acc = cuda.local.array((1, D), dt)
        for d in range(D):
            acc[0, d] = zero
        av = zero
        if j >= 0:
            p = s_point[sr]
            vs = v[sr]
            for e in range(ptr[j], ptr[j + 1]):
                r = r_rowmap[p, src_list[e]]
                if r >= 0:
                    kl = pair_kl(Ah, r, B, sr, ch)
                    w, wv = pair_weight_w(
                        kl,
                        vs,
                        u[r],
                        stats[0, r],
                        stats[1, r],
                        stats[2, r],
                        stats[3, r],
                        stats[4, r],
                        kappa,
                        agg,
                    )
                    accumulate_row(acc, 0, w, Ah, r)
                    av += wv
        for d in range(D):
            gB[sr, d] = acc[0, d]
        gv[sr] = av

    return compile_kernels({"rows": rows, "senders": senders})
