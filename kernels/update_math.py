"""Per-agent math of the integrator updates (SPEC §2.5), written once for every device.

Plain Python over scalars and small 2-D arrays: explicit loops, no allocation, no numpy calls, only
``math``. Drivers compile the whole family with :func:`compile_all`: ``numba.njit`` in
:mod:`vfesim_kernels.update_cpu` (one ``prange`` over agents), ``numba.cuda.jit(device=True)`` in
:mod:`vfesim_kernels.update_cuda` (one thread per agent). Functions call each other by name;
``compile_all`` rebinds those names to the compiled twins, so one source serves both targets.

Scratch is float64 whatever the state dtype (float32 states are rounded once, on store): the Jacobi
stopping rule below is a float64 tolerance.

Layout: means (N, K); covariances (N, K, K); frames (N, 3); log-Cholesky coordinates ``theta`` (N, T),
T = K(K+1)/2, row-major lower triangle (index of (k, l), l <= k: k(k+1)/2 + l), diagonal entries log L_kk.
"""

from __future__ import annotations

import math
import types

__all__ = [
    "MODE_NATURAL",
    "MODE_EUCLIDEAN",
    "MODE_DIRECTION",
    "TWO_PI",
    "PHI_MAX",
    "FUNCTIONS",
    "compile_all",
]

MODE_NATURAL = 0  # input is dF/dx: d mu = -Sigma g, d Sigma = -2 Sigma G Sigma
MODE_EUCLIDEAN = 1  # input is dF/dx: d mu = -g, d Sigma = -G
MODE_DIRECTION = 2  # input is the direction itself (e.g. Adam's): d mu = g, d Sigma = G

TWO_PI = 2.0 * math.pi
# Largest |phi| wrap_phi reduces: beyond it float64 resolves the rotation angle to worse than 0.01 rad
# (|phi| eps > 0.01, eps = 2^-52), so the frame carries no usable angle any more.
PHI_MAX = 0.01 * 2.0**52


def mm(A, B, out):
    """out = A @ B (out distinct from A and B)."""
    n, m = A.shape
    p = B.shape[1]
    for a in range(n):
        for b in range(p):
            acc = 0.0
            for k in range(m):
                acc += A[a, k] * B[k, b]
            out[a, b] = acc


def jacobi_eigh(A, V, w):
    """Cyclic Jacobi eigendecomposition of a small symmetric A (K, K), overwritten: A = V diag(w) V^T.

    Allocation-free; for K <= ~10 it beats a LAPACK call per agent (no workspace queries).
    """
    K = A.shape[0]
    for a in range(K):
        for b in range(K):
            V[a, b] = 1.0 if a == b else 0.0
    for _ in range(64):
        off = 0.0
        dia = 0.0
        for p in range(K):
            dia += A[p, p] * A[p, p]
            for q in range(p + 1, K):
                off += A[p, q] * A[p, q]
        if off <= 1e-32 * dia or off == 0.0:
            break
        for p in range(K - 1):
            for q in range(p + 1, K):
                apq = A[p, q]
                if apq == 0.0:
                    continue
                theta = (A[q, q] - A[p, p]) / (2.0 * apq)
                if abs(theta) > 1e150:
                    t = 0.5 / theta
                else:
                    t = 1.0 / (abs(theta) + math.sqrt(theta * theta + 1.0))
                    if theta < 0.0:
                        t = -t
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                for k in range(K):  # A <- A P (columns p, q)
                    akp = A[k, p]
                    akq = A[k, q]
                    A[k, p] = c * akp - s * akq
                    A[k, q] = s * akp + c * akq
                for k in range(K):  # A <- P^T A (rows p, q)
                    apk = A[p, k]
                    aqk = A[q, k]
                    A[p, k] = c * apk - s * aqk
                    A[q, k] = s * apk + c * aqk
                A[p, q] = 0.0
                A[q, p] = 0.0
                for k in range(K):  # V <- V P
                    vkp = V[k, p]
                    vkq = V[k, q]
                    V[k, p] = c * vkp - s * vkq
                    V[k, q] = s * vkp + c * vkq
    for a in range(K):
        w[a] = A[a, a]


def sandwich(V, f, out):
    """out = V diag(f) V^T."""
    K = V.shape[0]
    for a in range(K):
        for b in range(a, K):
            acc = 0.0
            for k in range(K):
                acc += V[a, k] * f[k] * V[b, k]
            out[a, b] = acc
            out[b, a] = acc


def retract(S, G, eta, mode, out, W, wv):
    """out = S^1/2 expm(eta A) S^1/2, A = S^-1/2 dS S^-1/2 (SPEC §2.5), for one agent.

    S, G, out (K, K); dS = -2 S G S (natural), -G (euclidean) or G (direction). Scratch W (6, K, K),
    wv (3, K), float64. A = coef H G H with H = S^1/2 (natural) or S^-1/2; out = B B^T with
    B = S^1/2 U diag(exp(e/2)), A = U diag(e) U^T.
    """
    K = S.shape[0]
    Ac, V, H, T, U, B = W[0], W[1], W[2], W[3], W[4], W[5]
    w, e, f = wv[0], wv[1], wv[2]
    for a in range(K):
        for b in range(K):
            Ac[a, b] = S[a, b]
    jacobi_eigh(Ac, V, w)
    for k in range(K):
        f[k] = math.sqrt(w[k]) if mode == MODE_NATURAL else 1.0 / math.sqrt(w[k])
    sandwich(V, f, H)
    coef = -2.0 * eta if mode == MODE_NATURAL else (-eta if mode == MODE_EUCLIDEAN else eta)
    mm(H, G, T)
    mm(T, H, Ac)
    for a in range(K):
        Ac[a, a] *= coef
        for b in range(a + 1, K):
            m = 0.5 * coef * (Ac[a, b] + Ac[b, a])
            Ac[a, b] = m
            Ac[b, a] = m
    jacobi_eigh(Ac, U, e)
    for k in range(K):
        f[k] = math.sqrt(w[k])
    sandwich(V, f, T)
    mm(T, U, B)
    for j in range(K):
        s = math.exp(0.5 * e[j])
        for a in range(K):
            B[a, j] *= s
    for a in range(K):
        for b in range(a, K):
            acc = 0.0
            for j in range(K):
                acc += B[a, j] * B[b, j]
            out[a, b] = acc
            out[b, a] = acc


def fmod_pos(x, y):
    """x mod y for x >= 0, y > 0, exactly (C ``fmod``): numba's CPU ``%`` on floats is fmod. The CUDA
    driver rebinds this name to ``math.fmod``: NVVM lowers ``%`` to ``x - y floor(x / y)``, not exact."""
    return x % y


def wrap_phi(phi, out):
    """Principal-ball representative (SPEC §2.5): phi r / |phi| with r = |phi| reduced mod 2 pi into
    [-pi, pi] (the same rotation for every integer-spin irrep); phi itself when |phi| <= pi.

    Closed form (an exact fmod; the results equal NumPy's ``np.fmod``). |phi| > PHI_MAX, or infinite,
    gives NaN: no angle is left to keep, and the integrators' NaN guard then names step and agent.
    """
    t = math.sqrt(phi[0] * phi[0] + phi[1] * phi[1] + phi[2] * phi[2])
    f = 1.0
    if t > math.pi:
        if t <= PHI_MAX:
            r = fmod_pos(t, TWO_PI)
            if r > math.pi:
                r -= TWO_PI  # exact (Sterbenz): r in (pi, 2 pi)
            f = r / t
        else:
            f = math.nan
    for a in range(3):
        out[a] = phi[a] * f


def unpack_L(theta, K, L):
    """Lower-triangular L (K, K) of one agent's log-Cholesky vector theta (T,)."""
    for k in range(K):
        for l in range(K):
            L[k, l] = 0.0
        base = k * (k + 1) // 2
        for l in range(k):
            L[k, l] = theta[base + l]
        L[k, k] = math.exp(theta[base + k])


def gradient_flow_agent(
    i, mu_q, sigma_q, mu_p, sigma_p, phi,
    g_mu_q, g_sigma_q, g_mu_p, g_sigma_p, g_phi,
    eta, mode,
    o_mu_q, o_sigma_q, o_mu_p, o_sigma_p, o_phi,
    W, wv, tmp,
):  # fmt: skip
    """One gradient-flow step of agent i (see ``update_cpu.gradient_flow_update_cpu``).

    Scratch: W (6, K, K), wv (3, K), tmp (3,), float64.
    """
    K = mu_q.shape[1]
    for f in range(2):
        mu = mu_q if f == 0 else mu_p
        S = sigma_q if f == 0 else sigma_p
        gm = g_mu_q if f == 0 else g_mu_p
        gS = g_sigma_q if f == 0 else g_sigma_p
        om = o_mu_q if f == 0 else o_mu_p
        oS = o_sigma_q if f == 0 else o_sigma_p
        em = eta[2 * f]
        eS = eta[2 * f + 1]
        for a in range(K):
            if em == 0.0:
                om[i, a] = mu[i, a]
            elif mode == MODE_NATURAL:
                acc = 0.0
                for b in range(K):
                    acc += S[i, a, b] * gm[i, b]
                om[i, a] = mu[i, a] - em * acc
            elif mode == MODE_EUCLIDEAN:
                om[i, a] = mu[i, a] - em * gm[i, a]
            else:
                om[i, a] = mu[i, a] + em * gm[i, a]
        if eS == 0.0:
            for a in range(K):
                for b in range(K):
                    oS[i, a, b] = S[i, a, b]
        else:
            retract(S[i], gS[i], eS, mode, oS[i], W, wv)
    ep = eta[4]
    sgn = 1.0 if mode == MODE_DIRECTION else -1.0
    for a in range(3):
        tmp[a] = phi[i, a] + sgn * ep * g_phi[i, a]
    if ep == 0.0:
        for a in range(3):
            o_phi[i, a] = phi[i, a]
    else:
        wrap_phi(tmp, o_phi[i])


def theta_to_sigma_agent(i, theta, K, out, L):
    """out[i] = L L^T from theta[i] (scratch L (K, K))."""
    unpack_L(theta[i], K, L)
    for a in range(K):
        for b in range(a, K):
            acc = 0.0
            for j in range(b + 1):
                acc += L[a, j] * L[b, j]
            out[i, a, b] = acc
            out[i, b, a] = acc


def kick_drift_agent(
    i, x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta, out_sigma,
    x_phi, p_phi, g_phi, inv_m_phi, do_phi, L,
):  # fmt: skip
    """Agent i, in place: ``p -= kick * dF/dx`` then ``x += drift * p / m``, Sigma = L L^T.

    dF/dtheta from the symmetric G = dF/dSigma: dF/dL = 2 G L (lower part), times L_kk on the
    log-diagonal. kick == 0 or drift == 0 skips that half; out_sigma is written only when drift != 0.
    The frame block (x_phi, p_phi, g_phi) is updated too when ``do_phi``. Scratch L (K, K).
    """
    K = x_mu.shape[1]
    if kick != 0.0:
        unpack_L(x_theta[i], K, L)
        for a in range(K):
            p_mu[i, a] -= kick * g_mu[i, a]
        for k in range(K):
            base = k * (k + 1) // 2
            for l in range(k + 1):
                acc = 0.0  # (G L)[k, l] = sum_j G[k, j] L[j, l], L[j, l] = 0 for j < l
                for j in range(l, K):
                    acc += g_sigma[i, k, j] * L[j, l]
                d = 2.0 * acc
                if l == k:
                    d *= L[k, k]
                p_theta[i, base + l] -= kick * d
        if do_phi:
            for a in range(3):
                p_phi[i, a] -= kick * g_phi[i, a]
    if drift != 0.0:
        for a in range(K):
            x_mu[i, a] += drift * inv_m_mu * p_mu[i, a]
        for t in range(x_theta.shape[1]):
            x_theta[i, t] += drift * inv_m_theta * p_theta[i, t]
        if do_phi:
            for a in range(3):
                x_phi[i, a] += drift * inv_m_phi * p_phi[i, a]
        theta_to_sigma_agent(i, x_theta, K, out_sigma, L)


# Compiled in this order; each may call only those before it.
FUNCTIONS = (
    "mm",
    "jacobi_eigh",
    "sandwich",
    "retract",
    "fmod_pos",
    "wrap_phi",
    "unpack_L",
    "gradient_flow_agent",
    "theta_to_sigma_agent",
    "kick_drift_agent",
)


def compile_all(jit, replace=None) -> types.SimpleNamespace:
    """Every function of :data:`FUNCTIONS` compiled with ``jit``, calls bound to the compiled twins.

    Each function is re-created over a private copy of this module's globals in which the callee
    names point at the compiled versions (a compiled function cannot call a plain Python one).
    ``replace``: name -> an already compiled function used instead of compiling that one (a target's
    own version of a primitive, e.g. ``fmod_pos`` on CUDA).
    """
    replace = replace or {}
    g = dict(globals())
    for name in FUNCTIONS:
        if name in replace:
            g[name] = replace[name]
            continue
        fn = globals()[name]
        g[name] = jit(types.FunctionType(fn.__code__, g, name, fn.__defaults__, fn.__closure__))
    return types.SimpleNamespace(**{name: g[name] for name in FUNCTIONS})
