"""numba.cuda kernels of the Gaussian free energy (SPEC §2.1–2.4): frames, features, pairwise, adjoint.

The only module of the package that imports ``numba.cuda`` (ECOSYSTEM: a later switch of the CUDA
Python layer is then one edit). Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on NumPy arrays.

Layout: a leading "term" axis f of length 2 holds the belief (f = 0, q) and prior (f = 1, p) alignment
terms; a launch covers terms ``f0 .. f0 + nf - 1`` (grid axis z), so the inactive term costs nothing.

    mu (2, N, K), sigma (2, N, K, K), phi (N, 3), G (3, K, K) generators in the working dtype
    R (N, K, K); lam, P (2, N, K, K); nu, Pnu (2, N, K); ld (2, N)
    A, B (2, N, D) features, c (2, N);  KL_ij / kappa = A_i . B_j + c_i  (A and c pre-scaled by 1/(2 kappa))

The pairwise kernels use the per-pair math of :mod:`vfesim_kernels.pair_math`, compiled here as inlined
device functions. A and c enter multiplied by 1/(2 kappa) (pair_math takes halved receiver features),
so the logits are -KL / kappa with no division in the inner loops: the weights W_ij are unchanged,
energies scale by kappa and the sender cotangent by 2 kappa (see :func:`make_dense_kernels`).

Dense pairs (flash-attention pattern, no N x N array, no float atomics):
  1. ``stats``: owner thread = receiver, others = sender tiles in shared memory; online log-sum-exp
     over one slice of the senders (grid axis y splits the senders, for parallelism at moderate N);
  2. ``merge``: per receiver, merge the slices' statistics in slice order (``lse_merge``); energies;
  3. ``grads``: grid axis y < S: receiver role, sum_j W_ij B_j (and sum_j W_ij) per slice;
     y >= S: sender role, sum_i W_ij A_i per slice. Slices are summed, in order, by the adjoint kernel.
Every sum runs in a fixed order, so results are bitwise reproducible on one device.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, float64
from numba.core import config as _numba_config

from . import agent_math as _am
from . import pair_math as _pm

__all__ = [
    "SIMULATOR",
    "cuda",
    "as_device_view",
    "feature_dim",
    "dense_splits",
    "make_agent_kernels",
    "make_dense_kernels",
    "make_sparse_kernels",
    "make_block_kernels",
    "block_kernels_fit",
    "block_threads",
    "block_kernel_signatures",
    "make_gemm_row_kernel",
    "kernel_signatures",
    "BLOCK",
]

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
# Small grids are deliberate at small N; numba's low-occupancy warning would be an error under pytest.
_numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = False

# Threads per block of the per-agent kernels. The simulator spawns one Python thread per CUDA thread
# of a block, so it gets small blocks.
BLOCK = 8 if SIMULATOR else 128
# Dense pairwise: threads per block, owners per thread (register blocking: each shared-memory row is
# reused by OPT owners), and the block count the split heuristic aims for (~4 blocks per SM on an H200).
PAIR_THREADS = 4 if SIMULATOR else 128
PAIR_OPT = 2
TARGET_BLOCKS = 8 if SIMULATOR else 528
# Static shared memory per block stays under the 48 KB that needs no opt-in.
SHARED_BYTES = 40 * 1024

_NB = {np.dtype(np.float32): float32, np.dtype(np.float64): float64}


def _device(fn):
    """Compile a plain Python function as a CUDA device function inlined at the Numba IR level.

    IR-level inlining (``inline="always"``) also lets ``compile_ptx`` build kernels without a GPU: a
    separately compiled device function would ask the driver for the current device.
    """
    return cuda.jit(device=True, inline="always")(fn)


pair_kl = _device(_pm.pair_kl)
pair_logit = _device(_pm.pair_logit)
lse_push = _device(_pm.lse_push)
lse_merge = _device(_pm.lse_merge)
row_abar = _device(_pm.row_abar)
row_energy = _device(_pm.row_energy)
pair_weight = _device(_pm.pair_weight)
accumulate_row = _device(_pm.accumulate_row)
jr_coeffs = _device(_am.jr_coeffs)
jr_transpose_apply = _device(_am.jr_transpose_apply)
AGG_CODES = {"expected": _pm.AGG_EXPECTED, "softmin": _pm.AGG_SOFTMIN}


def feature_dim(K: int) -> int:
    return K * (K + 1) // 2 + K + 1


def as_device_view(a):
    """A numba device view of a CuPy array (wrapped once, then reused: cheaper launches); NumPy as is."""
    if SIMULATOR or isinstance(a, np.ndarray):
        return a
    return cuda.as_cuda_array(a)


# ------------------------------------------------------------------------------------------------
# Per-agent linear algebra (device functions on small local matrices, K a compile-time int)
# ------------------------------------------------------------------------------------------------

# Taylor degree-12 coefficients 1/k! and the scaling threshold of vfesim.groups.expm_so3.
_INV_FACT = tuple(1.0 / math.factorial(k) for k in range(13))
_THETA = 0.25


def _matmul(X, Y, Z, K):
    """Z = X @ Y for (K, K) local arrays (Z distinct from X and Y)."""
    for a in range(K):
        for b in range(K):
            acc = X[a, 0] * Y[0, b]
            for k in range(1, K):
                acc += X[a, k] * Y[k, b]
            Z[a, b] = acc


def _expm_phi(p0, p1, p2, G, lmax, K, X, X2, X3, X4, E, T):
    """E = exp(phi . G) (SPEC §2.1), Taylor degree 12 (Paterson-Stockmeyer) + scaling and squaring.

    s is the least integer with lmax |phi| / 2^s <= 1/4 (|phi . G|_2 = lmax |phi|), as in
    vfesim.groups.expm_so3. X .. T are (K, K) scratch arrays.
    """
    t = math.sqrt(p0 * p0 + p1 * p1 + p2 * p2)
    r = lmax * t / _THETA
    s = 0
    scale = 1.0
    while r > 1.0:
        r *= 0.5
        scale *= 0.5
        s += 1
    for a in range(K):
        for b in range(K):
            X[a, b] = (p0 * G[0, a, b] + p1 * G[1, a, b] + p2 * G[2, a, b]) * scale
    _matmul(X, X, X2, K)
    _matmul(X2, X, X3, K)
    _matmul(X2, X2, X4, K)
    c = _INV_FACT
    for a in range(K):
        for b in range(K):
            eye = 1.0 if a == b else 0.0
            E[a, b] = c[8] * eye + c[9] * X[a, b] + c[10] * X2[a, b] + c[11] * X3[a, b] + c[12] * X4[a, b]
    _matmul(X4, E, T, K)
    for a in range(K):
        for b in range(K):
            eye = 1.0 if a == b else 0.0
            E[a, b] = c[4] * eye + c[5] * X[a, b] + c[6] * X2[a, b] + c[7] * X3[a, b] + T[a, b]
    _matmul(X4, E, T, K)
    for a in range(K):
        for b in range(K):
            eye = 1.0 if a == b else 0.0
            E[a, b] = eye + X[a, b] + c[2] * X2[a, b] + c[3] * X3[a, b] + T[a, b]
    for _ in range(s):
        _matmul(E, E, T, K)
        for a in range(K):
            for b in range(K):
                E[a, b] = T[a, b]


def _chol_inv(S, L, Linv, Sinv, K):
    """Cholesky S = L L^T, Sinv = S^-1 (exactly symmetric); returns ln|S|. Not SPD -> NaN."""
    ld = 0.0
    for j in range(K):
        d = S[j, j]
        for k in range(j):
            d -= L[j, k] * L[j, k]
        d = math.sqrt(d)
        L[j, j] = d
        ld += 2.0 * math.log(d)
        for a in range(j + 1, K):
            v = S[a, j]
            for k in range(j):
                v -= L[a, k] * L[j, k]
            L[a, j] = v / d
    # Linv lower triangular by forward substitution; S^-1 = Linv^T Linv.
    for j in range(K):
        for a in range(K):
            Linv[a, j] = 0.0
        Linv[j, j] = 1.0 / L[j, j]
        for a in range(j + 1, K):
            v = 0.0 * ld
            for k in range(j, a):
                v -= L[a, k] * Linv[k, j]
            Linv[a, j] = v / L[a, a]
    for a in range(K):
        for b in range(a, K):
            acc = 0.0 * ld
            for k in range(b, K):
                acc += Linv[k, a] * Linv[k, b]
            Sinv[a, b] = acc
            Sinv[b, a] = acc
    return ld


# Rebind to the device versions: device functions call each other through module globals.
_matmul = _device(_matmul)
_expm_phi = _device(_expm_phi)
_chol_inv = _device(_chol_inv)


@functools.cache
def make_agent_kernels(K: int, dtype: str):
    """Per-agent kernels for latent dimension K and a float dtype (one compiled family per (K, dtype)).

    Returns a dict of dispatchers: ``prep``, ``features``, ``self_kl``, ``adjoint`` (signatures in
    :func:`kernel_signatures`). One thread per agent; launch with ``[ceil(N / BLOCK), nf], BLOCK``
    (``self_kl`` with a 1-D grid).
    """
    dt = _NB[np.dtype(dtype)]
    D = feature_dim(K)
    T = K * (K + 1) // 2
    matmul = _matmul
    expm_phi = _expm_phi
    chol_inv = _chol_inv

    def prep(phi, G, lmax, mu, sigma, jitter, f0, R, lam, P, nu, ld):
        """R_i = exp(phi_i . G); per term: lam = R^T (Sigma + jitter I) R (symmetrised), P = lam^-1,
        ld = ln|lam|, nu = R^T mu (uncentred). Grid y = term (f0 + y)."""
        i = cuda.grid(1)
        f = f0 + cuda.blockIdx.y
        if i >= phi.shape[0]:
            return
        X = cuda.local.array((K, K), dt)
        X2 = cuda.local.array((K, K), dt)
        X3 = cuda.local.array((K, K), dt)
        X4 = cuda.local.array((K, K), dt)
        E = cuda.local.array((K, K), dt)
        Tm = cuda.local.array((K, K), dt)
        expm_phi(phi[i, 0], phi[i, 1], phi[i, 2], G, lmax, K, X, X2, X3, X4, E, Tm)
        if cuda.blockIdx.y == 0:
            for a in range(K):
                for b in range(K):
                    R[i, a, b] = E[a, b]
        # Tm = (Sigma + jitter I) R, X = R^T Tm
        for a in range(K):
            for b in range(K):
                acc = jitter * E[a, b]
                for k in range(K):
                    acc += sigma[f, i, a, k] * E[k, b]
                Tm[a, b] = acc
        for a in range(K):
            for b in range(K):
                acc = E[0, a] * Tm[0, b]
                for k in range(1, K):
                    acc += E[k, a] * Tm[k, b]
                X[a, b] = acc
        for a in range(K):
            for b in range(a, K):
                v = 0.5 * (X[a, b] + X[b, a])
                X2[a, b] = v
                X2[b, a] = v
                lam[f, i, a, b] = v
                lam[f, i, b, a] = v
        d = chol_inv(X2, X3, X4, X, K)
        ld[f, i] = d
        for a in range(K):
            for b in range(K):
                P[f, i, a, b] = X[a, b]
        for a in range(K):
            acc = E[0, a] * mu[f, i, 0]
            for k in range(1, K):
                acc += E[k, a] * mu[f, i, k]
            nu[f, i, a] = acc

    def features(lam, P, nu, nubar, ld, scale, f0, A, B, c, nuc, Pnu):
        """Features (SPEC §2.3) from centred nu; A and c are multiplied by scale[f] = 1 / (2 kappa_f)."""
        i = cuda.grid(1)
        f = f0 + cuda.blockIdx.y
        if i >= lam.shape[1]:
            return
        ik = scale[f]
        v = cuda.local.array(K, dt)
        for a in range(K):
            v[a] = nu[f, i, a] - nubar[f, a]
            nuc[f, i, a] = v[a]
        s = 0.0 * ik
        for a in range(K):
            acc = P[f, i, a, 0] * v[0]
            for b in range(1, K):
                acc += P[f, i, a, b] * v[b]
            Pnu[f, i, a] = acc
            A[f, i, T + a] = v[a] * ik
            B[f, i, T + a] = -2.0 * acc
            s += v[a] * acc
        p = 0
        for a in range(K):
            for b in range(a, K):
                M = lam[f, i, a, b] + v[a] * v[b]
                A[f, i, p] = (M if a == b else 2.0 * M) * ik
                B[f, i, p] = P[f, i, a, b]
                p += 1
        A[f, i, D - 1] = ik
        B[f, i, D - 1] = s + ld[f, i]
        c[f, i] = (-ld[f, i] - K) * ik

    def self_kl(mu, sigma, jitter, lam_self, e, g_mu, g_sigma):
        """lam_self * KL(q_i || p_i) into e (N,); its gradient added to g_mu, g_sigma (terms 0 = q, 1 = p)."""
        i = cuda.grid(1)
        if i >= mu.shape[1]:
            return
        Sq = cuda.local.array((K, K), dt)
        Sp = cuda.local.array((K, K), dt)
        L = cuda.local.array((K, K), dt)
        Li = cuda.local.array((K, K), dt)
        Sqi = cuda.local.array((K, K), dt)
        Spi = cuda.local.array((K, K), dt)
        d = cuda.local.array(K, dt)
        Spd = cuda.local.array(K, dt)
        for a in range(K):
            for b in range(K):
                Sq[a, b] = sigma[0, i, a, b]
                Sp[a, b] = sigma[1, i, a, b]
            Sq[a, a] += jitter
            Sp[a, a] += jitter
            d[a] = mu[1, i, a] - mu[0, i, a]
        ld_q = chol_inv(Sq, L, Li, Sqi, K)
        ld_p = chol_inv(Sp, L, Li, Spi, K)
        tr = 0.0 * jitter
        quad = 0.0 * jitter
        for a in range(K):
            acc = Spi[a, 0] * d[0]
            for b in range(1, K):
                acc += Spi[a, b] * d[b]
            Spd[a] = acc
            quad += d[a] * acc
            for b in range(K):
                tr += Spi[a, b] * Sq[b, a]
        e[i] = lam_self * 0.5 * (tr + quad - K + ld_p - ld_q)
        h = 0.5 * lam_self
        for a in range(K):
            g_mu[0, i, a] -= lam_self * Spd[a]
            g_mu[1, i, a] += lam_self * Spd[a]
        # inner = Sp^-1 Sq Sp^-1 (symmetric) + Spd Spd^T; L and Li reused as scratch.
        matmul(Spi, Sq, L, K)
        matmul(L, Spi, Li, K)
        for a in range(K):
            for b in range(K):
                g_sigma[0, i, a, b] += h * (Spi[a, b] - Sqi[a, b])
                inner = 0.5 * (Li[a, b] + Li[b, a]) + Spd[a] * Spd[b]
                g_sigma[1, i, a, b] += h * (Spi[a, b] - inner)

    def adjoint(
        phi, G, R, mu, sigma, jitter, nuc, P, Pnu, gAr, gBs, lam_w, kappa, f0, nf, g_mu, g_sigma, g_phi
    ):
        """Per-agent adjoint of the features and the frame (SPEC §2.3; vfesim.gaussian.features_vjp and
        vfesim.groups.phi_grad_from_R), added into g_mu, g_sigma (2, N, ...) and g_phi (N, 3).

        gAr (S_r, 2, N, D+1): receiver slices of sum_j W_ij B_j and (last column) sum_j W_ij;
        gBs (S_s, 2, N, D): sender slices of sum_i W_ij A_i / (2 kappa) (pre-scaled A: factor 2 kappa).
        lam_w (2,): the term weights lambda.
        """
        i = cuda.grid(1)
        if i >= phi.shape[0]:
            return
        GM = cuda.local.array((K, K), dt)
        GP = cuda.local.array((K, K), dt)
        T1 = cuda.local.array((K, K), dt)
        T2 = cuda.local.array((K, K), dt)
        Rl = cuda.local.array((K, K), dt)
        gR = cuda.local.array((K, K), dt)
        gan = cuda.local.array(K, dt)
        gv = cuda.local.array(K, dt)
        gnu = cuda.local.array(K, dt)
        for a in range(K):
            for b in range(K):
                Rl[a, b] = R[i, a, b]
                gR[a, b] = 0.0
        Sr = gAr.shape[0]
        Ss = gBs.shape[0]
        for f in range(f0, f0 + nf):
            hr = 0.5 * lam_w[f]
            hs = 2.0 * hr * kappa[f]
            p = 0
            for a in range(K):
                for b in range(a, K):
                    u = gAr[0, f, i, p]
                    for s in range(1, Sr):
                        u += gAr[s, f, i, p]
                    w = gBs[0, f, i, p]
                    for s in range(1, Ss):
                        w += gBs[s, f, i, p]
                    GM[a, b] = hr * u
                    GM[b, a] = hr * u
                    # B holds P[triu] once: the off-diagonal cotangent splits over (a, b) and (b, a).
                    w = hs * w if a == b else 0.5 * hs * w
                    GP[a, b] = w
                    GP[b, a] = w
                    p += 1
            for a in range(K):
                u = gAr[0, f, i, T + a]
                w = gBs[0, f, i, T + a]
                for s in range(1, Sr):
                    u += gAr[s, f, i, T + a]
                for s in range(1, Ss):
                    w += gBs[s, f, i, T + a]
                gan[a] = hr * u
                gv[a] = hs * w
            w = gBs[0, f, i, D - 1]
            for s in range(1, Ss):
                w += gBs[s, f, i, D - 1]
            gs = hs * w
            u = gAr[0, f, i, D]
            for s in range(1, Sr):
                u += gAr[s, f, i, D]
            gc = hr * u
            # g_nu = 2 GM nu + g_anu - 2 P gv + 2 gs P nu
            for a in range(K):
                acc = gan[a] + 2.0 * gs * Pnu[f, i, a]
                for b in range(K):
                    acc += 2.0 * (GM[a, b] * nuc[f, i, b] - P[f, i, a, b] * gv[b])
                gnu[a] = acc
            # GP <- GP - gv nu^T - nu gv^T + gs nu nu^T; G_lam = GM - P GP P + (gs - gc) P  (into GM)
            for a in range(K):
                for b in range(K):
                    na = nuc[f, i, a]
                    nb = nuc[f, i, b]
                    GP[a, b] += gs * na * nb - gv[a] * nb - na * gv[b]
            for a in range(K):
                for b in range(K):
                    acc = P[f, i, a, 0] * GP[0, b]
                    for k in range(1, K):
                        acc += P[f, i, a, k] * GP[k, b]
                    T1[a, b] = acc
            gld = gs - gc
            for a in range(K):
                for b in range(K):
                    acc = T1[a, 0] * P[f, i, 0, b]
                    for k in range(1, K):
                        acc += T1[a, k] * P[f, i, k, b]
                    GM[a, b] += gld * P[f, i, a, b] - acc
            # g_mu += R g_nu; T1 = R G_lam; g_sigma += sym(T1 R^T); gR += 2 (Sigma + jitter I) T1 + mu g_nu^T
            for a in range(K):
                acc = Rl[a, 0] * gnu[0]
                for k in range(1, K):
                    acc += Rl[a, k] * gnu[k]
                g_mu[f, i, a] += acc
            matmul(Rl, GM, T1, K)
            for a in range(K):
                for b in range(K):
                    acc = T1[a, 0] * Rl[b, 0]
                    for k in range(1, K):
                        acc += T1[a, k] * Rl[b, k]
                    T2[a, b] = acc
            for a in range(K):
                for b in range(K):
                    g_sigma[f, i, a, b] += 0.5 * (T2[a, b] + T2[b, a])
            for a in range(K):
                for b in range(K):
                    acc = jitter * T1[a, b]
                    for k in range(K):
                        acc += sigma[f, i, a, k] * T1[k, b]
                    gR[a, b] += 2.0 * acc + mu[f, i, a] * gnu[b]
        # dF/dphi = Jr^T h, h_b = <R^T gR, G_b> (vfesim.groups.phi_grad_from_R)
        p0 = phi[i, 0]
        p1 = phi[i, 1]
        p2 = phi[i, 2]
        h0 = 0.0 * p0
        h1 = 0.0 * p0
        h2 = 0.0 * p0
        for k in range(K):
            for l in range(K):
                acc = Rl[0, k] * gR[0, l]
                for m in range(1, K):
                    acc += Rl[m, k] * gR[m, l]
                h0 += acc * G[0, k, l]
                h1 += acc * G[1, k, l]
                h2 += acc * G[2, k, l]
        # float64 coefficients even for float32 states: (1 - cos t)/t^2 cancels in float32.
        c1, c2 = jr_coeffs(1.0 * p0 * p0 + 1.0 * p1 * p1 + 1.0 * p2 * p2)
        g0, g1, g2 = jr_transpose_apply(p0, p1, p2, h0, h1, h2, c1, c2)
        g_phi[i, 0] += g0
        g_phi[i, 1] += g1
        g_phi[i, 2] += g2

    pyfuncs = {"prep": prep, "features": features, "self_kl": self_kl, "adjoint": adjoint}
    return {name: cuda.jit(fn) for name, fn in pyfuncs.items()} | {"_py": pyfuncs}


# ------------------------------------------------------------------------------------------------
# Large-K per-agent kernels: one thread block per agent, its K x K matrices in shared memory
# ------------------------------------------------------------------------------------------------
#
# At K = 21 one thread per agent keeps six K x K matrices in local memory and runs ~10^5 dependent
# FMAs per thread. Here a block of ~K^2 threads owns one agent: each matrix product is one phase in
# which every thread computes one element (a K-term dot product from shared memory), separated by
# barriers. Element loops stride by the block size, so any K whose matrices fit in shared memory works.
# They replace the batched CuPy code of the large-K path: measured on the H200 at N = 1024, K = 21 float64
# (benchmarks/profile_large_k.py; benchmarks/results/gpu_profile_large_k.log) that path's per-agent
# stages took 5.9 ms of a 6.7 ms evaluation (hundreds of small launches, cuSOLVER calls, host-bound);
# the four block kernels take 0.74 ms and the evaluation 0.97 ms.

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


def _bmm_nn(X, Y, Z, K, t, nt):
    """Block phase Z = X @ Y (thread t of nt computes elements t, t + nt, ...); the caller syncs."""
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        acc = X[a, 0] * Y[0, b]
        for k in range(1, K):
            acc += X[a, k] * Y[k, b]
        Z[a, b] = acc


def _bmm_tn(X, Y, Z, K, t, nt):
    """Block phase Z = X^T @ Y."""
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        acc = X[0, a] * Y[0, b]
        for k in range(1, K):
            acc += X[k, a] * Y[k, b]
        Z[a, b] = acc


def _bmm_nt(X, Y, Z, K, t, nt):
    """Block phase Z = X @ Y^T."""
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        acc = X[a, 0] * Y[b, 0]
        for k in range(1, K):
            acc += X[a, k] * Y[b, k]
        Z[a, b] = acc


def _bchol_inv(S, L, Linv, Sinv, K, t, nt):
    """Block Cholesky S = L L^T and Sinv = S^-1 (exactly symmetric: both triangles summed in one order);
    returns ln|S| in every thread. Not SPD -> NaN. Ends with a barrier.

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
    cuda.syncthreads()
    for j in range(K):
        d = math.sqrt(L[j, j])
        for a in range(j + 1 + t, K, nt):
            L[a, j] = L[a, j] / d
        cuda.syncthreads()
        if t == 0:
            L[j, j] = d  # read by nobody in the trailing phase
        M = K - 1 - j
        for e in range(t, M * M, nt):
            a = e // M
            b = e - a * M
            if b <= a:
                L[j + 1 + a, j + 1 + b] -= L[j + 1 + a, j] * L[j + 1 + b, j]
        cuda.syncthreads()
    ld = 0.0 * S[0, 0]
    for j in range(K):
        ld += 2.0 * math.log(L[j, j])
    for k in range(K):
        for j in range(t, k + 1, nt):
            Linv[k, j] = Linv[k, j] / L[k, k]
        cuda.syncthreads()
        n = k + 1
        for e in range(t, (K - 1 - k) * n, nt):
            a = k + 1 + e // n
            j = e - (a - k - 1) * n
            Linv[a, j] -= L[a, k] * Linv[k, j]
        cuda.syncthreads()
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        acc = 0.0 * ld
        for k in range(max(a, b), K):
            acc += Linv[k, a] * Linv[k, b]
        Sinv[a, b] = acc
    cuda.syncthreads()
    return ld


def _bexpm_phi(p0, p1, p2, G, lmax, K, X, X2, X3, X4, E, T, t, nt):
    """Block version of _expm_phi: E = exp(phi . G), same scaling, Taylor degree 12 and squarings.
    Ends with a barrier."""
    th = math.sqrt(p0 * p0 + p1 * p1 + p2 * p2)
    r = lmax * th / _THETA
    s = 0
    scale = 1.0
    while r > 1.0:
        r *= 0.5
        scale *= 0.5
        s += 1
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        X[a, b] = (p0 * G[0, a, b] + p1 * G[1, a, b] + p2 * G[2, a, b]) * scale
    cuda.syncthreads()
    _bmm_nn(X, X, X2, K, t, nt)
    cuda.syncthreads()
    _bmm_nn(X2, X, X3, K, t, nt)
    _bmm_nn(X2, X2, X4, K, t, nt)
    cuda.syncthreads()
    c = _INV_FACT
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        eye = 1.0 if a == b else 0.0
        E[a, b] = c[8] * eye + c[9] * X[a, b] + c[10] * X2[a, b] + c[11] * X3[a, b] + c[12] * X4[a, b]
    cuda.syncthreads()
    _bmm_nn(X4, E, T, K, t, nt)
    cuda.syncthreads()
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        eye = 1.0 if a == b else 0.0
        E[a, b] = c[4] * eye + c[5] * X[a, b] + c[6] * X2[a, b] + c[7] * X3[a, b] + T[a, b]
    cuda.syncthreads()
    _bmm_nn(X4, E, T, K, t, nt)
    cuda.syncthreads()
    for e in range(t, K * K, nt):
        a = e // K
        b = e - a * K
        eye = 1.0 if a == b else 0.0
        E[a, b] = eye + X[a, b] + c[2] * X2[a, b] + c[3] * X3[a, b] + T[a, b]
    cuda.syncthreads()
    for _ in range(s):
        _bmm_nn(E, E, T, K, t, nt)
        cuda.syncthreads()
        for e in range(t, K * K, nt):
            a = e // K
            b = e - a * K
            E[a, b] = T[a, b]
        cuda.syncthreads()


_bmm_nn = _device(_bmm_nn)
_bmm_tn = _device(_bmm_tn)
_bmm_nt = _device(_bmm_nt)
_bchol_inv = _device(_bchol_inv)
_bexpm_phi = _device(_bexpm_phi)


@functools.cache
def make_block_kernels(K: int, dtype: str, max_registers: int | None = None):
    """Block-per-agent kernels ``prep``, ``self_kl``, ``features``, ``adjoint`` for (K, dtype): the
    per-agent work of :func:`make_agent_kernels` (same arguments; ``prep`` also takes nf and covers every
    term in one block, so the frame is computed once). Launch with ``[N, block_threads(K)]``
    (``features`` with grid ``(N, nf)``).
    """
    dt = _NB[np.dtype(dtype)]
    D = feature_dim(K)
    T = K * (K + 1) // 2
    KK = K * K
    bmm_nn, bmm_tn, bmm_nt = _bmm_nn, _bmm_tn, _bmm_nt
    bchol_inv = _bchol_inv
    bexpm_phi = _bexpm_phi

    def prep(phi, G, lmax, mu, sigma, jitter, f0, nf, R, lam, P, nu, ld):
        """Agent blockIdx.x: R = exp(phi . G); for terms f0 .. f0 + nf - 1: lam = R^T (Sigma + jitter I) R
        (symmetrised), P = lam^-1, ld = ln|lam|, nu = R^T mu (uncentred)."""
        i = cuda.blockIdx.x
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        X = cuda.shared.array((K, K), dt)
        X2 = cuda.shared.array((K, K), dt)
        X3 = cuda.shared.array((K, K), dt)
        X4 = cuda.shared.array((K, K), dt)
        E = cuda.shared.array((K, K), dt)
        Tm = cuda.shared.array((K, K), dt)
        bexpm_phi(phi[i, 0], phi[i, 1], phi[i, 2], G, lmax, K, X, X2, X3, X4, E, Tm, t, nt)
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            R[i, a, b] = E[a, b]
        for f in range(f0, f0 + nf):
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                X[a, b] = sigma[f, i, a, b]
            cuda.syncthreads()
            # Tm = (Sigma + jitter I) R, X2 = R^T Tm, X = sym(X2)
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                acc = jitter * E[a, b]
                for k in range(K):
                    acc += X[a, k] * E[k, b]
                Tm[a, b] = acc
            cuda.syncthreads()
            bmm_tn(E, Tm, X2, K, t, nt)
            cuda.syncthreads()
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
            cuda.syncthreads()
            d = bchol_inv(X, X2, X3, X4, K, t, nt)
            if t == 0:
                ld[f, i] = d
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                P[f, i, a, b] = X4[a, b]
            cuda.syncthreads()

    def self_kl(mu, sigma, jitter, lam_self, e_out, g_mu, g_sigma):
        """Agent blockIdx.x: lam_self * KL(q_i || p_i) into e_out (N,); gradient added to g_mu, g_sigma."""
        i = cuda.blockIdx.x
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Sq = cuda.shared.array((K, K), dt)
        Sp = cuda.shared.array((K, K), dt)
        L = cuda.shared.array((K, K), dt)
        Li = cuda.shared.array((K, K), dt)
        Sqi = cuda.shared.array((K, K), dt)
        Spi = cuda.shared.array((K, K), dt)
        W = cuda.shared.array((K, K), dt)
        d = cuda.shared.array(K, dt)
        Spd = cuda.shared.array(K, dt)
        rs = cuda.shared.array(K, dt)
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            eye = jitter if a == b else 0.0 * jitter
            Sq[a, b] = sigma[0, i, a, b] + eye
            Sp[a, b] = sigma[1, i, a, b] + eye
        for a in range(t, K, nt):
            d[a] = mu[1, i, a] - mu[0, i, a]
        cuda.syncthreads()
        ld_q = bchol_inv(Sq, L, Li, Sqi, K, t, nt)
        ld_p = bchol_inv(Sp, L, Li, Spi, K, t, nt)
        for a in range(t, K, nt):
            acc = Spi[a, 0] * d[0]
            for b in range(1, K):
                acc += Spi[a, b] * d[b]
            Spd[a] = acc
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            W[a, b] = Spi[a, b] * Sq[b, a]
        bmm_nn(Spi, Sq, L, K, t, nt)
        cuda.syncthreads()
        # Trace and quadratic form by row sums, then one thread in row order (deterministic).
        for a in range(t, K, nt):
            acc = W[a, 0]
            for b in range(1, K):
                acc += W[a, b]
            rs[a] = acc
        bmm_nn(L, Spi, Li, K, t, nt)
        cuda.syncthreads()
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
        """Agent blockIdx.x, term f0 + blockIdx.y: the features of make_agent_kernels (same arguments and
        sums), rows written by the whole block (coalesced)."""
        i = cuda.blockIdx.x
        f = f0 + cuda.blockIdx.y
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        v = cuda.shared.array(K, dt)
        pv = cuda.shared.array(K, dt)
        ik = scale[f]
        for a in range(t, K, nt):
            v[a] = nu[f, i, a] - nubar[f, a]
            nuc[f, i, a] = v[a]
        cuda.syncthreads()
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
        cuda.syncthreads()
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
        """Agent blockIdx.x: the adjoint of make_agent_kernels (same arguments and sums)."""
        i = cuda.blockIdx.x
        t = cuda.threadIdx.x
        nt = cuda.blockDim.x
        Rl = cuda.shared.array((K, K), dt)
        gR = cuda.shared.array((K, K), dt)
        GM = cuda.shared.array((K, K), dt)
        GP = cuda.shared.array((K, K), dt)
        Pl = cuda.shared.array((K, K), dt)
        Sg = cuda.shared.array((K, K), dt)
        T1 = cuda.shared.array((K, K), dt)
        T2 = cuda.shared.array((K, K), dt)
        nv = cuda.shared.array(K, dt)
        gan = cuda.shared.array(K, dt)
        gv = cuda.shared.array(K, dt)
        gnu = cuda.shared.array(K, dt)
        hrow = cuda.shared.array((3, K), dt)
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
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                lo = min(a, b)
                hi = max(a, b)
                p = lo * K - (lo * (lo - 1)) // 2 + hi - lo  # packed upper-triangle index of (lo, hi)
                u = gAr[0, f, i, p]
                for s in range(1, Sr):
                    u += gAr[s, f, i, p]
                w = gBs[0, f, i, p]
                for s in range(1, Ss):
                    w += gBs[s, f, i, p]
                GM[a, b] = hr * u
                # B holds P[triu] once: the off-diagonal cotangent splits over (a, b) and (b, a).
                GP[a, b] = hs * w if a == b else 0.5 * hs * w
                Pl[a, b] = P[f, i, a, b]
                Sg[a, b] = sigma[f, i, a, b]
            for a in range(t, K, nt):
                u = gAr[0, f, i, T + a]
                w = gBs[0, f, i, T + a]
                for s in range(1, Sr):
                    u += gAr[s, f, i, T + a]
                for s in range(1, Ss):
                    w += gBs[s, f, i, T + a]
                gan[a] = hr * u
                gv[a] = hs * w
                nv[a] = nuc[f, i, a]
            w = gBs[0, f, i, D - 1]
            for s in range(1, Ss):
                w += gBs[s, f, i, D - 1]
            gs = hs * w
            u = gAr[0, f, i, D]
            for s in range(1, Sr):
                u += gAr[s, f, i, D]
            gc = hr * u
            cuda.syncthreads()
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
            cuda.syncthreads()
            bmm_nn(Pl, GP, T1, K, t, nt)
            cuda.syncthreads()
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
            cuda.syncthreads()
            bmm_nn(Rl, GM, T1, K, t, nt)
            cuda.syncthreads()
            bmm_nt(T1, Rl, T2, K, t, nt)
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                acc = jitter * T1[a, b]
                for k in range(K):
                    acc += Sg[a, k] * T1[k, b]
                gR[a, b] += 2.0 * acc + mu[f, i, a] * gnu[b]
            cuda.syncthreads()
            for e in range(t, KK, nt):
                a = e // K
                b = e - a * K
                g_sigma[f, i, a, b] += 0.5 * (T2[a, b] + T2[b, a])
            cuda.syncthreads()
        # dF/dphi = Jr^T h, h_b = <R^T gR, G_b>: elementwise products, row sums, then one thread in order.
        bmm_tn(Rl, gR, T1, K, t, nt)
        cuda.syncthreads()
        for e in range(t, KK, nt):
            a = e // K
            b = e - a * K
            GM[a, b] = T1[a, b] * G[0, a, b]
            GP[a, b] = T1[a, b] * G[1, a, b]
            T2[a, b] = T1[a, b] * G[2, a, b]
        cuda.syncthreads()
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
        cuda.syncthreads()
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
    opts = {} if max_registers is None or SIMULATOR else {"max_registers": max_registers}
    return {name: cuda.jit(fn, **opts) for name, fn in pyfuncs.items()} | {"_py": pyfuncs}


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

    return {"rows": cuda.jit(rows), "_py": {"rows": rows}}


# ------------------------------------------------------------------------------------------------
# Pairwise kernels
# ------------------------------------------------------------------------------------------------


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
def make_dense_kernels(K: int, dtype: str, aggregator: str, threads: int = PAIR_THREADS, opt: int = PAIR_OPT):
    """Dense streaming kernels ``stats``, ``merge``, ``grads`` for one (K, dtype, aggregator).

    Launch (N agents, S slices of ``chunk`` others, nf terms, nb = ceil(N / (threads * opt))):
      stats[(nb, S, nf), threads](A, B, c, f0, chunk, pm, ps, pt)          pm, ps, pt (S, 2, N)
      merge[(ceil(N / BLOCK), nf), BLOCK](pm, ps, pt, kappa, f0, m, inv_s, abar, energy)   (2, N) each
      grads[(nb, 2 S, nf), threads](A, B, c, m, inv_s, abar, f0, chunk, gAr, gBs)
    With KL' = KL / kappa = A'_i . B_j + c'_i (A' = A / (2 kappa), c' likewise) and kappa' = 1:
    W'_ij = W_ij, energy = kappa E', sum_i W_ij A'_i = (sum_i W_ij A_i) / (2 kappa).
    """
    dt = _NB[np.dtype(dtype)]
    one = np.dtype(dtype).type(1.0)
    ninf = np.dtype(dtype).type(-np.inf)
    agg = AGG_CODES[aggregator]
    D = feature_dim(K)
    TS = _tile_rows(D, np.dtype(dtype).itemsize, threads)
    OPT = opt
    NT = threads

    def stats(A, B, c, f0, chunk, pm, ps, pt):
        """Partial row statistics (max, sum, weighted sum) of receivers over one slice of senders."""
        tid = cuda.threadIdx.x
        f = f0 + cuda.blockIdx.z
        sl = cuda.blockIdx.y
        N = A.shape[1]
        i0 = cuda.blockIdx.x * (NT * OPT) + tid
        j_begin = sl * chunk
        j_end = min(N, j_begin + chunk)
        own = cuda.local.array((OPT, D), dt)
        oc = cuda.local.array(OPT, dt)
        m = cuda.local.array(OPT, dt)
        s = cuda.local.array(OPT, dt)
        t = cuda.local.array(OPT, dt)
        for o in range(OPT):
            ii = min(i0 + o * NT, N - 1)
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
            for jj in range(min(TS, j_end - j0)):
                j = j0 + jj
                for o in range(OPT):
                    if j != i0 + o * NT:
                        kl = pair_kl(own, o, sX, jj, oc)
                        mm, ss, tt = lse_push(m[o], s[o], t[o], pair_logit(kl, one), kl)
                        m[o] = mm
                        s[o] = ss
                        t[o] = tt
        for o in range(OPT):
            i = i0 + o * NT
            if i < N:
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

    def grads(A, B, c, m, inv_s, abar, f0, chunk, gAr, gBs):
        """Blocks y < S: receiver sums over a slice of senders; y >= S: sender sums over receivers."""
        tid = cuda.threadIdx.x
        f = f0 + cuda.blockIdx.z
        S = gAr.shape[0]
        N = A.shape[1]
        sender = cuda.blockIdx.y >= S
        sl = cuda.blockIdx.y - S if sender else cuda.blockIdx.y
        i0 = cuda.blockIdx.x * (NT * OPT) + tid
        k_begin = sl * chunk
        k_end = min(N, k_begin + chunk)
        own = cuda.local.array((OPT, D), dt)
        oc = cuda.local.array(OPT, dt)
        om = cuda.local.array(OPT, dt)
        oi = cuda.local.array(OPT, dt)
        oa = cuda.local.array(OPT, dt)
        acc = cuda.local.array((OPT, D), dt)
        accw = cuda.local.array(OPT, dt)
        for o in range(OPT):
            ii = min(i0 + o * NT, N - 1)
            for d in range(D):
                own[o, d] = B[f, ii, d] if sender else A[f, ii, d]
                acc[o, d] = 0.0
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
            if sender:
                for kk in range(nk):
                    k = k0 + kk
                    for o in range(OPT):
                        if k != i0 + o * NT and i0 + o * NT < N:
                            kl = pair_kl(sX, kk, own, o, sc)
                            w = pair_weight(kl, sm[kk], si[kk], sa[kk], one, agg)
                            accumulate_row(acc, o, w, sX, kk)
            else:
                for kk in range(nk):
                    k = k0 + kk
                    for o in range(OPT):
                        if k != i0 + o * NT and i0 + o * NT < N:
                            kl = pair_kl(own, o, sX, kk, oc)
                            w = pair_weight(kl, om[o], oi[o], oa[o], one, agg)
                            accumulate_row(acc, o, w, sX, kk)
                            accw[o] += w
        for o in range(OPT):
            i = i0 + o * NT
            if i < N:
                if sender:
                    for d in range(D):
                        gBs[sl, f, i, d] = acc[o, d]
                else:
                    for d in range(D):
                        gAr[sl, f, i, d] = acc[o, d]
                    gAr[sl, f, i, D] = accw[o]

    pyfuncs = {"stats": stats, "merge": merge, "grads": grads}
    out = {name: cuda.jit(fn) for name, fn in pyfuncs.items()}
    return out | {"_py": pyfuncs, "tile": TS, "threads": NT, "opt": OPT}


@functools.cache
def make_sparse_kernels(K: int, dtype: str, aggregator: str):
    """Sparse neighbour-list kernels for one (K, dtype, aggregator); one thread per agent, grid y = term.

    rows[(ceil(N / BLOCK), nf), BLOCK](A, B, c, index, mask, kappa, f0, W, energy, gAr)
        receiver i: statistics over its listed senders, W (2, N, k), energy (2, N),
        gAr (1, 2, N, D+1) = [sum_j W_ij B_j, sum_j W_ij]
    senders[(ceil(N / BLOCK), nf), BLOCK](A, W, ptr, src_row, src_slot, f0, gBs)
        sender j: sum over its incoming edges e in ptr[j] .. ptr[j+1] (ordered by receiver, then
        slot) of W[src_row[e], src_slot[e]] A_{src_row[e]} into gBs (1, 2, N, D)
    """
    dt = _NB[np.dtype(dtype)]
    one = np.dtype(dtype).type(1.0)
    ninf = np.dtype(dtype).type(-np.inf)
    agg = AGG_CODES[aggregator]
    D = feature_dim(K)

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
        if j >= A.shape[1]:
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
    return {name: cuda.jit(fn) for name, fn in pyfuncs.items()} | {"_py": pyfuncs}


def kernel_signatures(K: int, dtype: str) -> dict[str, str]:
    """Numba signature strings of every kernel for (K, dtype), for ``cuda.compile_ptx`` (tests)."""
    f = "float32" if np.dtype(dtype) == np.float32 else "float64"
    a1, a2, a3, a4 = (f"{f}[{', '.join([':'] * (n - 1) + ['::1'])}]" for n in (1, 2, 3, 4))
    i = "int64"
    return {
        "prep": f"void({a2}, {a3}, {i}, {a3}, {a4}, {f}, {i}, {a3}, {a4}, {a4}, {a3}, {a2})",
        "features": f"void({a4}, {a4}, {a3}, {a2}, {a2}, {a1}, {i}, {a3}, {a3}, {a2}, {a3}, {a3})",
        "self_kl": f"void({a3}, {a4}, {f}, {f}, {a1}, {a3}, {a4})",
        "adjoint": (
            f"void({a2}, {a3}, {a3}, {a3}, {a4}, {f}, {a3}, {a4}, {a3}, {a4}, {a4}, {a1}, {a1}, {i}, {i}, "
            f"{a3}, {a4}, {a2})"
        ),
        "stats": f"void({a3}, {a3}, {a2}, {i}, {i}, {a3}, {a3}, {a3})",
        "merge": f"void({a3}, {a3}, {a3}, {a1}, {i}, {a2}, {a2}, {a2}, {a2})",
        "grads": f"void({a3}, {a3}, {a2}, {a2}, {a2}, {a2}, {i}, {i}, {a4}, {a4})",
        "rows": f"void({a3}, {a3}, {a2}, {i}[:, ::1], boolean[:, ::1], {a1}, {i}, {a3}, {a2}, {a4})",
        "senders": f"void({a3}, {a3}, {i}[::1], {i}[::1], {i}[::1], {i}, {a4})",
    }


def block_kernel_signatures(K: int, dtype: str) -> dict[str, str]:
    """Signature strings of the block-per-agent kernels of :func:`make_block_kernels` and of the GEMM-path
    row kernel (``rows``, :func:`make_gemm_row_kernel`)."""
    sigs = kernel_signatures(K, dtype)
    f = "float32" if np.dtype(dtype) == np.float32 else "float64"
    a2, a3, a4 = (f"{f}[{', '.join([':'] * (n - 1) + ['::1'])}]" for n in (2, 3, 4))
    i = "int64"
    prep = f"void({a2}, {a3}, {i}, {a3}, {a4}, {f}, {i}, {i}, {a3}, {a4}, {a4}, {a3}, {a2})"
    rows = f"void({f}[:, ::1], {f}[:], {i}, {f}[::1], {f}[::1])"
    return {
        "rows": rows,
        "prep": prep,
        "self_kl": sigs["self_kl"],
        "features": sigs["features"],
        "adjoint": sigs["adjoint"],
    }
