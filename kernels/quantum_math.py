"""Per-agent density-matrix maths written once (spec/quantum.md §2–§4), compiled for the CPU (njit) and
as CUDA device functions.

Plain Python over one agent's small complex matrices, no allocation: callers pass scratch (``(d, d)``
complex matrices ``T*``, a real ``(d,)`` vector ``r``). Functions call each other by their module-level
names; :func:`link` compiles the whole set for one target, binding each name to its compiled version
(numba resolves a call through a global to a compile-time function, on either target).

The same operations as the NumPy stages of ``vfesim.quantum`` (the vectorised reference):

- :func:`jacobi_eigh`: ``A = V diag(w) V^dagger`` for Hermitian A by cyclic complex Jacobi rotations
  (eigenvalues unordered: every consumer is symmetric in them); :func:`eigh_agent` sorts them ascending
  (a batched ``eigh``);
- :func:`eig_log_agent`: eigen-decomposition of a floored belief x, ``log x`` and ``tr(x log x)``;
- :func:`gibbs_agent`: the Gibbs prior ``sigma = exp(-H/T)/Z``, its log and log-eigenvalues
  ``l = -h/T - log Z`` (a log-sum-exp, no ``log p``);
- :func:`frames_agent`: ``U = exp(-i phi . J)`` through the eigen-decomposition of ``phi . J``;
- each of these three as an eigen-decomposition and a ``*_from_eig`` completion (:func:`log_from_eig`,
  :func:`gibbs_from_eig`, :func:`frames_from_eig`), which :func:`energy_mats_agent` /
  :func:`energy_finish_agent` run around a batched eigensolver of the three matrices per agent (the CUDA
  kernels' cooperative Jacobi at large d, ``vfesim_kernels.cuda.eigh``);
- :func:`pull_features` / :func:`pull_vjp_add`: the pairwise feature rows of pulled-back states,
  ``A = hvec(U^dagger a U)``, ``B = -2 hvec(U^dagger (log a) U)`` (``trace_first`` coordinates), and
  their adjoint;
- :func:`dk_log`, :func:`dk_exp`, :func:`frames_vjp`: Daleckii–Krein adjoints of ``log``, ``exp`` and
  ``exp(-i .)`` (the divided differences of ``vfesim.quantum.linalg``);
- :func:`energy_prep_agent`, :func:`energy_features_agent` / :func:`energy_backward_agent`: the whole
  per-agent part of the free energy (its three independent eigen-decompositions, then energies and
  features) and of its gradient (the stages above, fused: two launches forward, one back).

Sizes: loops take d from a scratch matrix the caller passes (the matrix products from their output, which
callers pass as scratch), never from a view of a batched argument (``U[n]``): a GPU thread's scratch has a
compile-time shape, so the loops unroll and the scratch can live in registers; a loop bounded by a
batched argument's run-time shape keeps every scratch it indexes in local memory.

Every ``*_agent`` function handles agent ``n`` of its batched arguments (``energy_prep_agent``: part
``t // N`` of agent ``t % N``), so a CPU kernel loops it over agents (parts) and a CUDA kernel runs it once
per thread. The O(d^3) work (matrix products, Jacobi rotations, eigen-reconstructions) runs in the
arrays' precision: accumulators start as ``X.dtype.type(0)`` and rotation scalars are cast to it (a float
literal would promote complex64 work to complex128). O(d^2) scalars (divided differences, coupling
weights, traces) are evaluated in float64 where a float literal promotes them; results are stored in the
arrays' dtypes.
"""

import math
import types

__all__ = ["link", "FUNCTIONS", "MAX_SWEEPS", "SQRT2"]

# Sweeps of the Jacobi eigensolver at most (quadratic convergence: 4-8 reach round-off for d <= 8).
MAX_SWEEPS = 30
SQRT2 = math.sqrt(2.0)
# |tau| above which t = 1 / (2 |tau|) replaces 1 / (|tau| + sqrt(1 + tau^2)): equal to relative 1e-30
# there, and tau^2 cannot overflow (not even in float32, as the CUDA simulator evaluates complex64).
_TAU_BIG = 1e15


def jacobi_eigh(A, w, V, tol2):
    """Hermitian A (d, d) -> eigenvalues w (d,) and unitary eigenvectors V (columns); A is overwritten.

    Each rotation zeroes A[p, q] = g e (g = |A[p, q]|, |e| = 1) with the unitary G that equals the identity
    except G[p, p] = G[q, q] = c, G[p, q] = s e, G[q, p] = -s conj(e), t = s / c the root of smaller
    modulus of t^2 + 2 tau t - 1 = 0, tau = (A[q, q] - A[p, p]) / (2 g); A <- G^dagger A G, V <- V G.
    Sweeps stop when the squared off-diagonal norm is at most ``tol2`` times the squared Frobenius norm.
    """
    d = A.shape[0]
    one = w.dtype.type(1.0)  # the rotations in the matrices' precision (float32 for complex64)
    for r in range(d):
        for c in range(d):
            V[r, c] = 0.0
        V[r, r] = 1.0
    for _ in range(MAX_SWEEPS):
        off = 0.0
        diag = 0.0
        for p in range(d):
            diag += A[p, p].real * A[p, p].real
            for q in range(p + 1, d):
                off += A[p, q].real * A[p, q].real + A[p, q].imag * A[p, q].imag
        if off <= tol2 * (diag + 2.0 * off):
            break
        for p in range(d - 1):
            for q in range(p + 1, d):
                if A[p, q].real == 0.0 and A[p, q].imag == 0.0:
                    continue
                c, se, sec = jacobi_rotation(A, p, q, one)
                for k in range(d):  # A <- A G (columns p, q)
                    akp = A[k, p]
                    akq = A[k, q]
                    A[k, p] = c * akp - sec * akq
                    A[k, q] = se * akp + c * akq
                for k in range(d):  # A <- G^dagger A (rows p, q)
                    apk = A[p, k]
                    aqk = A[q, k]
                    A[p, k] = c * apk - se * aqk
                    A[q, k] = sec * apk + c * aqk
                A[p, q] = 0.0
                A[q, p] = 0.0
                A[p, p] = A[p, p].real
                A[q, q] = A[q, q].real
                for k in range(d):  # V <- V G
                    vkp = V[k, p]
                    vkq = V[k, q]
                    V[k, p] = c * vkp - sec * vkq
                    V[k, q] = se * vkp + c * vkq
    for k in range(d):
        w[k] = A[k, k].real


def jacobi_rotation(A, p, q, one):
    """The rotation of :func:`jacobi_eigh` that zeroes A[p, q] (non-zero) of a Hermitian A: (c, s e,
    s conj(e)), computed in the precision of ``one`` (1 in A's real type). It depends on the 2 x 2 block
    of rows and columns p, q alone (the parallel orderings of ``vfesim_kernels.cuda.eigh`` rotate disjoint
    pairs at once)."""
    apq = A[p, q]
    g = abs(apq)
    e = apq / g
    two = one + one
    tau = (A[q, q].real - A[p, p].real) / (two * g)
    at = abs(tau)
    t = (one / two) / at if at > _TAU_BIG else one / (at + math.sqrt(one + tau * tau))
    if tau < 0.0:
        t = -t
    c = one / math.sqrt(one + t * t)
    s = t * c
    return c, s * e, s * e.conjugate()


def eigh_agent(X, n, tol2, w_out, V_out, A, w, V):
    """w_out[n] ascending and V_out[n] (matching columns) of herm(X[n]) (:func:`jacobi_eigh`, stopping at
    ``tol2``): the batched ``eigh`` of ``vfesim.quantum.linalg`` for small d. Scratch A, V (d, d), w (d,)."""
    d = A.shape[0]
    load_herm(X, n, A)
    jacobi_eigh(A, w, V, tol2)
    for k in range(d):  # selection of the least remaining eigenvalue; ties keep Jacobi's order
        m = k
        for q in range(k + 1, d):
            if w[q] < w[m]:
                m = q
        wm = w[m]
        w[m] = w[k]
        w[k] = wm
        for r in range(d):
            v = V[r, m]
            V[r, m] = V[r, k]
            V[r, k] = v
        w_out[n, k] = w[k]
        for r in range(d):
            V_out[n, r, k] = V[r, k]


def born_logp_entry(flat, offsets, k, keep, add, acc):
    """acc[k] += log x_yy for the k-th observed entry flat[offsets[k]] = rho_i[y_i, y_i] of a rollout's
    Born loss, x_yy = keep rho_yy + add the floored state's diagonal (keep, add and the log in the states'
    real precision, as the array code of ``vfesim.quantum.born``), acc float64."""
    p = flat[offsets[k]].real * keep + add
    acc[k] += math.log(p)


def born_add_entry(bar, bar_offsets, flat, offsets, k, keep, add, c):
    """bar[bar_offsets[k]] += c / x_yy: the cotangent of c log x_yy (c = -weight (1 - e)) for the k-th
    observed entry (:func:`born_logp_entry`)."""
    p = flat[offsets[k]].real * keep + add
    bar[bar_offsets[k]] += c / p


def load_herm(X, n, A):
    """A = (X[n] + X[n]^dagger) / 2."""
    d = A.shape[0]
    for r in range(d):
        for c in range(d):
            A[r, c] = 0.5 * (X[n, r, c] + X[n, c, r].conjugate())


def floored(X, eps, out):
    """out = (1 - eps) herm(X) + eps I / d: the depolarising floor of a state (spec §2.3)."""
    d = X.shape[0]
    for r in range(d):
        for c in range(d):
            out[r, c] = (1.0 - eps) * 0.5 * (X[r, c] + X[c, r].conjugate())
        out[r, r] += eps / d


def from_eig(V, f, out):
    """out = V diag(f) V^dagger for real f (d,)."""
    d = out.shape[0]
    for r in range(d):
        for c in range(d):
            acc = V.dtype.type(0)
            for k in range(d):
                acc += V[r, k] * f[k] * V[c, k].conjugate()
            out[r, c] = acc


def mm(X, Y, out):
    """out = X Y."""
    d = out.shape[0]
    for r in range(d):
        for c in range(d):
            acc = X.dtype.type(0)
            for k in range(d):
                acc += X[r, k] * Y[k, c]
            out[r, c] = acc


def mm_add(X, Y, out):
    """out += X Y."""
    d = out.shape[0]
    for r in range(d):
        for c in range(d):
            acc = X.dtype.type(0)
            for k in range(d):
                acc += X[r, k] * Y[k, c]
            out[r, c] += acc


def mm_dl(X, Y, out):
    """out = X^dagger Y."""
    d = out.shape[0]
    for r in range(d):
        for c in range(d):
            acc = X.dtype.type(0)
            for k in range(d):
                acc += X[k, r].conjugate() * Y[k, c]
            out[r, c] = acc


def mm_dr(X, Y, out):
    """out = X Y^dagger."""
    d = out.shape[0]
    for r in range(d):
        for c in range(d):
            acc = X.dtype.type(0)
            for k in range(d):
                acc += X[r, k] * Y[c, k].conjugate()
            out[r, c] = acc


def pull_back(U, X, T, out):
    """out = U^dagger X U (T: scratch)."""
    mm_dl(U, X, T)
    mm(T, U, out)


def push_forward(U, X, T, out):
    """out = U X U^dagger (T: scratch)."""
    mm(U, X, T)
    mm_dr(T, U, out)


def hvec_store(X, scale, out):
    """out (d^2,) = scale * hvec(X, trace_first=True) (``vfesim.quantum.linalg.hvec``): [diag X in the
    Helmert basis, sqrt2 Re triu X, sqrt2 Im triu X] (row-major strict upper triangle). The Helmert
    coordinates of the diagonal x: h_0 = (x_0 + ... + x_{d-1}) / sqrt(d), h_k = (x_0 + ... + x_{k-1} - k x_k)
    / sqrt(k (k + 1))."""
    d = X.shape[0]
    m = d * (d - 1) // 2
    s = X[0, 0].real
    for k in range(1, d):
        x = X[k, k].real
        out[k] = scale * ((s - out.dtype.type(k) * x) * out.dtype.type(1.0 / math.sqrt(k * (k + 1.0))))
        s += x
    out[0] = scale * (s * out.dtype.type(1.0 / math.sqrt(d)))
    i = 0
    for p in range(d):
        for q in range(p + 1, d):
            out[d + i] = scale * SQRT2 * X[p, q].real
            out[d + m + i] = scale * SQRT2 * X[p, q].imag
            i += 1


def hmat_load(v, scale, X):
    """X = the traceless part of the Hermitian matrix of coordinates scale * v (:func:`hvec_store`'s), and
    returns its identity coefficient scale * v[0] / sqrt(d) (the matrix is X + that times I). Apart, so
    that the identity part, large in a pair cotangent, costs the traceless part no precision. The diagonal:
    x_l = sum_{k > l} h_k / sqrt(k (k + 1)) - l h_l / sqrt(l (l + 1))."""
    d = X.shape[0]
    m = d * (d - 1) // 2
    t = v.dtype.type(0.0)
    for l in range(d - 1, 0, -1):
        hl = v[l] * v.dtype.type(1.0 / math.sqrt(l * (l + 1.0)))
        X[l, l] = scale * (t - v.dtype.type(l) * hl)
        t += hl
    X[0, 0] = scale * t
    i = 0
    for p in range(d):
        for q in range(p + 1, d):
            z = complex(scale * v[d + i] / SQRT2, scale * v[d + m + i] / SQRT2)
            X[p, q] = z
            X[q, p] = z.conjugate()
            i += 1
    return scale * (v[0] * v.dtype.type(1.0 / math.sqrt(d)))


def dd_log(a, b, R):
    """log^[1](a, b) for a, b > 0: 2 atanh(delta) / (delta (a + b)) for |delta| < 1/2 with
    delta = (a - b) / (a + b) (1/a at a tie), else (log a - log b) / (a - b). R: the real type (the
    divided differences' precision, that of a and b)."""
    tot = a + b
    delta = (a - b) / tot
    if abs(delta) < 0.5:
        ratio = R(1.0) if delta == 0.0 else math.atanh(delta) / delta
        return R(2.0) * ratio / tot
    return (math.log(a) - math.log(b)) / (a - b)


def dd_exp(la, lb, pa, pb, R):
    """exp^[1] at log-values la, lb (pa = e^la, pb = e^lb): sqrt(pa pb) sinh(x) / x, x = (la - lb) / 2, for
    |la - lb| < 1, else (pa - pb) / (la - lb). R: the real type."""
    dl = la - lb
    if abs(dl) < 1.0:
        x = R(0.5) * dl
        sinhc = R(1.0) if x == 0.0 else math.sinh(x) / x
        return math.sqrt(pa * pb) * sinhc
    return (pa - pb) / dl


def dd_expi_conj(ka, kb, R):
    """conj of f^[1](ka, kb) for f(k) = exp(-i k): i exp(i (ka + kb) / 2) sinc((ka - kb) / 2). R: the real
    type (the result is complex128: callers cast it to their matrices' type)."""
    y = R(0.5) * (ka - kb)
    sc = R(1.0) if y == 0.0 else math.sin(y) / y
    th = R(0.5) * (ka + kb)
    return complex(-math.sin(th) * sc, math.cos(th) * sc)


def eig_log_agent(x, n, s, W, logx, xlx, A, r, tol2):
    """s[n], W[n]: eigen-decomposition of herm(x[n]); logx[n] = W diag(log s) W^dagger; xlx[n] = tr(x log x).
    Scratch A (d, d), r (d,)."""
    load_herm(x, n, A)
    jacobi_eigh(A, s[n], W[n], tol2)
    xlx[n] = log_from_eig(s[n], W[n], logx[n], r)


def log_from_eig(sn, Wn, logx_n, r):
    """logx_n = W diag(log s) W^dagger from the eigen-decomposition (sn, Wn) of a state; returns
    tr(x log x) = sum s log s. Scratch r (d,)."""
    h = 0.0
    for k in range(r.shape[0]):
        r[k] = math.log(sn[k])
        h += sn[k] * r[k]
    from_eig(Wn, r, logx_n)
    return h


def gibbs_agent(H, T, n, sigma, logsig, l, p, V, A, tol2):
    """Gibbs prior of agent n: herm(H[n]) = V diag(h) V^dagger, l = -h/T - log Z (log-sum-exp with the
    maximum shifted out), p = exp(l), sigma = V diag(p) V^dagger, logsig = V diag(l) V^dagger."""
    load_herm(H, n, A)
    jacobi_eigh(A, l[n], V[n], tol2)
    gibbs_from_eig(l[n], T[n], p[n], V[n], sigma[n], logsig[n], A)


def gibbs_from_eig(ln, tn, pn, Vn, sigma_n, logsig_n, S):
    """The Gibbs prior at temperature tn from the eigen-decomposition (ln = h, Vn) of its Hamiltonian:
    ln <- -h/T - log Z, pn = exp(ln), sigma_n = V diag(p) V^dagger, logsig_n = V diag(l) V^dagger. S: any
    scratch of d rows (the loops' size)."""
    d = S.shape[0]
    m = -ln[0] / tn
    for k in range(1, d):
        m = max(m, -ln[k] / tn)
    acc = 0.0
    for k in range(d):
        acc += math.exp(-ln[k] / tn - m)
    lz = m + math.log(acc)
    for k in range(d):
        ln[k] = -ln[k] / tn - lz
        pn[k] = math.exp(ln[k])
    from_eig(Vn, pn, sigma_n)
    from_eig(Vn, ln, logsig_n)


def frames_agent(phi, J, n, U, k, V, A, tol2):
    """U[n] = exp(-i phi[n] . J) = V diag(exp(-i k)) V^dagger with phi[n] . J = V diag(k) V^dagger."""
    generator(phi, J, n, A)
    jacobi_eigh(A, k[n], V[n], tol2)
    frames_from_eig(k[n], V[n], U[n], A)


def generator(phi, J, n, A):
    """A = phi[n] . J."""
    d = A.shape[0]
    for r in range(d):
        for c in range(d):
            A[r, c] = phi[n, 0] * J[0, r, c] + phi[n, 1] * J[1, r, c] + phi[n, 2] * J[2, r, c]


def frames_from_eig(kn, Vn, Un, S):
    """Un = V diag(exp(-i k)) V^dagger from the eigen-decomposition (kn, Vn) of phi . J. S: any scratch of
    d rows (the loops' size)."""
    d = S.shape[0]
    for r in range(d):
        for c in range(d):
            acc = Vn.dtype.type(0)
            for j in range(d):
                z = Vn.dtype.type(complex(math.cos(kn[j]), -math.sin(kn[j])))
                acc += Vn[r, j] * z * Vn[c, j].conjugate()
            Un[r, c] = acc


def pull_features(Un, a, loga, Arow, Brow, T1, T2):
    """Arow = hvec(U^dagger a U), Brow = -2 hvec(U^dagger (log a) U) (one agent's feature rows, in
    ``trace_first`` coordinates: :func:`hvec_store`)."""
    pull_back(Un, a, T1, T2)
    hvec_store(T2, 1.0, Arow)
    pull_back(Un, loga, T1, T2)
    hvec_store(T2, -2.0, Brow)


def pull_vjp_add(gA, gB, gc, lam, Un, a, loga, a_bar, la_bar, U_bar, C, M, T, P):
    """Adds lam times the adjoint of :func:`pull_features` and of the feature c = 2 tr(a log a)
    (d tr(a log a) = tr((log a + I) da), the I left out: every consumer projects it away): with
    C + cC I = hmat(lam gA) and M + cM I = hmat(-2 lam gB) (cotangents of the pulled-back a and log a; C, M
    traceless), a_bar += U C U^dagger + cC I + 2 lam gc log a, la_bar += U M U^dagger + cM I and
    U_bar += 2 (a U C + (log a) U M) (dL = Re tr(U_bar^dagger dU) up to terms U H, H Hermitian, that rule
    R2 maps to 0). The identity parts stay out of U_bar: they would dominate it, while the phi gradient is
    a small part of it (in complex64 it lost 1.2e-4 relative at N = 65 536, numba)."""
    d = C.shape[0]
    cC = hmat_load(gA, lam, C)
    cM = hmat_load(gB, -2.0 * lam, M)
    push_forward(Un, C, T, P)
    for r in range(d):
        for c in range(d):
            a_bar[r, c] += P[r, c] + 2.0 * lam * gc * loga[r, c]
        a_bar[r, r] += cC
    push_forward(Un, M, T, P)
    for r in range(d):
        for c in range(d):
            la_bar[r, c] += P[r, c]
        la_bar[r, r] += cM
    mm(Un, C, T)
    mm(a, T, P)
    mm(Un, M, T)
    mm_add(loga, T, P)
    for r in range(d):
        for c in range(d):
            U_bar[r, c] += 2.0 * P[r, c]


def dk_log(sn, Wn, E, out, T1, T2):
    """out = Dlog(x)[E] = W (log^[1](s) o W^dagger E W) W^dagger (x = W diag(s) W^dagger)."""
    d = T1.shape[0]
    pull_back(Wn, E, T1, T2)
    for r in range(d):
        for c in range(d):
            T2[r, c] = T2[r, c] * dd_log(sn[r], sn[c], sn.dtype.type)
    push_forward(Wn, T2, T1, out)


def dk_exp(ln, pn, Vn, E, out, T1, T2):
    """out = Dexp(L)[E] = V (exp^[1](l) o V^dagger E V) V^dagger (L = V diag(l) V^dagger, p = exp(l))."""
    d = T1.shape[0]
    pull_back(Vn, E, T1, T2)
    for r in range(d):
        for c in range(d):
            T2[r, c] = T2[r, c] * dd_exp(ln[r], ln[c], pn[r], pn[c], ln.dtype.type)
    push_forward(Vn, T2, T1, out)


def frames_vjp(U_bar, kn, Vn, J, out, T1, T2, T3):
    """out[a] = Re tr(Kbar^dagger J_a), Kbar = V (conj(f^[1](k)) o V^dagger U_bar V) V^dagger, f = exp(-i .)
    (rule R2; phi . J = V diag(k) V^dagger)."""
    d = T1.shape[0]
    pull_back(Vn, U_bar, T1, T2)
    for r in range(d):
        for c in range(d):
            T2[r, c] = T2[r, c] * T2.dtype.type(dd_expi_conj(kn[r], kn[c], kn.dtype.type))
    push_forward(Vn, T2, T1, T3)
    for a in range(3):
        acc = 0.0
        for r in range(d):
            for c in range(d):
                z = T3[r, c]
                j = J[a, r, c]
                acc += z.real * j.real + z.imag * j.imag
        out[a] = acc


def energy_prep_agent(
    t, rho, H, T, phi, J, fs, fb, fp, eps, tol2, x, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf, Ms, r,
):  # fmt: skip
    """Part t // N of the free energy's forward pass for agent n = t % N (N agents), the terms on by the
    flags fs (self), fb (belief), fp (prior); the three parts are independent (a kernel runs them in
    parallel): 0 the floored belief x[n] = (1 - eps) herm(rho[n]) + eps I/d and, for self or belief, its
    eig_log (s, W, logx, xlx); 1 for self or prior, the Gibbs prior (sigma, logsig, l, p, V); 2 for belief
    or prior, the frame (U; k, Vf of phi . J). Scratch Ms (d, d) complex, r (d,) real."""
    N = rho.shape[0]
    part = t // N
    n = t - part * N
    if part == 0:
        floored(rho[n], eps, x[n])
        if fs or fb:
            eig_log_agent(x, n, s, W, logx, xlx, Ms, r, tol2)
    elif part == 1:
        if fs or fp:
            gibbs_agent(H, T, n, sigma, logsig, l, p, V, Ms, tol2)
    elif fb or fp:
        frames_agent(phi, J, n, U, k, Vf, Ms, tol2)


def energy_mats_agent(t, rho, H, phi, J, fs, fb, fp, eps, x, M):
    """The matrices of :func:`energy_prep_agent`'s three eigen-decompositions, for a batched eigensolver:
    part t // N of agent n = t % N writes M[t] (a (3 N, d, d) batch): 0 the floored belief x[n] (also
    stored in x), 1 herm(H[n]), 2 phi[n] . J; zeros for a part whose terms are off. Then
    :func:`energy_finish_agent` on their eigen-decompositions completes the pass."""
    N = rho.shape[0]
    part = t // N
    n = t - part * N
    Mt = M[t]
    d = Mt.shape[0]
    if part == 0:
        floored(rho[n], eps, x[n])
    on = (part == 0 and (fs or fb)) or (part == 1 and (fs or fp)) or (part == 2 and (fb or fp))
    if not on:
        for r in range(d):
            for c in range(d):
                Mt[r, c] = 0.0
    elif part == 0:
        _copy(x[n], Mt)
    elif part == 1:
        load_herm(H, n, Mt)
    else:
        generator(phi, J, n, Mt)


def energy_finish_agent(t, T, fs, fb, fp, ew, eV, s, W, logx, xlx, sigma, logsig, l, p, V, U, k, Vf, r):
    """:func:`energy_prep_agent`'s part t // N of agent n = t % N from the eigen-decomposition (ew[t],
    eV[t]) of :func:`energy_mats_agent`'s M[t]: the same outputs. Scratch r (d,)."""
    N = s.shape[0]
    part = t // N
    n = t - part * N
    d = r.shape[0]
    if part == 0:
        if fs or fb:
            _eig_copy(ew, eV, t, s[n], W[n], d)
            xlx[n] = log_from_eig(s[n], W[n], logx[n], r)
    elif part == 1:
        if fs or fp:
            _eig_copy(ew, eV, t, l[n], V[n], d)
            gibbs_from_eig(l[n], T[n], p[n], V[n], sigma[n], logsig[n], r)
    elif fb or fp:
        _eig_copy(ew, eV, t, k[n], Vf[n], d)
        frames_from_eig(k[n], Vf[n], U[n], r)


def _eig_copy(ew, eV, t, w, V, d):
    """w, V = ew[t], eV[t]."""
    for i in range(d):
        w[i] = ew[t, i]
        for j in range(d):
            V[i, j] = eV[t, i, j]


def energy_features_agent(y, fs, fb, fp, fo, n, x, logx, xlx, sigma, logsig, l, p, U, e, A, B, c, T1, T2):
    """The rest of the forward pass for agent n, after :func:`energy_prep_agent`: per-agent energies
    e[:, n] = (D(x || sigma), -log <y|x|y>) and the feature rows (A, B, c)[0, n] of the belief term and
    [1, n] of the prior term (c = 2 tr(a log a)), for the terms on (fo: observation). Scratch T1, T2."""
    if fs:
        e[0, n] = xlx[n] - _tr_re(x[n], logsig[n])
    if fo:
        yn = y[n]
        e[1, n] = -math.log(x[n, yn, yn].real)
    if fb:
        pull_features(U[n], x[n], logx[n], A[0, n], B[0, n], T1, T2)
        c[0, n] = 2.0 * xlx[n]
    if fp:
        pull_features(U[n], sigma[n], logsig[n], A[1, n], B[1, n], T1, T2)
        acc = 0.0
        for i in range(T1.shape[0]):
            acc += p[n, i] * l[n, i]
        c[1, n] = 2.0 * acc


def energy_backward_agent(
    H, T, y, J, fs, fb, fp, fo, ls, lb, lp, lo, eps, gA, gB, gc, n, x, s, W, logx, sigma, logsig, l, p, V,
    U, k, Vf, g_rho, g_H, g_T, g_phi, Xb, Lb, Ub, Sb, LSb, C, M, T1, T2, T3,
):  # fmt: skip
    """The gradient of agent n (conventions of ``vfesim.quantum.energy``) from the caches of the forward
    pass (:func:`energy_prep_agent`, :func:`energy_features_agent`), the terms' weights ls, lb, lp, lo and
    the pair cotangents (gA, gB, gc) of the belief [0] and prior [1] features: the cotangents of x,
    log x, U, sigma and log sigma, then one Daleckii–Krein of log (x), one of exp (log sigma), the Gibbs
    map's (H, T) and rule R2 (phi).
    Scratch Xb, Lb, Ub, Sb, LSb, C, M, T1, T2, T3 (d, d) complex."""
    d = C.shape[0]
    for i in range(d):
        for j in range(d):
            Xb[i, j] = 0.0
            Lb[i, j] = 0.0
            Ub[i, j] = 0.0
            Sb[i, j] = 0.0
            LSb[i, j] = 0.0
    xn = x[n]
    if fs:  # D(x || sigma): d/dx = log x - log sigma, d/d(log sigma) = -x
        for i in range(d):
            for j in range(d):
                Xb[i, j] += ls * (logx[n, i, j] - logsig[n, i, j])
                LSb[i, j] -= ls * xn[i, j]
    if fo:
        yn = y[n]
        Xb[yn, yn] -= lo / xn[yn, yn].real
    if fb:
        pull_vjp_add(gA[0, n], gB[0, n], gc[0, n], lb, U[n], xn, logx[n], Xb, Lb, Ub, C, M, T1, T2)
    if fp:
        pull_vjp_add(gA[1, n], gB[1, n], gc[1, n], lp, U[n], sigma[n], logsig[n], Sb, LSb, Ub, C, M, T1, T2)
    if fs or fb:
        dk_log(s[n], W[n], Lb, T3, T1, T2)
        for i in range(d):
            for j in range(d):
                Xb[i, j] += T3[i, j]
    # rho: (1 - eps) traceless(herm(Xb))
    tr = _trace_re(Xb) / d
    for i in range(d):
        for j in range(d):
            g_rho[n, i, j] = (1.0 - eps) * (0.5 * (Xb[i, j] + Xb[j, i].conjugate()))
        g_rho[n, i, i] -= (1.0 - eps) * tr
    if fs or fp:  # M = log-sigma cotangent in total; H_bar = herm(-M + tr(M) sigma) / T
        dk_exp(l[n], p[n], V[n], Sb, T3, T1, T2)
        for i in range(d):
            for j in range(d):
                T3[i, j] += LSb[i, j]
        trM = _trace_re(T3)
        tn = T[n]
        for i in range(d):
            for j in range(d):
                a = -T3[i, j] + trM * sigma[n, i, j]
                b = -T3[j, i] + trM * sigma[n, j, i]
                g_H[n, i, j] = (0.5 * (a + b.conjugate())) / tn
        g_T[n] = (_tr_re(T3, H[n]) - trM * _tr_re(sigma[n], H[n])) / (tn * tn)
    else:
        for i in range(d):
            for j in range(d):
                g_H[n, i, j] = 0.0
        g_T[n] = 0.0
    if fb or fp:
        frames_vjp(Ub, k[n], Vf[n], J, g_phi[n], T1, T2, T3)
    else:
        for a in range(3):
            g_phi[n, a] = 0.0


def _push_diag(W, Dg, out):
    """out = W diag(Dg) W^dagger from the diagonal of Dg (Dg's off-diagonal entries are ignored)."""
    d = out.shape[0]
    for r in range(d):
        for c in range(d):
            acc = W.dtype.type(0)
            for k in range(d):
                acc += W[r, k] * Dg[k, k].real * W[c, k].conjugate()
            out[r, c] = acc


def _copy(X, out):
    d = X.shape[0]
    for r in range(d):
        for c in range(d):
            out[r, c] = X[r, c]


def _trace_re(X):
    acc = 0.0
    for r in range(X.shape[0]):
        acc += X[r, r].real
    return acc


def _tr_re(A, B):
    """Re tr(A B)."""
    d = A.shape[0]
    acc = 0.0
    for r in range(d):
        for c in range(d):
            z = A[r, c] * B[c, r]
            acc += z.real
    return acc


def sender_state_agent(rho, U, n, xt, T):
    """xt[n] = U_n^dagger rho_n U_n / tr rho_n: agent n's normalised state in its own frame, as every receiver
    reads it (the receiver's frame U_m then gives U_m U_n^dagger rho_n U_n U_m^dagger / tr rho_n)."""
    d = T.shape[0]
    tr = 0.0
    for r in range(d):
        tr += rho[n, r, r].real
    mm_dl(U[n], rho[n], T)
    for r in range(d):  # (T U_n) / tr, sized by the scratch (module docstring)
        for c in range(d):
            acc = T.dtype.type(0)
            for k in range(d):
                acc += T[r, k] * U[n, k, c]
            xt[n, r, c] = acc / tr


def _coupling(xt, index, mask, U, eps_c, n, coupling, tol2, X, S, T1, T2, W, w, xs, keep):
    """The coupling channels of agent n applied to X in window order (xt: the senders' states of
    :func:`sender_state_agent`). C1 in closed form: the channels X <- (1 - e_k) X + e_k tr(X) S_k keep tr X,
    so together X <- a X + tr(X) U_n Sig U_n^dagger with a = prod (1 - e_k) and Sig = sum_k c_k xt_{j_k},
    c_k = e_k prod_{m > k} (1 - e_m) (Sig left in S; one transform for the window). C2 per channel
    (S_k = U_n xt_j U_n^dagger, W its eigenbasis); with ``keep`` the state before channel k in xs[n, k]."""
    d = X.shape[0]
    if coupling == 1:
        t0 = _trace_re(X)
        a = 1.0
        for r in range(d):
            for c in range(d):
                S[r, c] = 0.0
        for k in range(index.shape[1]):
            if not mask[n, k]:
                continue
            e = eps_c[n, k]
            j = index[n, k]
            a = (1.0 - e) * a
            for r in range(d):
                for c in range(d):
                    S[r, c] = (1.0 - e) * S[r, c] + e * xt[j, r, c]
        push_forward(U[n], S, T1, T2)
        for r in range(d):
            for c in range(d):
                X[r, c] = a * X[r, c] + t0 * T2[r, c]
        return
    for k in range(index.shape[1]):
        if not mask[n, k]:
            continue
        if keep:
            for r in range(d):
                for c in range(d):
                    xs[n, k, r, c] = X[r, c]
        e = eps_c[n, k]
        push_forward(U[n], xt[index[n, k]], T1, S)
        # C2: x + e (pinch_W(x) - x), W the eigenbasis of s
        jacobi_eigh(S, w, W, tol2)
        pull_back(W, X, T1, T2)
        _push_diag(W, T2, T1)
        for r in range(d):
            for c in range(d):
                X[r, c] = X[r, c] + e * (T1[r, c] - X[r, c])


def _gate_divergence(X, V, l, n, floor, tol2, Xf, T1, S, W, w):
    """D(x_f || sigma) for the floored x_f = (1 - floor) herm(X) + floor I / d (left in Xf), with the
    eigen-decomposition x_f = W diag(w) W^dagger; returns (D, least eigenvalue)."""
    d = X.shape[0]
    floored(X, floor, Xf)
    pull_back(V[n], Xf, T1, S)  # tr(x_f log sigma) = sum_k l_k (V^dagger x_f V)_kk
    dv = 0.0
    for k in range(d):
        dv -= l[n, k] * S[k, k].real
    _copy(Xf, T1)
    jacobi_eigh(T1, w, W, tol2)
    least = w[0]
    for k in range(d):
        least = min(least, w[k])
        if w[k] > 0.0:
            dv += w[k] * math.log(w[k])
    return dv, least


def _propagator(lam, V, n, t, newton, Ut, T1, T2):
    """Ut = V diag(exp(-i lam t)) V^dagger, with one Newton-Schulz step when ``newton`` (complex64)."""
    d = Ut.shape[0]
    for r in range(d):
        for c in range(d):
            Ut[r, c] = 0.0
    for k in range(d):  # one phase per eigenvalue; each entry sums k = 0 .. d - 1 in the dtype's precision
        ph = -lam[n, k] * t
        z = Ut.dtype.type(complex(math.cos(ph), math.sin(ph)))
        for r in range(d):
            vz = V[n, r, k] * z
            for c in range(d):
                Ut[r, c] += vz * V[n, c, k].conjugate()
    if newton != 0:  # U <- U (3 I - U^dagger U) / 2
        mm_dl(Ut, Ut, T1)
        for r in range(d):
            for c in range(d):
                T1[r, c] = -0.5 * T1[r, c]
            T1[r, r] += 1.5
        mm(Ut, T1, T2)
        _copy(T2, Ut)


def _dephase(X, V, n, ed, energy, T1, T2):
    """X <- (1 - ed) X + ed Delta(X), Delta the pinching of the computational or (energy) V basis."""
    d = X.shape[0]
    if energy == 0:
        for r in range(d):
            for c in range(d):
                if r != c:
                    X[r, c] = X[r, c] - ed * X[r, c]
    else:
        pull_back(V[n], X, T1, T2)
        _push_diag(V[n], T2, T1)
        for r in range(d):
            for c in range(d):
                X[r, c] = X[r, c] + ed * (T1[r, c] - X[r, c])


def _forward(
    rho, xt, index, mask, U, eps_c, lam, V, l, n, modes, gate_thr, gate_width, dt, floor, tol2, ed, gmin,
    X, S, T1, T2, W, w, Ut, Y, xs, keep,
):  # fmt: skip
    """The step of agent n up to the dephasing (:func:`channel_step_agent`): X <- the state after the
    unitary, Y <- it dephased, Ut the unitary; with ``keep`` xs[n, k] the state before C2 coupling channel
    k and xs[n, -1] the state before the unitary. Returns (g, D) of the gate (D = 0 without a gate)."""
    d = X.shape[0]
    for r in range(d):
        for c in range(d):
            X[r, c] = rho[n, r, c]
    if modes[0] != 0:
        _coupling(xt, index, mask, U, eps_c, n, modes[0], tol2, X, S, T1, T2, W, w, xs, keep)
    g = 1.0
    dv = 0.0
    if modes[2] != 0:
        dv, least = _gate_divergence(X, V, l, n, floor, tol2, Y, T1, S, W, w)
        gmin[n] = least
        if modes[2] == 1:
            g = 0.5 * (1.0 + math.tanh(0.5 * (dv - gate_thr) / gate_width))
        else:
            g = 1.0 if dv > gate_thr else 0.0
    if keep:  # the state before the unitary, after the coupling (the tape's last slot)
        for r in range(d):
            for c in range(d):
                xs[n, xs.shape[1] - 1, r, c] = X[r, c]
    _propagator(lam, V, n, g * dt, modes[3], Ut, T1, T2)
    push_forward(Ut, X, T2, S)  # herm(U x U^dagger)
    for r in range(d):
        for c in range(d):
            X[r, c] = 0.5 * (S[r, c] + S[c, r].conjugate())
    _copy(X, Y)
    _dephase(Y, V, n, ed, modes[1], T1, T2)
    return g, dv


def channel_step_agent(
    rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, n, modes, gate_thr, gate_width, dt,
    floor, tol2, out, gmin, X, S, T1, T2, W, w, Ut, Y, xs,
):  # fmt: skip
    """One step of the density-matrix channels for agent n (vfesim.quantum.evolve, forward only):
    coupling over the window (C1 ``(1 - e) x + e tr(x) s`` or C2 ``x + e (pinch_W(x) - x)``, s the sender's
    normalised state in the receiver's frame U_n U_j^dagger rho_j U_j U_n^dagger / tr rho_j = U_n xt_j
    U_n^dagger with xt of :func:`sender_state_agent`, W its eigenbasis; C1 composed over the window, see
    :func:`_coupling`) -> gate g -> unitary ``herm(U_t x U_t^dagger)``, U_t = V diag(exp(-i lam t))
    V^dagger, t = g dt (one Newton-Schulz step in complex64) -> dephasing (off-diagonals of the
    computational or energy basis scaled by 1 - eps_d) -> thermalising ``(1 - eps_t) z + eps_t tr(z) sigma``.
    modes = (coupling 0 none / 1 C1 / 2 C2, dephasing basis 0 computational / 1 energy, gate 0 none / 1
    soft / 2 hard, Newton-Schulz 1 for complex64 else 0). The gate's D(x || sigma) uses the floored x;
    gmin[n] receives its least eigenvalue (the caller refuses a step where it is <= 0, as the array code
    does). Scratch X, S, T1, T2, W, Ut, Y (d, d), w (d,); xs any 4-D array (unused: no tape)."""
    d = X.shape[0]
    _forward(
        rho, xt, index, mask, U, eps_c, lam, V, l, n, modes, gate_thr, gate_width, dt, floor, tol2, eps_d[n],
        gmin, X, S, T1, T2, W, w, Ut, Y, xs, False,
    )  # fmt: skip
    et = eps_t[n]
    trz = _trace_re(Y)
    for r in range(d):
        for c in range(d):
            out[n, r, c] = (1.0 - et) * Y[r, c] + et * trz * sigma[n, r, c]


def _coupling_c1_vjp(rho, xt, index, mask, U, eps_c, n, B, Bt, U_bar, sw, X0, S, T1, T2):
    """Reverse of the closed-form C1 window of :func:`_coupling` for agent n: B (in: the cotangent of the
    coupled state X_w = a X_0 + t0 U_n Sig U_n^dagger; out: that of X_0). The channels' reverse
    recursion B_{k-1} = (1 - e_k) B_k + e_k Re tr(B_k S_k) I keeps B_k = p_k B + nu_k I, so every slot
    needs only scalars: q_k = Re tr(B S_k) = Re tr(Bt xt_k) (Bt = U_n^dagger B U_n) and the forward partial
    traces r_k = Re tr(B X_k) (r_k = (1 - e_k) r_{k-1} + e_k t0 q_k); then eps_bar_k = p_k (t0 q_k - r_{k-1})
    and xt_k's cotangent t0 e_k p_k Bt (its identity part nu_k I drops out: the sender's normalisation
    removes it). Writes s_out[n, k] = sw[0, n, k]; adds eps_bar_k into sw[1, n, k] and 2 t0 B U_n Sig into
    U_bar[n]. Scratch X0, S, T1, T2 and sw[2] (pass 1 keeps q_k in s_out, r_{k-1} there)."""
    s_out, eps_c_bar, r_prev = sw[0], sw[1], sw[2]
    d = B.shape[0]
    wn = index.shape[1]
    for r in range(d):
        for c in range(d):
            X0[r, c] = rho[n, r, c]
    t0 = _trace_re(X0)
    rk = _tr_re(B, X0)
    pull_back(U[n], B, T1, T2)
    for r in range(d):
        for c in range(d):
            Bt[n, r, c] = T2[r, c]
            S[r, c] = 0.0
    for k in range(wn):  # forward: q_k, r_{k-1}; Sig in S
        if not mask[n, k]:
            continue
        e = eps_c[n, k]
        j = index[n, k]
        q = _tr_re(T2, xt[j])
        r_prev[n, k] = rk
        s_out[n, k] = q
        rk = (1.0 - e) * rk + e * t0 * q
        for r in range(d):
            for c in range(d):
                S[r, c] = (1.0 - e) * S[r, c] + e * xt[j, r, c]
    mm(B, U[n], T1)
    mm(T1, S, T2)
    for r in range(d):
        for c in range(d):
            U_bar[n, r, c] += 2.0 * t0 * T2[r, c]
    p = 1.0
    nu = 0.0
    for kk in range(wn):  # reverse
        k = wn - 1 - kk
        if not mask[n, k]:
            continue
        e = eps_c[n, k]
        q = s_out[n, k]
        eps_c_bar[n, k] += p * (t0 * q - r_prev[n, k])
        s_out[n, k] = t0 * e * p
        nu = (1.0 - e) * nu + e * (p * q + nu)
        p = (1.0 - e) * p
    for r in range(d):
        for c in range(d):
            B[r, c] = p * B[r, c]
        B[r, r] += nu


def incoming_agent(rho, U, slots, s, Bt, n, x_bar, U_bar, Y, T):
    """The C1 senders' part of agent n's cotangents after :func:`channel_step_vjp_agent` (every receiver
    done): Y = sum over the slots (i, k) that read n (``slots[n]``: flat i w + k, receiver then slot order,
    padded with N w at the end) of s[i, k] Bt[i], the cotangent of xt_n = U_n^dagger Rn U_n (Rn = rho_n /
    tr rho_n); then Rn_bar = U_n Y U_n^dagger, x_bar[n] += (Rn_bar - Re tr(Rn_bar Rn) I) / tr rho_n and
    U_bar[n] += 2 Rn U_n Y. Deterministic: a fixed order, no atomics. Two scratch matrices, Y and T = U_n Y:
    the entries of Rn_bar and of rho_n T are formed where they are used (a GPU thread keeps two matrices,
    not four, in registers)."""
    d = Y.shape[0]
    wn = s.shape[1]
    end = s.shape[0] * wn
    for r in range(d):
        for c in range(d):
            Y[r, c] = 0.0
    used = 0
    for m in range(slots.shape[1]):
        f = slots[n, m]
        if f >= end:
            break
        i = f // wn
        sc = s[i, f - i * wn]
        for r in range(d):
            for c in range(d):
                Y[r, c] += sc * Bt[i, r, c]
        used += 1
    if used == 0:
        return
    tr = _trace_re(rho[n])
    mm(U[n], Y, T)  # T = U Y; Rn_bar[r, c] = (T U^dagger)[r, c]
    cn = 0.0  # Re tr(Rn_bar rho_n)
    for r in range(d):
        for c in range(d):
            v = T.dtype.type(0)
            for k in range(d):
                v += T[r, k] * U[n, c, k].conjugate()
            z = v * rho[n, c, r]
            cn += z.real
    cn = cn / tr
    for r in range(d):
        for c in range(d):
            v = T.dtype.type(0)
            for k in range(d):
                v += T[r, k] * U[n, c, k].conjugate()
            if r == c:
                v -= cn
            x_bar[n, r, c] += v / tr
    for r in range(d):  # U_bar += 2 rho_n T / tr
        for c in range(d):
            v = T.dtype.type(0)
            for k in range(d):
                v += rho[n, r, k] * T[k, c]
            U_bar[n, r, c] += 2.0 * v / tr


def channel_step_vjp_agent(
    rho, xt, index, mask, U, eps_c, lam, V, sigma, l, eps_d, eps_t, gam, n, modes, prm, ob, xs, mats, accm,
    sw, racc, scal, gmin, flag, Tm, w,
):  # fmt: skip
    """Adjoint of :func:`channel_step_agent` for agent n (rules R1, R3, R4 and the gate; the array code's
    ``vfesim.quantum.rollout._update_vjp``), recomputing the forward step (for C2 the states before each
    coupling channel, and the state before the unitary, kept in xs[n] (.., d, d), last slot the latter).
    From the cotangent ob[n] of the new state it writes mats[:, n] = (x_bar (the state's own), Bt),
    s_out[n, k] = sw[0, n, k] and scal[n] = (eps_d_bar, eps_t_bar, t_bar g, D_bar, D, dt_bar part), and
    adds the parameters' cotangents into the accumulators accm[:, n] = (H_bar (through the unitary and the
    energy-basis dephasing), sigma_bar, logsig_bar (through the gate), U_bar), eps_c_bar[n, k] = sw[1, n,
    k], racc[:, n] = (rate_bar of the dephasing, of the thermalising: eps_bar dt (1 - eps)); gam (2, N) the
    two rates (the dt_bar part: t_bar g + sum over both of eps_bar rate (1 - eps)); gmin[n] as in the
    forward step. C1 senders: the cotangent of xt_j through slot k is s_out[n, k] Bt[n] (Bt = U_n^dagger B
    U_n, B the cotangent of the coupled state): :func:`incoming_agent` adds it to sender j. U_bar[n]: the
    receiver part of U_n's cotangent (dL = Re tr(U_bar^dagger dU)). C2 keeps the senders fixed
    (stop-gradient): Bt and s_out are zero and U_bar gets nothing. sw[2]: scratch. flag[n]: 1 when the
    energy-basis dephasing meets a degenerate spectrum (gap below gap_tol, max(1, |lam|) relative), 2 when
    the gate's floored state is not positive. prm = (gate_threshold, gate_width, dt, floor, tol2, gap_tol)
    (float64); scratch Tm (9, d, d), w (d,). (Few arguments: CPython passes a call with more than 30 as
    *args, which numba.cuda cannot inline.)"""
    X, S, T1, T2, W, Ut, Y, B, C = Tm[0], Tm[1], Tm[2], Tm[3], Tm[4], Tm[5], Tm[6], Tm[7], Tm[8]
    x_bar, Bt = mats[0], mats[1]
    H_bar, sigma_bar, logsig_bar, U_bar = accm[0], accm[1], accm[2], accm[3]
    s_out, eps_c_bar = sw[0], sw[1]
    gate_thr, gate_width, dt, floor, tol2, gap_tol = prm[0], prm[1], prm[2], prm[3], prm[4], prm[5]
    d = X.shape[0]
    wn = index.shape[1]
    ed = eps_d[n]
    et = eps_t[n]
    last = xs.shape[1] - 1
    g, dv = _forward(
        rho, xt, index, mask, U, eps_c, lam, V, l, n, modes, gate_thr, gate_width, dt, floor, tol2, ed,
        gmin, X, S, T1, T2, W, w, Ut, Y, xs, True,
    )  # fmt: skip
    # X = y (after the unitary), Y = z (dephased), Ut the unitary, xs[n, last] the state before it.
    # Thermalising: out = (1 - et) z + et tr(z) sigma.
    for r in range(d):
        for c in range(d):
            B[r, c] = ob[n, r, c]
    trz = _trace_re(Y)
    ts = _tr_re(B, sigma[n])
    et_bar = 0.0
    for r in range(d):
        for c in range(d):
            sigma_bar[n, r, c] += et * trz * B[r, c]
            z = B[r, c] * (trz * sigma[n, c, r] - Y[c, r])
            et_bar += z.real
    for r in range(d):
        for c in range(d):
            B[r, c] = (1.0 - et) * B[r, c]
        B[r, r] += et * ts
    # B = z_bar. Dephasing (self-adjoint): y_bar = D(z_bar); eps_d_bar = Re tr(z_bar (Delta(y) - y)).
    _copy(X, C)
    _dephase(C, V, n, 1.0, modes[1], T1, T2)  # C = Delta(y)
    ed_bar = 0.0
    for r in range(d):
        for c in range(d):
            z = B[r, c] * (C[c, r] - X[c, r])
            ed_bar += z.real
    # H through the energy basis: Q = [D, Pb] + [diag Pb, r], Hh_lk = Q_lk / (lam_l - lam_k)
    if modes[1] == 1:
        pull_back(V[n], X, T1, C)  # C = r = V^dagger y V
        for r in range(d):
            for c in range(d):
                T2[r, c] = ed * B[r, c]
        pull_back(V[n], T2, T1, S)  # S = Pb
        scale = 1.0
        for k in range(d):
            scale = max(scale, abs(lam[n, k]))
        for r in range(d):
            for c in range(d):
                if r == c:
                    T1[r, c] = 0.0
                    continue
                gap = lam[n, r] - lam[n, c]
                if abs(gap) < gap_tol * scale:
                    flag[n] = 1
                    gap = 1.0
                q = (C[r, r] * S[r, c] - S[r, c] * C[c, c]) + (S[r, r] * C[r, c] - C[r, c] * S[c, c])
                T1[r, c] = q / gap
        push_forward(V[n], T1, T2, S)
        for r in range(d):
            for c in range(d):
                H_bar[n, r, c] += 0.5 * (S[r, c] + S[c, r].conjugate())
    _dephase(B, V, n, ed, modes[1], T1, T2)  # B = y_bar
    # Unitary (R1) in H's eigenbasis, U_t = V E V^dagger with E = diag(e_k), e_k = exp(-i lam_k t) (kept in
    # Ut's first row; the matrix U_t is not needed back): bv = V^dagger y_bar V, xv = V^dagger x V (x the
    # state before the unitary), Y^ = V^dagger x U^dagger y_bar V = xv E^* bv; H_bar += herm(V (2 t Y^ o
    # f1^T) V^dagger), f1 = dd_expi(lam t); t_bar = Re tr(H i [y_bar, y]) = -Im sum_k lam_k [bv, yv]_kk with
    # yv = V^dagger y V = E xv E^*; x_bar = herm(U^dagger y_bar U) = herm(V (E^* bv E) V^dagger). Three live
    # matrices (bv, xv, Y^) instead of five with U_t (a GPU thread's registers).
    t = g * dt
    for k in range(d):
        ph = -lam[n, k] * t
        Ut[0, k] = Ut.dtype.type(complex(math.cos(ph), math.sin(ph)))
    pull_back(V[n], B, T1, C)  # C = bv
    pull_back(V[n], xs[n, last], T1, X)  # X = xv (y is not needed any more)
    t_bar = 0.0
    for k in range(d):  # -Im sum_k lam_k sum_m (bv_km e_m xv_mk conj(e_k) - e_k xv_km conj(e_m) bv_mk)
        z = C.dtype.type(0)
        for m in range(d):
            z += C[k, m] * Ut[0, m] * X[m, k] * Ut[0, k].conjugate()
            z -= Ut[0, k] * X[k, m] * Ut[0, m].conjugate() * C[m, k]
        t_bar -= lam[n, k] * z.imag
    for r in range(d):
        for c in range(d):
            v = C.dtype.type(0)
            for k in range(d):
                v += X[r, k] * Ut[0, k].conjugate() * C[k, c]
            f = dd_expi_conj(lam[n, c] * t, lam[n, r] * t, lam.dtype.type).conjugate()
            S[r, c] = 2.0 * t * v * f
    push_forward(V[n], S, T1, T2)
    for r in range(d):
        for c in range(d):
            H_bar[n, r, c] += 0.5 * (T2[r, c] + T2[c, r].conjugate())
    for r in range(d):
        for c in range(d):
            C[r, c] = Ut[0, r].conjugate() * C[r, c] * Ut[0, c]
    push_forward(V[n], C, T1, T2)
    for r in range(d):
        for c in range(d):
            B[r, c] = 0.5 * (T2[r, c] + T2[c, r].conjugate())  # B = x_bar (before the unitary)
    D_bar = 0.0
    if modes[2] == 1:  # soft gate: D_bar = t_bar dt g (1 - g) / tau
        D_bar = t_bar * dt * g * (1.0 - g) / gate_width
        for r in range(d):
            for c in range(d):
                C[r, c] = xs[n, last, r, c]  # x before the unitary
        _, least = _gate_divergence(C, V, l, n, floor, tol2, Y, T1, S, W, w)  # Y = x_f, W diag(w) W^dagger
        if least <= 0.0:
            flag[n] = 2
        for k in range(d):
            w[k] = math.log(w[k]) if w[k] > 0.0 else 0.0
        from_eig(W, w, T1)  # log x_f
        for k in range(d):
            w[k] = l[n, k]
        from_eig(V[n], w, T2)  # log sigma
        for r in range(d):
            for c in range(d):
                v = T1[r, c] - T2[r, c]
                if r == c:
                    v += 1.0
                B[r, c] += (1.0 - floor) * D_bar * v
                logsig_bar[n, r, c] += -D_bar * Y[r, c]
    # Coupling channels in reverse.
    for r in range(d):
        for c in range(d):
            Bt[n, r, c] = 0.0
    for k in range(wn):
        s_out[n, k] = 0.0
    if modes[0] == 1:
        _coupling_c1_vjp(rho, xt, index, mask, U, eps_c, n, B, Bt, U_bar, sw, X, S, T1, T2)
    elif modes[0] == 2:  # W stop-gradient: x_bar <- pinch_mix(x_bar); eps_bar = Re tr(x_bar (pinch(x) - x))
        for kk in range(wn):
            k = wn - 1 - kk
            if not mask[n, k]:
                continue
            e = eps_c[n, k]
            push_forward(U[n], xt[index[n, k]], T1, S)  # S = s_k
            for r in range(d):
                for c in range(d):
                    C[r, c] = xs[n, k, r, c]  # the state before channel k
            jacobi_eigh(S, w, W, tol2)
            pull_back(W, C, T1, T2)
            _push_diag(W, T2, T1)  # T1 = pinch(x)
            eb = 0.0
            for r in range(d):
                for c in range(d):
                    z = B[r, c] * (T1[c, r] - C[c, r])
                    eb += z.real
            eps_c_bar[n, k] += eb
            pull_back(W, B, T1, T2)
            _push_diag(W, T2, T1)
            for r in range(d):
                for c in range(d):
                    B[r, c] = B[r, c] + e * (T1[r, c] - B[r, c])
    for r in range(d):
        for c in range(d):
            x_bar[n, r, c] = B[r, c]
    scal[n, 0] = ed_bar
    scal[n, 1] = et_bar
    scal[n, 2] = t_bar * g
    scal[n, 3] = D_bar
    scal[n, 4] = dv
    racc[0, n] += ed_bar * dt * (1.0 - ed)
    racc[1, n] += et_bar * dt * (1.0 - et)
    scal[n, 5] = t_bar * g + ed_bar * gam[0, n] * (1.0 - ed) + et_bar * gam[1, n] * (1.0 - et)


# In dependency order (callees first): :func:`link` compiles them in this order.
FUNCTIONS = (
    "jacobi_rotation",
    "jacobi_eigh",
    "load_herm",
    "eigh_agent",
    "born_logp_entry",
    "born_add_entry",
    "floored",
    "from_eig",
    "mm",
    "mm_add",
    "mm_dl",
    "mm_dr",
    "pull_back",
    "push_forward",
    "hvec_store",
    "hmat_load",
    "dd_log",
    "dd_exp",
    "dd_expi_conj",
    "eig_log_agent",
    "log_from_eig",
    "gibbs_agent",
    "gibbs_from_eig",
    "frames_agent",
    "generator",
    "frames_from_eig",
    "_push_diag",
    "_copy",
    "_trace_re",
    "_tr_re",
    "pull_features",
    "pull_vjp_add",
    "dk_log",
    "dk_exp",
    "frames_vjp",
    "energy_prep_agent",
    "energy_mats_agent",
    "_eig_copy",
    "energy_finish_agent",
    "energy_features_agent",
    "energy_backward_agent",
    "sender_state_agent",
    "_coupling",
    "_gate_divergence",
    "_propagator",
    "_dephase",
    "_forward",
    "channel_step_agent",
    "_coupling_c1_vjp",
    "incoming_agent",
    "channel_step_vjp_agent",
)


def link(jit, suffix: str):
    """Compile every function of :data:`FUNCTIONS` with ``jit`` (a decorator), each seeing the compiled
    versions of the others under their names. ``suffix`` names the copies (numba keys caches and inlining
    by qualified name). Returns a namespace of compiled functions."""
    compiled = {}
    g = dict(globals())
    for name in FUNCTIONS:
        f = globals()[name]
        copy = types.FunctionType(f.__code__, g, f"{name}_{suffix}", f.__defaults__, f.__closure__)
        copy.__qualname__ = f"{f.__qualname__}_{suffix}"
        copy.__doc__ = f.__doc__
        compiled[name] = jit(copy)
        g[name] = compiled[name]
    return types.SimpleNamespace(**compiled)
