"""numba.cuda kernels of the Gaussian per-agent stages (SPEC §2.1, §2.3): frames, features, self KL and
the adjoint, written once for two launch shapes.

- one thread per agent (:func:`make_agent_kernels`, small K): the agent's K x K scratch stays in
  registers (K = 3) or local memory;
- one thread block per agent (:func:`make_block_kernels`, large K): the scratch lives in shared memory
  and every matrix phase is split over the block's threads (element loops ``for e in range(t, K*K, nt)``,
  separated by barriers).
The source is the same: with one thread, t = 0, nt = 1 and the barriers compile away (``blockwise`` is a
compile-time constant, so the other branch is pruned).

At K = 21 one thread per agent keeps the matrices in local memory and runs ~10^5 dependent FMAs per thread;
a block of ~K^2 threads per agent computes each matrix product as one phase. Measured on the H200 at
N = 1024, K = 21 float64 (benchmarks/profile_large_k.py; benchmarks/results/gpu_profile_large_k.log): the
batched CuPy code the block kernels replaced took 5.9 ms of a 6.7 ms evaluation in its per-agent stages
(hundreds of small launches, cuSOLVER calls, host-bound); the four block kernels take 0.74 ms.

Layout: a leading "term" axis f of length 2 holds the belief (f = 0, q) and prior (f = 1, p) terms; a launch
covers terms ``f0 .. f0 + nf - 1``, so an inactive term costs nothing.

    mu (2, N, K), sigma (2, N, K, K), phi (N, 3), G (3, K, K) generators in the working dtype
    R (N, K, K); lam, P (2, N, K, K); nu, Pnu (2, N, K); ld (2, N)
    A, B (2, N, D) features, c (2, N);  KL_ij / kappa = A_i . B_j + c_i  (A and c pre-scaled by 1/(2 kappa))

Launches (N agents, nblk = ceil(N / BLOCK), nt = block_threads(K)):
    one thread per agent:   prep, self_kl, adjoint [nblk, BLOCK]; features [(nblk, nf), BLOCK]
    one block per agent:    prep, self_kl, adjoint [N, nt];       features [(N, nf), nt]
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .core import _NB, SIMULATOR, compile_kernels, cuda, device, feature_dim, jr_coeffs, jr_transpose_apply

__all__ = [
    "make_agent_kernels",
    "make_block_kernels",
    "make_gaussian_kernels",
    "block_kernels_fit",
    "block_threads",
    "BLOCK_SHARED_BYTES",
    "BLOCK_THREADS_MAX",
]

# Taylor degree-12 coefficients 1/k! and the scaling threshold of vfesim.groups.expm_so3.
_INV_FACT = tuple(1.0 / math.factorial(k) for k in range(13))
_THETA = 0.25

# Shared matrices of the largest block kernel (adjoint); block kernels are used while they fit in the
# 48 KB of static shared memory (K <= 27 in float64, K <= 38 in float32).
_BLOCK_MATRICES = 8
BLOCK_SHARED_BYTES = 48 * 1024


def block_kernels_fit(K: int, dtype) -> bool:
    """Whether the block-per-agent kernels' shared matrices fit for (K, dtype)."""
    vec = 8 * K
    return (_BLOCK_MATRICES * K * K + vec) * np.dtype(dtype).itemsize <= BLOCK_SHARED_BYTES


# Cap on the threads per block of the block kernels (element loops stride over K^2 > threads). Measured
# on the H200 at K = 21, N = 2048 (benchmarks/results/gpu_profile_large_k.log), whole evaluation: 448
# threads (one per element) 2.40 ms float64 / 2.12 ms float32, 256 threads 1.79 / 1.52 ms, 128 threads
# 1.49 / 1.30 ms: the Cholesky and substitution phases leave most threads idle, and smaller blocks let
# more agents share an SM. A register cap of 64 changed nothing beyond noise.
BLOCK_THREADS_MAX = 128


def block_threads(K: int) -> int:
    """Threads per block of the block kernels: K^2 rounded up to whole warps, at most BLOCK_THREADS_MAX.
    The simulator gets 8 threads, which also exercises the strided element loops (K^2 > threads)."""
    if SIMULATOR:
        return min(8, K * K)
    return min(BLOCK_THREADS_MAX, -(-K * K // 32) * 32)


def _bmm(X, Y, Z, K, t, nt, xt, yt):
    """Block phase Z = op(X) @ op(Y), op a transpose where ``xt`` / ``yt`` (compile-time constants at every
    call, so the branches fold); thread t of nt computes elements t, t + nt, ...; the caller syncs."""
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        acc = (X[0, a] if xt else X[a, 0]) * (Y[b, 0] if yt else Y[0, b])
        for k in range(1, K):
            acc += (X[k, a] if xt else X[a, k]) * (Y[b, k] if yt else Y[k, b])
        Z[a, b] = acc


def _bchol_inv(S, L, Linv, Sinv, K, t, nt, sync):
    """Block Cholesky S = L L^T and Sinv = S^-1 (exactly symmetric: both triangles summed in one order);
    returns ln|S| in every thread. Not SPD -> NaN. Ends with a barrier (when ``sync``).

    Right-looking: per column one scaling phase and one trailing-update phase (every phase O(1) deep;
    each entry still subtracts its products in the order k = 0, 1, ... of the left-looking
    _chol_inv). Linv by a column sweep (row k final, then eliminated from the rows below), again in
    forward-substitution order.
    """
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        if b <= a:
            L[a, b] = S[a, b]
        Linv[a, b] = 1.0 if a == b else 0.0
    if sync:
        cuda.syncthreads()
    for j in range(K):
        d = math.sqrt(L[j, j])
        for a in range(j + 1 + t, K, nt):
            L[a, j] = L[a, j] / d
        if sync:
            cuda.syncthreads()
        if t == 0:
            L[j, j] = d  # read by nobody in the trailing phase
        M = K - 1 - j
        for e in range(t, M * M, nt):
            a = e // M
            b = e - a * M
            if b <= a:
                L[j + 1 + a, j + 1 + b] -= L[j + 1 + a, j] * L[j + 1 + b, j]
        if sync:
            cuda.syncthreads()
    ld = 0.0 * S[0, 0]
    for j in range(K):
        ld += 2.0 * math.log(L[j, j])
    for k in range(K):
        for j in range(t, k + 1, nt):
            Linv[k, j] = Linv[k, j] / L[k, k]
        if sync:
            cuda.syncthreads()
        n = k + 1
        for e in range(t, (K - 1 - k) * n, nt):
            a = k + 1 + e // n
            j = e - (a - k - 1) * n
            Linv[a, j] -= L[a, k] * Linv[k, j]
        if sync:
            cuda.syncthreads()
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        acc = 0.0 * ld
        for k in range(max(a, b), K):
            acc += Linv[k, a] * Linv[k, b]
        Sinv[a, b] = acc
    if sync:
        cuda.syncthreads()
    return ld


def _bexpm_phi(p0, p1, p2, G, lmax, K, X, X2, X3, X4, E, T, t, nt, sync):
    """E = exp(phi . G) (SPEC §2.1): Taylor degree 12 (Paterson-Stockmeyer) and scaling and squaring, s the
    least integer with lmax |phi| / 2^s <= 1/4 (|phi . G|_2 = lmax |phi|, as vfesim.groups.expm_so3).
    X .. T are (K, K) scratch. Ends with a barrier (when ``sync``)."""
    th = math.sqrt(p0 * p0 + p1 * p1 + p2 * p2)
    r = lmax * th / _THETA
    s = 0
    scale = 1.0
    while r > 1.0 and s < 1100:  # a finite r needs < 1100 halvings; |phi| = inf ends as NaN, not a hang
        r *= 0.5
        scale *= 0.5
        s += 1
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        X[a, b] = (p0 * G[0, a, b] + p1 * G[1, a, b] + p2 * G[2, a, b]) * scale
    if sync:
        cuda.syncthreads()
    _bmm(X, X, X2, K, t, nt, False, False)
    if sync:
        cuda.syncthreads()
    _bmm(X2, X, X3, K, t, nt, False, False)
    _bmm(X2, X2, X4, K, t, nt, False, False)
    if sync:
        cuda.syncthreads()
    c = _INV_FACT
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        eye = 1.0 if a == b else 0.0
        E[a, b] = c[8] * eye + c[9] * X[a, b] + c[10] * X2[a, b] + c[11] * X3[a, b] + c[12] * X4[a, b]
    if sync:
        cuda.syncthreads()
    _bmm(X4, E, T, K, t, nt, False, False)
    if sync:
        cuda.syncthreads()
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        eye = 1.0 if a == b else 0.0
        E[a, b] = c[4] * eye + c[5] * X[a, b] + c[6] * X2[a, b] + c[7] * X3[a, b] + T[a, b]
    if sync:
        cuda.syncthreads()
    _bmm(X4, E, T, K, t, nt, False, False)
    if sync:
        cuda.syncthreads()
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        eye = 1.0 if a == b else 0.0
        E[a, b] = eye + X[a, b] + c[2] * X2[a, b] + c[3] * X3[a, b] + T[a, b]
    if sync:
        cuda.syncthreads()
    for _ in range(s):
        _bmm(E, E, T, K, t, nt, False, False)
        if sync:
            cuda.syncthreads()
        for e in range(t, K * K, nt):
            a = e // K
            b = e - a * K
            E[a, b] = T[a, b]
        if sync:
            cuda.syncthreads()


_bmm = device(_bmm)
_bchol_inv = device(_bchol_inv)
_bexpm_phi = device(_bexpm_phi)


@functools.cache
def make_gaussian_kernels(K: int, dtype: str, blockwise: bool, max_registers: int | None = None):
    """Kernels ``prep``, ``self_kl``, ``features``, ``adjoint`` for (K, dtype), one thread per agent
    (``blockwise`` False: scratch in registers/local memory) or one thread block per agent (True: scratch in
    shared memory, element loops strided over the block). One source: with one thread, t = 0 and nt = 1
    and the barriers vanish. Signatures in :func:`vfesim_kernels.cuda.kernel_signatures`.
    """
    dt = _NB[np.dtype(dtype)]
    D = feature_dim(K)
    T = K * (K + 1) // 2
    KK = K * K
    bmm = _bmm
    bchol_inv = _bchol_inv
    bexpm_phi = _bexpm_phi

    @device
    def barrier():
        if blockwise:
            cuda.syncthreads()

    @device
    def agent_index():
        """(agent i, this thread's rank t among the agent's nt threads). A block per agent has exactly N
        blocks, so the callers' bound check i < N only ever stops surplus threads of a thread per agent."""
        if blockwise:
            return cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        return cuda.grid(1), 0, 1

    def prep(phi, G, lmax, mu, sigma, jitter, f0, nf, R, lam, P, nu, ld):
        """Agent i: R = exp(phi . G); for terms f0 .. f0 + nf - 1: lam = R^T (Sigma + jitter I) R
        (symmetrised), P = lam^-1, ld = ln|lam|, nu = R^T mu (uncentred)."""
        i, t, nt = agent_index()
        if i >= phi.shape[0]:
            return
        # The agent's scratch: shared by the block, or the thread's own.
        Ms = cuda.shared.array((6, K, K), dt) if blockwise else cuda.local.array((6, K, K), dt)
        X, X2, X3, X4, E, Tm = Ms[0], Ms[1], Ms[2], Ms[3], Ms[4], Ms[5]
        bexpm_phi(phi[i, 0], phi[i, 1], phi[i, 2], G, lmax, K, X, X2, X3, X4, E, Tm, t, nt, blockwise)
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            R[i, a, b] = E[a, b]
        for f in range(f0, f0 + nf):
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                X[a, b] = sigma[f, i, a, b]
            barrier()
            # Tm = (Sigma + jitter I) R, X2 = R^T Tm, X = sym(X2)
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                acc = jitter * E[a, b]
                for k in range(K):
                    acc += X[a, k] * E[k, b]
                Tm[a, b] = acc
            barrier()
            bmm(E, Tm, X2, K, t, nt, True, False)
            barrier()
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                v = 0.5 * (X2[a, b] + X2[b, a])
                X[a, b] = v
                lam[f, i, a, b] = v
            for a in range(t, K, nt):
                acc = E[0, a] * mu[f, i, 0]
                for k in range(1, K):
                    acc += E[k, a] * mu[f, i, k]
                nu[f, i, a] = acc
            barrier()
            d = bchol_inv(X, X2, X3, X4, K, t, nt, blockwise)
            if t == 0:
                ld[f, i] = d
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                P[f, i, a, b] = X4[a, b]
            barrier()

    def self_kl(mu, sigma, jitter, lam_self, e_out, g_mu, g_sigma):
        """Agent i: lam_self * KL(q_i || p_i) into e_out (N,); gradient added to g_mu, g_sigma."""
        i, t, nt = agent_index()
        if i >= mu.shape[1]:
            return
        # The agent's scratch: shared by the block, or the thread's own.
        Ms = cuda.shared.array((7, K, K), dt) if blockwise else cuda.local.array((7, K, K), dt)
        Vs = cuda.shared.array((3, K), dt) if blockwise else cuda.local.array((3, K), dt)
        Sq, Sp, L, Li, Sqi, Spi, W = Ms[0], Ms[1], Ms[2], Ms[3], Ms[4], Ms[5], Ms[6]
        d, Spd, rs = Vs[0], Vs[1], Vs[2]
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            eye = jitter if a == b else 0.0 * jitter
            Sq[a, b] = sigma[0, i, a, b] + eye
            Sp[a, b] = sigma[1, i, a, b] + eye
        for a in range(t, K, nt):
            d[a] = mu[1, i, a] - mu[0, i, a]
        barrier()
        ld_q = bchol_inv(Sq, L, Li, Sqi, K, t, nt, blockwise)
        ld_p = bchol_inv(Sp, L, Li, Spi, K, t, nt, blockwise)
        for a in range(t, K, nt):
            acc = Spi[a, 0] * d[0]
            for b in range(1, K):
                acc += Spi[a, b] * d[b]
            Spd[a] = acc
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            W[a, b] = Spi[a, b] * Sq[b, a]
        bmm(Spi, Sq, L, K, t, nt, False, False)
        barrier()
        # Trace and quadratic form by row sums, then one thread in row order (deterministic).
        for a in range(t, K, nt):
            acc = W[a, 0]
            for b in range(1, K):
                acc += W[a, b]
            rs[a] = acc
        bmm(L, Spi, Li, K, t, nt, False, False)
        barrier()
        if t == 0:
            tr = rs[0]
            quad = d[0] * Spd[0]
            for a in range(1, K):
                tr += rs[a]
                quad += d[a] * Spd[a]
            e_out[i] = lam_self * 0.5 * (tr + quad - K + ld_p - ld_q)
        for a in range(t, K, nt):
            g_mu[0, i, a] -= lam_self * Spd[a]
            g_mu[1, i, a] += lam_self * Spd[a]
        h = 0.5 * lam_self
        # inner = Sp^-1 Sq Sp^-1 (symmetrised) + Spd Spd^T, in Li
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            g_sigma[0, i, a, b] += h * (Spi[a, b] - Sqi[a, b])
            inner = 0.5 * (Li[a, b] + Li[b, a]) + Spd[a] * Spd[b]
            g_sigma[1, i, a, b] += h * (Spi[a, b] - inner)

    def features(lam, P, nu, nubar, ld, scale, f0, A, B, c, nuc, Pnu):
        """Agent i, term f0 + blockIdx.y: features (SPEC §2.3) from centred nu; A and c are multiplied by
        scale[f] = 1 / (2 kappa_f)."""
        i, t, nt = agent_index()
        if i >= lam.shape[1]:
            return
        f = f0 + cuda.blockIdx.y
        Vs = cuda.shared.array((2, K), dt) if blockwise else cuda.local.array((2, K), dt)
        v, pv = Vs[0], Vs[1]
        ik = scale[f]
        for a in range(t, K, nt):
            v[a] = nu[f, i, a] - nubar[f, a]
            nuc[f, i, a] = v[a]
        barrier()
        for a in range(t, K, nt):
            acc = P[f, i, a, 0] * v[0]
            for b in range(1, K):
                acc += P[f, i, a, b] * v[b]
            pv[a] = acc
            Pnu[f, i, a] = acc
            A[f, i, T + a] = v[a] * ik
            B[f, i, T + a] = -2.0 * acc
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            if a <= b:
                p = a * K - (a * (a - 1)) // 2 + b - a
                M = lam[f, i, a, b] + v[a] * v[b]
                A[f, i, p] = (M if a == b else 2.0 * M) * ik
                B[f, i, p] = P[f, i, a, b]
        barrier()
        if t == 0:
            s = v[0] * pv[0]
            for a in range(1, K):
                s += v[a] * pv[a]
            A[f, i, D - 1] = ik
            B[f, i, D - 1] = s + ld[f, i]
            c[f, i] = (-ld[f, i] - K) * ik

    def adjoint(
        phi, G, R, mu, sigma, jitter, nuc, P, Pnu, gAr, gBs, lam_w, kappa, f0, nf, g_mu, g_sigma, g_phi
    ):
        """Agent i: the adjoint of the features and the frame (SPEC §2.3; vfesim.gaussian.features_vjp and
        vfesim.groups.phi_grad_from_R), added into g_mu, g_sigma (2, N, ...) and g_phi (N, 3).

        gAr (S_r, 2, N, D+1): receiver slices of sum_j W_ij B_j and (last column) sum_j W_ij (one slice
        from the dense streaming kernels, whose merge sums them);
        gBs (S_s, 2, N, D): sender slices of sum_i W_ij A_i / (2 kappa) (pre-scaled A: factor 2 kappa).
        lam_w (2,): the term weights lambda.
        """
        i, t, nt = agent_index()
        if i >= phi.shape[0]:
            return
        # The agent's scratch: shared by the block, or the thread's own.
        Ms = cuda.shared.array((8, K, K), dt) if blockwise else cuda.local.array((8, K, K), dt)
        Vs = cuda.shared.array((7, K), dt) if blockwise else cuda.local.array((7, K), dt)
        Rl, gR, GM, GP, Pl, Sg, T1, T2 = Ms[0], Ms[1], Ms[2], Ms[3], Ms[4], Ms[5], Ms[6], Ms[7]
        nv, gan, gv, gnu, hrow = Vs[0], Vs[1], Vs[2], Vs[3], Vs[4:7]
        Sr = gAr.shape[0]
        Ss = gBs.shape[0]
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            Rl[a, b] = R[i, a, b]
            gR[a, b] = 0.0
        for f in range(f0, f0 + nf):
            hr = 0.5 * lam_w[f]
            hs = 2.0 * hr * kappa[f]
            # Sum the slices of the pair kernels' cotangents, slice by slice (ascending s, as one sum per
            # element): with the slice loop outside, the element loops have constant trip counts and unroll,
            # so a thread's matrices stay in registers.
            for s in range(max(Sr, Ss)):
                for e in range(t, KK, nt):
                    a = e // K
                    b = e - a * K
                    lo = min(a, b)
                    hi = max(a, b)
                    p = lo * K - (lo * (lo - 1)) // 2 + hi - lo  # packed upper-triangle index of (lo, hi)
                    if s == 0:
                        GM[a, b] = gAr[0, f, i, p]
                        GP[a, b] = gBs[0, f, i, p]
                    else:
                        if s < Sr:
                            GM[a, b] += gAr[s, f, i, p]
                        if s < Ss:
                            GP[a, b] += gBs[s, f, i, p]
                for a in range(t, K, nt):
                    if s == 0:
                        gan[a] = gAr[0, f, i, T + a]
                        gv[a] = gBs[0, f, i, T + a]
                    else:
                        if s < Sr:
                            gan[a] += gAr[s, f, i, T + a]
                        if s < Ss:
                            gv[a] += gBs[s, f, i, T + a]
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                GM[a, b] = hr * GM[a, b]
                # B holds P[triu] once: the off-diagonal cotangent splits over (a, b) and (b, a).
                GP[a, b] = hs * GP[a, b] if a == b else 0.5 * hs * GP[a, b]
                Pl[a, b] = P[f, i, a, b]
                Sg[a, b] = sigma[f, i, a, b]
            for a in range(t, K, nt):
                gan[a] = hr * gan[a]
                gv[a] = hs * gv[a]
                nv[a] = nuc[f, i, a]
            w = gBs[0, f, i, D - 1]
            for s in range(1, Ss):
                w += gBs[s, f, i, D - 1]
            gs = hs * w
            u = gAr[0, f, i, D]
            for s in range(1, Sr):
                u += gAr[s, f, i, D]
            gc = hr * u
            barrier()
            # g_nu = 2 GM nu + g_anu - 2 P gv + 2 gs P nu
            for a in range(t, K, nt):
                acc = gan[a] + 2.0 * gs * Pnu[f, i, a]
                for b in range(K):
                    acc += 2.0 * (GM[a, b] * nv[b] - Pl[a, b] * gv[b])
                gnu[a] = acc
            # GP <- GP - gv nu^T - nu gv^T + gs nu nu^T; G_lam = GM - P GP P + (gs - gc) P  (into GM)
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                GP[a, b] += gs * nv[a] * nv[b] - gv[a] * nv[b] - nv[a] * gv[b]
            barrier()
            bmm(Pl, GP, T1, K, t, nt, False, False)
            barrier()
            gld = gs - gc
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                acc = T1[a, 0] * Pl[0, b]
                for k in range(1, K):
                    acc += T1[a, k] * Pl[k, b]
                GM[a, b] += gld * Pl[a, b] - acc
            # g_mu += R g_nu; T1 = R G_lam; g_sigma += sym(T1 R^T); gR += 2 (Sigma + jitter I) T1 + mu g_nu^T
            for a in range(t, K, nt):
                acc = Rl[a, 0] * gnu[0]
                for k in range(1, K):
                    acc += Rl[a, k] * gnu[k]
                g_mu[f, i, a] += acc
            barrier()
            bmm(Rl, GM, T1, K, t, nt, False, False)
            barrier()
            bmm(T1, Rl, T2, K, t, nt, False, True)
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                acc = jitter * T1[a, b]
                for k in range(K):
                    acc += Sg[a, k] * T1[k, b]
                gR[a, b] += 2.0 * acc + mu[f, i, a] * gnu[b]
            barrier()
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                g_sigma[f, i, a, b] += 0.5 * (T2[a, b] + T2[b, a])
            barrier()
        # dF/dphi = Jr^T h, h_b = <R^T gR, G_b>: elementwise products, row sums, then one thread in order.
        bmm(Rl, gR, T1, K, t, nt, True, False)
        barrier()
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            GM[a, b] = T1[a, b] * G[0, a, b]
            GP[a, b] = T1[a, b] * G[1, a, b]
            T2[a, b] = T1[a, b] * G[2, a, b]
        barrier()
        for a in range(t, K, nt):
            h0 = GM[a, 0]
            h1 = GP[a, 0]
            h2 = T2[a, 0]
            for b in range(1, K):
                h0 += GM[a, b]
                h1 += GP[a, b]
                h2 += T2[a, b]
            hrow[0, a] = h0
            hrow[1, a] = h1
            hrow[2, a] = h2
        barrier()
        if t == 0:
            h0 = hrow[0, 0]
            h1 = hrow[1, 0]
            h2 = hrow[2, 0]
            for a in range(1, K):
                h0 += hrow[0, a]
                h1 += hrow[1, a]
                h2 += hrow[2, a]
            p0 = phi[i, 0]
            p1 = phi[i, 1]
            p2 = phi[i, 2]
            # float64 coefficients even for float32 states: (1 - cos t)/t^2 cancels in float32.
            c1, c2 = jr_coeffs(1.0 * p0 * p0 + 1.0 * p1 * p1 + 1.0 * p2 * p2)
            g0, g1, g2 = jr_transpose_apply(p0, p1, p2, h0, h1, h2, c1, c2)
            g_phi[i, 0] += g0
            g_phi[i, 1] += g1
            g_phi[i, 2] += g2

    pyfuncs = {"prep": prep, "self_kl": self_kl, "features": features, "adjoint": adjoint}
    return compile_kernels(pyfuncs, registers=dict.fromkeys(pyfuncs, max_registers) if blockwise else None)


def make_agent_kernels(K: int, dtype: str):
    """One thread per agent (see the module docstring for launches)."""
    return make_gaussian_kernels(K, dtype, False)


def make_block_kernels(K: int, dtype: str, max_registers: int | None = None):
    """One thread block per agent, ``block_threads(K)`` threads (see the module docstring)."""
    return make_gaussian_kernels(K, dtype, True, max_registers)
