"""Numba CPU kernels of the per-agent stages of the alignment terms (SPEC §2.1, §2.3).

The same maths as the NumPy code, fused per agent (one pass over an agent's K x K matrices in per-thread
scratch instead of a dozen batched NumPy calls with (N, K, K) temporaries):

- :func:`frames`: ``R_i = exp(phi_i . G)`` by the algorithm of ``vfesim.groups.expm_so3`` (degree-12
  Taylor in Paterson-Stockmeyer form, scaling and squaring with ``l_max |phi| / 2^s <= 0.25``);
- :func:`features`: ``vfesim.gaussian.features.agent_features`` (``Lam = R^T Sigma R``, its Cholesky
  factor, inverse from that factor, log-det, means centred on the population mean of ``nu``);
- :func:`features_vjp`: its adjoint (``features_vjp`` there);
- :func:`phi_grad`: ``vfesim.groups.phi_grad_from_R`` (``dF/dphi = Jr^T h``, ``h_b = <R^T gR, G_b>``).

Shapes: phi (N, 3), G (3, K, K), mu (N, K), sigma and R (N, K, K); float32 or float64 throughout (G
is cast to the dtype, as the NumPy code does). Agents are independent (parallel over fixed blocks of
agents); the one cross-agent reduction, the mean of ``nu``, runs serially in ascending agent order with
a float64 accumulator, so every result is bitwise independent of the thread count. Small-matrix loops
run ``C[i, :] += a * B[k, :]`` over contiguous rows so that LLVM vectorises them.
"""

from __future__ import annotations

import math
import types

import numba
import numpy as np

from . import agent_math as _am

__all__ = [
    "frames",
    "features",
    "features_vjp",
    "phi_grad",
    "self_kl",
    "AgentCache",
    "TAYLOR_DEGREE",
    "THETA",
]

# The exp map's constants: those of vfesim.groups (kernels import nothing from vfesim).
TAYLOR_DEGREE = 12
THETA = 0.25
# Agents per parallel work item (results do not depend on it).
AGENT_BLOCK = 8
# Sum over agents of K^3 below which the serial builds run: waking the thread pool costs more. At 2^16 the
# per-agent stages of N = 4096, K = 3 (1.1e5) run in parallel, right after the pair kernels' parallel
# region: on the 2-core machine, one call took 42-44 ms in float64 and 26-28 ms in float32 against 53-63 and
# 30-33 serial (2^20, stop 39's threshold); N = 1024 (2.8e4) stays serial.
SERIAL_WORK = 1 << 16

_inline = numba.njit(inline="always", nogil=True, cache=True)
_parallel = numba.njit(parallel=True, nogil=True, cache=True)
_jr_coeffs = _inline(_am.jr_coeffs)
_jr_transpose_apply = _inline(_am.jr_transpose_apply)


# ---- small dense helpers on (K, K) scratch ------------------------------------------------------------
@_inline
def _mm_loops(A, B, C):
    """C = A @ B in loops (row-axpy form: the inner loop runs over contiguous C[i, :], B[k, :])."""
    K = A.shape[0]
    M = B.shape[1]
    for i in range(K):
        a = A[i, 0]
        for j in range(M):
            C[i, j] = a * B[0, j]
        for k in range(1, A.shape[1]):
            a = A[i, k]
            for j in range(M):
                C[i, j] += a * B[k, j]


# From this K on, small products go to BLAS (np.dot inside njit calls the gemm of SciPy's BLAS): at
# K = 21 one product takes 0.48 us there against 1.8-3.2 us in the loops above, which LLVM does not
# vectorise at these trip counts (measured on the 2-core benchmark machine). At K = 3 the loops win
# (0.01 vs 0.04 us per product). gemm is single-threaded at these sizes and rounds the same way for a
# given shape, so results do not depend on Numba's thread count.
BLAS_MIN_K = 6


@_inline
def _mm(A, B, C):
    """C = A @ B."""
    if A.shape[0] >= BLAS_MIN_K:
        np.dot(A, B, C)
    else:
        _mm_loops(A, B, C)


@_inline
def _mtm(A, B, C):
    """C = A^T @ B."""
    if A.shape[0] >= BLAS_MIN_K:
        np.dot(A.T, B, C)
        return
    K = A.shape[1]
    M = B.shape[1]
    for i in range(K):
        a = A[0, i]
        for j in range(M):
            C[i, j] = a * B[0, j]
        for k in range(1, A.shape[0]):
            a = A[k, i]
            for j in range(M):
                C[i, j] += a * B[k, j]


@_inline
def _transpose(A, C):
    K = A.shape[0]
    for i in range(K):
        for j in range(K):
            C[j, i] = A[i, j]


@_inline
def _symmetrise(A):
    """A <- (A + A^T) / 2 (the same expression as the NumPy code, so the same rounding)."""
    K = A.shape[0]
    for i in range(K):
        for j in range(i, K):
            v = (A[i, j] + A[j, i]) * 0.5  # exact halving: same value in either precision
            A[i, j] = v
            A[j, i] = v


@_inline
def _spd_inverse(S, one, L, Li, Pout):
    """Pout = S^-1 = L^-T L^-1 from the Cholesky factor L of S; returns (S is positive definite, ln|S|).

    L, Li are (K, K) scratch. Where a pivot is not positive it continues with 1 (no NaN) and reports.
    """
    K = S.shape[0]
    zero = one - one
    good = True
    for i in range(K):  # Cholesky (lower), row by row
        for j in range(i + 1):
            acc = S[i, j]
            for k in range(j):
                acc -= L[i, k] * L[j, k]
            if i == j:
                if not acc > zero:
                    good = False
                    acc = one
                L[i, i] = np.sqrt(acc)
            else:
                L[i, j] = acc / L[j, j]
        for j in range(i + 1, K):
            L[i, j] = zero
    ld = zero
    for i in range(K):
        ld += np.log(L[i, i])
    ld = ld + ld
    # L^-1 by forward substitution over contiguous rows: Li[i] = (e_i - sum_k<i L[i,k] Li[k]) / L[i,i].
    for i in range(K):
        for j in range(K):
            Li[i, j] = one if i == j else zero
        for k in range(i):
            a = L[i, k]
            for j in range(k + 1):
                Li[i, j] -= a * Li[k, j]
        d = one / L[i, i]
        for j in range(i + 1):
            Li[i, j] *= d
    _mtm(Li, Li, Pout)
    _symmetrise(Pout)  # gemm need not sum P[i, j] and P[j, i] in the same order
    return good, ld


# ---- frames: R = exp(phi . G) --------------------------------------------------------------------------
@_inline
def _ps_block(coef, j0, X, X2, X3, out):
    """out = c[j0] I + c[j0+1] X + c[j0+2] X^2 + c[j0+3] X^3, summed left to right like expm_so3."""
    K = X.shape[0]
    c0, c1, c2, c3 = coef[j0], coef[j0 + 1], coef[j0 + 2], coef[j0 + 3]
    zero = c0 - c0
    for i in range(K):
        for j in range(K):
            e = c0 if i == j else zero
            out[i, j] = ((e + c1 * X[i, j]) + c2 * X2[i, j]) + c3 * X3[i, j]


def _frames_kernel(phi, G, lmax, coef, R):
    """R (N, K, K) = exp(phi . G) for phi (N, 3), G (3, K, K) and Taylor coefficients coef (13,)."""
    N = phi.shape[0]
    K = G.shape[1]
    dt = R.dtype
    nblk = (N + AGENT_BLOCK - 1) // AGENT_BLOCK
    for b in numba.prange(nblk):
        X = np.empty((K, K), dt)
        X2 = np.empty((K, K), dt)
        X3 = np.empty((K, K), dt)
        X4 = np.empty((K, K), dt)
        E = np.empty((K, K), dt)
        T = np.empty((K, K), dt)
        for n in range(b * AGENT_BLOCK, min(N, (b + 1) * AGENT_BLOCK)):
            p0, p1, p2 = phi[n, 0], phi[n, 1], phi[n, 2]
            t = np.sqrt(p0 * p0 + p1 * p1 + p2 * p2)
            # Squarings s with l_max |phi| / 2^s <= THETA, from |phi| in float64 (groups.n_squarings).
            r = max(lmax * np.float64(t) / THETA, 1.0)
            s = int(math.ceil(math.log2(r)))
            scale = math.ldexp(1.0, -s)  # a power of two: X * scale rounds nothing, in either dtype
            for k in range(K):
                for j in range(K):
                    X[k, j] = (p0 * G[0, k, j] + p1 * G[1, k, j] + p2 * G[2, k, j]) * scale
            _mm(X, X, X2)
            _mm(X2, X, X3)
            _mm(X2, X2, X4)
            # Paterson-Stockmeyer in blocks of X^4: E = B0 + X4 (B1 + X4 (B2 + c12 X4)).
            _ps_block(coef, 8, X, X2, X3, E)
            c12 = coef[12]
            for k in range(K):
                for j in range(K):
                    E[k, j] = E[k, j] + c12 * X4[k, j]
            for j0 in (4, 0):
                _mm(X4, E, T)
                _ps_block(coef, j0, X, X2, X3, E)
                for k in range(K):
                    for j in range(K):
                        E[k, j] = E[k, j] + T[k, j]
            for _ in range(s):
                _mm(E, E, T)
                E, T = T, E
            R[n, :, :] = E


# ---- features --------------------------------------------------------------------------------------------
def _rotated_means_kernel(mu, R, nu):
    """nu[n] = R[n]^T mu[n]  (N, K)."""
    N, K = mu.shape
    for n in numba.prange(N):
        for j in range(K):
            nu[n, j] = R[n, 0, j] * mu[n, 0]
        for k in range(1, K):
            a = mu[n, k]
            for j in range(K):
                nu[n, j] += R[n, k, j] * a


@numba.njit(nogil=True, cache=True)
def _centre(nu):
    """nu -= mean over agents; float64 sums in ascending agent order (a fixed order)."""
    N, K = nu.shape
    acc = np.zeros(K, np.float64)
    for n in range(N):
        for j in range(K):
            acc[j] += nu[n, j]
    mean = np.empty(K, nu.dtype)
    for j in range(K):
        mean[j] = acc[j] / N
    for n in range(N):
        for j in range(K):
            nu[n, j] -= mean[j]


def _features_kernel(sigma, R, nu, one, A, B, c, P, Pnu, ok):
    """Per agent, with nu (N, K) the centred R^T mu: Lam = sym(R^T Sigma R), L = chol(Lam), P = Lam^-1
    = L^-T L^-1, ld = ln|Lam| -> A, B (N, D), c (N,), P (N, K, K), Pnu (N, K); ok[n] = 0 when Lam_n is not
    positive definite (its rows are then garbage; the caller raises)."""
    N, K = nu.shape
    dt = A.dtype
    T = K * (K + 1) // 2
    nblk = (N + AGENT_BLOCK - 1) // AGENT_BLOCK
    for b in numba.prange(nblk):
        S1 = np.empty((K, K), dt)
        lam = np.empty((K, K), dt)
        L = np.empty((K, K), dt)
        Li = np.empty((K, K), dt)
        for n in range(b * AGENT_BLOCK, min(N, (b + 1) * AGENT_BLOCK)):
            Rn = R[n]
            _mm(sigma[n], Rn, S1)
            _mtm(Rn, S1, lam)
            _symmetrise(lam)
            zero = one - one
            two = one + one
            good, ld = _spd_inverse(lam, one, L, Li, P[n])
            ok[n] = good
            Pn = P[n]
            nun = nu[n]
            s = zero
            for i in range(K):
                acc = Pn[i, 0] * nun[0]
                for j in range(1, K):
                    acc += Pn[i, j] * nun[j]
                Pnu[n, i] = acc
                s += nun[i] * acc
            t = 0
            for i in range(K):
                A[n, t] = lam[i, i] + nun[i] * nun[i]
                B[n, t] = Pn[i, i]
                t += 1
                for j in range(i + 1, K):
                    A[n, t] = two * (lam[i, j] + nun[i] * nun[j])
                    B[n, t] = Pn[i, j]
                    t += 1
            for i in range(K):
                A[n, T + i] = nun[i]
                B[n, T + i] = -two * Pnu[n, i]
            A[n, T + K] = one
            B[n, T + K] = s + ld
            c[n] = -ld - K


# ---- the adjoint of the features ------------------------------------------------------------------------
def _features_vjp_kernel(gA, gB, gc, mu, sigma, R, nu, P, Pnu, one, g_mu, g_sigma, g_R):
    """Cotangents of (A, B, c) -> g_mu (N, K), symmetric g_sigma (N, K, K), g_R (N, K, K)."""
    N, K = nu.shape
    dt = gA.dtype
    T = K * (K + 1) // 2
    two = one + one
    half = one / two
    nblk = (N + AGENT_BLOCK - 1) // AGENT_BLOCK
    for b in numba.prange(nblk):
        GM = np.empty((K, K), dt)
        GP = np.empty((K, K), dt)
        Gl = np.empty((K, K), dt)
        S1 = np.empty((K, K), dt)
        S2 = np.empty((K, K), dt)
        gnu = np.empty(K, dt)
        for n in range(b * AGENT_BLOCK, min(N, (b + 1) * AGENT_BLOCK)):
            Pn, nun, Rn = P[n], nu[n], R[n]
            t = 0
            for i in range(K):  # unpack the triangles: GM (off-diagonals x 1), GP (x 1/2)
                GM[i, i] = gA[n, t]
                GP[i, i] = gB[n, t]
                t += 1
                for j in range(i + 1, K):
                    GM[i, j] = gA[n, t]
                    GM[j, i] = gA[n, t]
                    v = half * gB[n, t]
                    GP[i, j] = v
                    GP[j, i] = v
                    t += 1
            gs = gB[n, T + K]
            for i in range(K):
                gm = GM[i, 0] * nun[0]
                pg = Pn[i, 0] * gB[n, T]
                for j in range(1, K):
                    gm += GM[i, j] * nun[j]
                    pg += Pn[i, j] * gB[n, T + j]
                gnu[i] = two * gm + gA[n, T + i] - two * pg + two * gs * Pnu[n, i]
            for i in range(K):
                gvi, nui = gB[n, T + i], nun[i]
                for j in range(K):
                    GP[i, j] = GP[i, j] - gvi * nun[j] - nui * gB[n, T + j] + gs * (nui * nun[j])
            g_ld = gs - gc[n]
            _mm(Pn, GP, S1)
            _mm(S1, Pn, S2)
            for i in range(K):
                for j in range(K):
                    Gl[i, j] = GM[i, j] - S2[i, j] + g_ld * Pn[i, j]
            for i in range(K):
                acc = Rn[i, 0] * gnu[0]
                for j in range(1, K):
                    acc += Rn[i, j] * gnu[j]
                g_mu[n, i] = acc
            # g_sigma = sym(R Gl R^T)
            _mm(Rn, Gl, S1)
            gS = g_sigma[n]
            if K >= BLAS_MIN_K:
                np.dot(S1, Rn.T, gS)
            else:
                _transpose(Rn, S2)
                _mm_loops(S1, S2, gS)
            _symmetrise(gS)
            # g_R = 2 Sigma R Gl + mu gnu^T
            _mm(sigma[n], Rn, S1)
            gRn = g_R[n]
            _mm(S1, Gl, gRn)
            for i in range(K):
                a = mu[n, i]
                for j in range(K):
                    gRn[i, j] = two * gRn[i, j] + a * gnu[j]


# ---- dF/dphi from dF/dR ------------------------------------------------------------------------------------
def _phi_grad_kernel(g_R, R, phi, G, one, out):
    """out (N, 3) = Jr(phi)^T h, h_b = <R^T gR, G_b>; Jr's coefficients in float64 (agent_math.jr_coeffs)."""
    N = phi.shape[0]
    K = G.shape[1]
    dt = out.dtype
    nblk = (N + AGENT_BLOCK - 1) // AGENT_BLOCK
    for b in numba.prange(nblk):
        S = np.empty((K, K), dt)
        h = np.empty(3, dt)
        cc = np.empty(2, dt)  # Jr's coefficients rounded to the dtype
        for n in range(b * AGENT_BLOCK, min(N, (b + 1) * AGENT_BLOCK)):
            _mtm(R[n], g_R[n], S)
            for a in range(3):
                acc = S[0, 0] * G[a, 0, 0]
                for k in range(K):
                    for j in range(K):
                        if k + j > 0:
                            acc += S[k, j] * G[a, k, j]
                h[a] = acc
            p0, p1, p2 = phi[n, 0], phi[n, 1], phi[n, 2]
            cc[0], cc[1] = _jr_coeffs(p0 * p0 + p1 * p1 + p2 * p2)
            out[n, 0], out[n, 1], out[n, 2] = _jr_transpose_apply(p0, p1, p2, h[0], h[1], h[2], cc[0], cc[1])


# ---- the self term KL(q_i || p_i) and its adjoint ---------------------------------------------------------
def _self_kl_kernel(mu_q, sigma_q, mu_p, sigma_p, g, one, kl, g_mu_q, g_sigma_q, g_mu_p, g_sigma_p, ok):
    """kl (N,) = KL(N(mu_q, sigma_q) || N(mu_p, sigma_p)) and its gradients times g (N,) (vfesim terms.self_kl
    and self_kl_vjp): g_mu_q = -g Sp^-1 d, g_mu_p = -g_mu_q, g_sigma_q = g/2 (Sp^-1 - Sq^-1),
    g_sigma_p = g/2 (Sp^-1 - sym(Sp^-1 Sq Sp^-1 + Sp^-1 d d^T Sp^-1)), d = mu_p - mu_q."""
    N, K = mu_q.shape
    dt = mu_q.dtype
    nblk = (N + AGENT_BLOCK - 1) // AGENT_BLOCK
    for b in numba.prange(nblk):
        L = np.empty((K, K), dt)
        Li = np.empty((K, K), dt)
        Spi = np.empty((K, K), dt)
        Sqi = np.empty((K, K), dt)
        S1 = np.empty((K, K), dt)
        S2 = np.empty((K, K), dt)
        d = np.empty(K, dt)
        Spd = np.empty(K, dt)
        for n in range(b * AGENT_BLOCK, min(N, (b + 1) * AGENT_BLOCK)):
            zero = one - one
            half = one / (one + one)
            okp, ld_p = _spd_inverse(sigma_p[n], one, L, Li, Spi)
            okq, ld_q = _spd_inverse(sigma_q[n], one, L, Li, Sqi)
            ok[n] = okp and okq
            for i in range(K):
                d[i] = mu_p[n, i] - mu_q[n, i]
            tr = zero
            dSd = zero
            for i in range(K):
                acc = Spi[i, 0] * d[0]
                for j in range(1, K):
                    acc += Spi[i, j] * d[j]
                Spd[i] = acc
                dSd += d[i] * acc
                for j in range(K):
                    tr += Spi[i, j] * sigma_q[n, j, i]
            kl[n] = half * (tr + dSd - K + ld_p - ld_q)
            gn = g[n]
            gh = half * gn
            for i in range(K):
                g_mu_q[n, i] = -gn * Spd[i]
                g_mu_p[n, i] = gn * Spd[i]
            _mm(Spi, sigma_q[n], S1)
            _mm(S1, Spi, S2)
            for i in range(K):
                for j in range(K):
                    S2[i, j] += Spd[i] * Spd[j]
            for i in range(K):
                for j in range(K):
                    g_sigma_q[n, i, j] = gh * (Spi[i, j] - Sqi[i, j])
                    g_sigma_p[n, i, j] = gh * (Spi[i, j] - half * (S2[i, j] + S2[j, i]))


# ---- builds ----------------------------------------------------------------------------------------------
def _build(f, parallel: bool):
    """Compile f as a parallel or a serial kernel. The serial copy gets its own qualname: Numba's on-disk
    cache is keyed by it and does not tell parallel from serial builds. No fastmath: both builds round
    identically, so the choice between them (by problem size) never changes a result."""
    if parallel:
        return _parallel(f)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial", f.__defaults__, f.__closure__)
    g.__qualname__ = f.__qualname__ + "_serial"
    return numba.njit(nogil=True, cache=True)(g)


_KERNELS = {
    name: (_build(f, True), _build(f, False))
    for name, f in (
        ("frames", _frames_kernel),
        ("means", _rotated_means_kernel),
        ("features", _features_kernel),
        ("vjp", _features_vjp_kernel),
        ("phi", _phi_grad_kernel),
        ("self_kl", _self_kl_kernel),
    )
}


def _kernel(name: str, N: int, K: int, serial: bool = False):
    """The parallel build of kernel ``name``, or the serial one for small problems or when asked
    (``serial``: callers on a scheduler's threads, e.g. the dask backend's tasks)."""
    par, ser = _KERNELS[name]
    return ser if serial or N * K**3 < SERIAL_WORK else par


def _dtype(*arrays) -> np.dtype:
    dt = np.result_type(*[a.dtype for a in arrays])
    if dt not in (np.float32, np.float64):
        raise TypeError(f"agent kernels need float32 or float64 arrays, got {dt}")
    return dt


def _taylor_coefficients(dt) -> np.ndarray:
    c = [1.0]
    for k in range(1, TAYLOR_DEGREE + 1):
        c.append(c[-1] / k)
    return np.array(c, dt)


def frames(phi: np.ndarray, G: np.ndarray, lmax: int, serial: bool = False) -> np.ndarray:
    """R = exp(phi . G): phi (N, 3), G (3, K, K), lmax the largest l of the irreps -> (N, K, K)."""
    dt = _dtype(phi)
    phi = np.ascontiguousarray(phi, dt)
    G = np.ascontiguousarray(G, dt)
    N, K = phi.shape[0], G.shape[1]
    R = np.empty((N, K, K), dt)
    if N:
        _kernel("frames", N, K, serial)(phi, G, np.float64(lmax), _taylor_coefficients(dt), R)
    return R


class AgentCache(tuple):
    """What :func:`features_vjp` needs: (mu, sigma, R, nu centred (N, K), P (N, K, K), Pnu (N, K))."""

    __slots__ = ()


def features(mu: np.ndarray, sigma: np.ndarray, R: np.ndarray, centre=None, serial: bool = False):
    """(mu (N, K), sigma (N, K, K), R (N, K, K)) -> (A (N, D), B (N, D), c (N,), cache, ok (N,) bool).

    nu = R^T mu is centred on its own mean, or on ``centre`` (K,) where given (a chunk of a larger
    population: the population's mean). ok[n] is False where R_n^T sigma_n R_n is not positive definite
    (the outputs are then invalid).
    """
    dt = _dtype(mu, sigma, R)
    mu, sigma, R = (np.ascontiguousarray(x, dt) for x in (mu, sigma, R))
    N, K = mu.shape
    D = K * (K + 1) // 2 + K + 1
    nu = np.empty((N, K), dt)
    A = np.empty((N, D), dt)
    B = np.empty((N, D), dt)
    c = np.empty(N, dt)
    P = np.empty((N, K, K), dt)
    Pnu = np.empty((N, K), dt)
    ok = np.ones(N, np.bool_)
    if N:
        _kernel("means", N, K, serial)(mu, R, nu)
        if centre is None:
            _centre(nu)
        else:
            nu -= np.asarray(centre, dt)
        _kernel("features", N, K, serial)(sigma, R, nu, dt.type(1), A, B, c, P, Pnu, ok)
    return A, B, c, AgentCache((mu, sigma, R, nu, P, Pnu)), ok


def features_vjp(gA: np.ndarray, gB: np.ndarray, gc: np.ndarray, cache: AgentCache, serial: bool = False):
    """Adjoint of :func:`features`: (gA, gB (N, D), gc (N,)) -> (g_mu (N, K), g_sigma, g_R (N, K, K))."""
    mu, sigma, R, nu, P, Pnu = cache
    dt = mu.dtype
    gA, gB, gc = (np.ascontiguousarray(x, dt) for x in (gA, gB, gc))
    N, K = mu.shape
    g_mu = np.empty((N, K), dt)
    g_sigma = np.empty((N, K, K), dt)
    g_R = np.empty((N, K, K), dt)
    if N:
        _kernel("vjp", N, K, serial)(gA, gB, gc, mu, sigma, R, nu, P, Pnu, dt.type(1), g_mu, g_sigma, g_R)
    return g_mu, g_sigma, g_R


def phi_grad(
    g_R: np.ndarray, R: np.ndarray, phi: np.ndarray, G: np.ndarray, serial: bool = False
) -> np.ndarray:
    """dF/dphi (N, 3) from dF/dR (N, K, K): Jr(phi)^T h with h_b = <R^T gR, G_b> (SPEC §2.1)."""
    dt = _dtype(g_R, R, phi)
    g_R, R, phi = (np.ascontiguousarray(x, dt) for x in (g_R, R, phi))
    G = np.ascontiguousarray(G, dt)
    N, K = phi.shape[0], G.shape[1]
    out = np.empty((N, 3), dt)
    if N:
        _kernel("phi", N, K, serial)(g_R, R, phi, G, dt.type(1), out)
    return out


def self_kl(mu_q, sigma_q, mu_p, sigma_p, g, serial: bool = False):
    """KL(q_i || p_i) (N,) and its gradients times the cotangent g (N,): (kl, g_mu_q, g_sigma_q, g_mu_p,
    g_sigma_p, ok); ok[n] is False where sigma_q or sigma_p of agent n is not positive definite."""
    dt = _dtype(mu_q, sigma_q, mu_p, sigma_p)
    mu_q, sigma_q, mu_p, sigma_p, g = (np.ascontiguousarray(x, dt) for x in (mu_q, sigma_q, mu_p, sigma_p, g))
    N, K = mu_q.shape
    kl = np.empty(N, dt)
    out = (np.empty((N, K), dt), np.empty((N, K, K), dt), np.empty((N, K), dt), np.empty((N, K, K), dt))
    ok = np.ones(N, np.bool_)
    if N:
        _kernel("self_kl", N, K, serial)(mu_q, sigma_q, mu_p, sigma_p, g, dt.type(1), kl, *out, ok)
    return (kl, *out, ok)
