"""Slow, obviously-correct per-pair loop oracle for the density-matrix free energy (complex128 only).

Model (issue 10; spec/quantum.md §1.3, §2.1, §2.3), for N agents of Hilbert dimension d::

    U_i     = expm(-1j * sum_a phi[i, a] J_a)            (J: frame_generators(d))
    sigma_i = expm(-H_i / T_i) / tr expm(-H_i / T_i)      (Gibbs prior; log sigma_i = -H_i/T_i - log Z_i)
    x~_i    = U_i^dagger x_i U_i                           (pulled-back state)
    D(r||s) = tr r (logm r - logm s)                       (Umegaki; scipy.linalg.logm, or log="eigh")

    "self"         = lambda_self   * sum_i D(rho_i || sigma_i)
    "belief_align" = lambda_belief * sum_i A_{kappa_beta}({D(rho~_i || rho~_j)}_{j in N(i)})
    "prior_align"  = lambda_prior  * sum_i A_{kappa_gamma}({D(sigma~_i || sigma~_j)}_{j in N(i)})
    "observation"  = lambda_obs    * sum_i -log <y_i| rho_i |y_i>
    "total"        = sum of the four

Every term is returned **already multiplied by its lambda** (as tests/reference/loop.py and the Gaussian
``energy_and_gradient`` do); a term whose lambda is 0 is 0.0.

Aggregators over one receiver's divergences D_j (j in N(i)): "softmin" A = -kappa log sum_j exp(-D_j/kappa);
"expected" A = sum_j beta_j D_j with beta = softmax_j(-D_j/kappa). A receiver with no neighbour adds 0.

Depolarising floor (spec §2.3), the convention of this oracle: every **belief** rho_i is replaced by
``rho_eps = (1 - eps) rho + eps I/d`` (eps = 1e-12) before it enters any divergence, as either argument,
so the self and belief-alignment terms are the model evaluated at rho_eps (both the weight and the log in
``tr rho (log rho - log s)`` use rho_eps). The Born term uses rho itself (no floor). Gibbs priors are full
rank and never floored. With eps = 1e-12 the floor changes full-rank results by O(1e-12), below every
tolerance used against the implementation; it matters only for rank-deficient rho (results stay finite).

Naive on purpose: Python loops over agents and over pairs (i, j), two matrix logs per pair, the transport
``U_ij = U_i U_j^dagger`` formed explicitly (``transport="direct"``: D(rho_i || U_ij rho_j U_ij^dagger)),
or the pull-back of both sides (``transport="pullback"``, the default: D(rho~_i || rho~_j)); the two must
agree. No vectorisation, no Bregman/GEMM form, no shared code with vfesim: the frame generators are built
here (the odd-d tesseral basis follows tests/reference/loop.py and is checked against
``vfesim.groups.generators`` in tests/test_quantum_oracle.py). Matrix logs are scipy.linalg.logm by
default; ``log="eigh"`` takes the spectral log instead (equal to ~1e-13, ~100x faster than scipy's
pure-Python logm; used for finite-difference sweeps). Cost O(N^2 d^3) in Python: keep N small (<= 10).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg

__all__ = [
    "EPS",
    "spin_generators",
    "tesseral_unitary",
    "frame_generators",
    "frame",
    "gibbs",
    "log_partition",
    "log_gibbs",
    "floor",
    "matrix_log",
    "rel_entropy",
    "aggregate",
    "neighbour_lists",
    "pair_divergences",
    "energy_terms",
    "reference_energy",
    "state_arrays",
    "oracle_config",
    "fd_gradient",
    "random_hermitian",
    "random_traceless_hermitian",
    "unit_vector",
]

EPS = 1e-12  # depolarising floor for complex128 (spec §2.3)


# --------------------------------------------------------------------------------------------- generators


def spin_generators(d: int) -> np.ndarray:
    """Spin-j generators (J_x, J_y, J_z) as (3, d, d) complex128, j = (d - 1)/2, basis m = j, j-1, ..., -j.

    J_z = diag(j, ..., -j); J_+ |m> = sqrt(j(j+1) - m(m+1)) |m+1>;
    J_x = (J_+ + J_-)/2, J_y = (J_+ - J_-)/(2i).
    """
    if d < 2:
        raise ValueError(f"d must be >= 2, got {d}")
    j = (d - 1) / 2
    m = [j - k for k in range(d)]  # row k holds |m_k>
    Jz = np.zeros((d, d), complex)
    Jp = np.zeros((d, d), complex)
    for k in range(d):
        Jz[k, k] = m[k]
    for k in range(1, d):  # |m_k> -> |m_k + 1> = |m_{k-1}>
        Jp[k - 1, k] = math.sqrt(j * (j + 1) - m[k] * (m[k] + 1))
    Jm = Jp.conj().T
    Jx = (Jp + Jm) / 2
    Jy = (Jp - Jm) / (2j)
    return np.stack([Jx, Jy, Jz])


def tesseral_unitary(d: int) -> np.ndarray:
    """Odd d = 2l+1: unitary S (d, d) from the m = l..-l basis of spin_generators to the real tesseral order
    (m=0, cos 1, sin 1, cos 2, sin 2, ...) of tests/reference/loop.py and vfesim.groups."""
    if d % 2 != 1:
        raise ValueError(f"the tesseral basis needs odd d, got {d}")
    l = (d - 1) // 2

    def e(m: int) -> np.ndarray:  # |m> in the basis m = l..-l
        v = np.zeros(d, complex)
        v[l - m] = 1.0
        return v

    S = np.zeros((d, d), complex)
    S[0] = e(0)
    for m in range(1, l + 1):
        sign = (-1) ** m
        S[2 * m - 1] = (e(m) + sign * e(-m)) / math.sqrt(2)
        S[2 * m] = (-1j * e(m) + 1j * sign * e(-m)) / math.sqrt(2)
    return S


def frame_generators(d: int) -> np.ndarray:
    """Hermitian J (3, d, d) used for the frames U_i = expm(-1j phi_i . J).

    Even d: spin_generators(d). Odd d: S J S^dagger (S = tesseral_unitary), which is 1j times the real
    antisymmetric so(3) generators of the Gaussian side, so that U_i equals the Gaussian R_i (real
    orthogonal).
    """
    J = spin_generators(d)
    if d % 2 == 0:
        return J
    S = tesseral_unitary(d)
    return np.stack([S @ J[a] @ S.conj().T for a in range(3)])


def frame(phi_i: np.ndarray, J: np.ndarray) -> np.ndarray:
    """U = scipy expm(-1j (phi_x J_x + phi_y J_y + phi_z J_z)), (d, d) complex128."""
    X = phi_i[0] * J[0] + phi_i[1] * J[1] + phi_i[2] * J[2]
    return scipy.linalg.expm(-1j * X)


# ----------------------------------------------------------------------------------------------- states


def gibbs(H: np.ndarray, T: float) -> np.ndarray:
    """sigma = expm(-H/T) / tr expm(-H/T)."""
    E = scipy.linalg.expm(-H / T)
    return E / np.trace(E)


def log_partition(H: np.ndarray, T: float) -> float:
    """log Z = log tr expm(-H/T)."""
    return float(math.log(np.trace(scipy.linalg.expm(-H / T)).real))


def log_gibbs(H: np.ndarray, T: float) -> np.ndarray:
    """log sigma = -H/T - log Z I, the exact log of the Gibbs state (no numerical matrix log: a matrix log
    of expm(-H/T)/Z loses relative precision on small eigenvalues of sigma, which makes finite differences in
    H and T noisy at h = 1e-6; tests/test_quantum_oracle.py checks it against logm(gibbs(H, T)))."""
    return -H / T - log_partition(H, T) * np.eye(H.shape[0])


def floor(rho: np.ndarray, eps: float = EPS) -> np.ndarray:
    """The depolarising floor rho_eps = (1 - eps) rho + eps I/d."""
    d = rho.shape[0]
    return (1.0 - eps) * rho + eps * np.eye(d) / d


def matrix_log(X: np.ndarray, log: str = "logm") -> np.ndarray:
    """log X of a Hermitian positive-definite X: log="logm" scipy.linalg.logm (the literal definition);
    log="eigh" the spectral form V diag(log w) V^dagger from numpy.linalg.eigh (same value to ~1e-13,
    ~100x faster than scipy 1.17's pure-Python logm: used to keep finite-difference sweeps fast)."""
    if log == "logm":
        return scipy.linalg.logm(X)
    if log == "eigh":
        w, V = np.linalg.eigh(X)
        assert w.min() > 0, w
        return (V * np.log(w)) @ V.conj().T
    raise ValueError(f"unknown log {log!r}")


def rel_entropy(r: np.ndarray, s: np.ndarray, log: str = "logm", log_r=None, log_s=None) -> float:
    """Umegaki D(r||s) = tr r (log r - log s) (no floor here; callers floor). log: see matrix_log;
    log_r, log_s: the logs when known exactly (Gibbs states), else matrix_log of r, s."""
    if log_r is None:
        log_r = matrix_log(r, log)
    if log_s is None:
        log_s = matrix_log(s, log)
    val = np.trace(r @ (log_r - log_s))
    assert abs(val.imag) < 1e-9 * max(1.0, abs(val.real)), val
    return float(val.real)


# ------------------------------------------------------------------------------------------- aggregation


def _softmax_neg(D: np.ndarray, kappa: float) -> np.ndarray:
    """beta_j = exp(-D_j/kappa) / sum_k exp(-D_k/kappa) (shifted by the min)."""
    w = np.exp(-(D - D.min()) / kappa)
    return w / w.sum()


def aggregate(D, kappa: float, aggregator: str) -> float:
    """A_kappa of one receiver's divergences; 0 when there are none."""
    D = np.asarray(D, dtype=np.float64)
    if D.size == 0:
        return 0.0
    if aggregator == "softmin":
        m = D.min()
        return float(m - kappa * math.log(np.sum(np.exp(-(D - m) / kappa))))
    if aggregator == "expected":
        return float(np.sum(_softmax_neg(D, kappa) * D))
    raise ValueError(f"unknown aggregator {aggregator!r}")


def _get(cfg, name: str):
    return cfg[name] if isinstance(cfg, dict) else getattr(cfg, name)


def neighbour_lists(neighbours, n: int) -> list[list[int]]:
    """N(i) per receiver. neighbours: None or "dense" (all j != i), an (index, mask) pair of (n, k) arrays,
    or an object with .index/.mask (e.g. vfesim.SparseNeighbours); masked-out slots are ignored."""
    if neighbours is None or (isinstance(neighbours, str) and neighbours == "dense"):
        return [[j for j in range(n) if j != i] for i in range(n)]
    if isinstance(neighbours, tuple):
        index, mask = neighbours
    else:
        index, mask = neighbours.index, neighbours.mask
    index = np.asarray(index)
    mask = np.ones(index.shape, bool) if mask is None else np.asarray(mask)
    assert index.shape[0] == n and mask.shape == index.shape
    out = []
    for i in range(n):
        row = [int(index[i, k]) for k in range(index.shape[1]) if mask[i, k]]
        assert i not in row and len(set(row)) == len(row), (i, row)
        out.append(row)
    return out


def pair_divergences(
    X: np.ndarray, U: np.ndarray, nbrs, transport: str = "pullback", log: str = "logm", logs=None
) -> list[np.ndarray]:
    """Per receiver i, the array of D(x~_i || x~_j) over j in N(i) (states X already floored if beliefs).

    transport="pullback": x~ = U^dagger x U on both sides; "direct": D(x_i || U_ij x_j U_ij^dagger) with
    U_ij = U_i U_j^dagger. Computed pair by pair: the logs of both (pulled-back / transported) states by
    matrix_log, unless ``logs`` (exact log x_k per agent, e.g. log_gibbs) is given: then those logs are
    pulled back / transported the same way as the states (log(V x V^dagger) = V log(x) V^dagger).
    """
    out = []
    for i, row in enumerate(nbrs):
        Ds = []
        for j in row:
            if transport == "pullback":
                xi = U[i].conj().T @ X[i] @ U[i]
                xj = U[j].conj().T @ X[j] @ U[j]
                li = None if logs is None else U[i].conj().T @ logs[i] @ U[i]
                lj = None if logs is None else U[j].conj().T @ logs[j] @ U[j]
                Ds.append(rel_entropy(xi, xj, log, li, lj))
            elif transport == "direct":
                Uij = U[i] @ U[j].conj().T
                li = None if logs is None else logs[i]
                lj = None if logs is None else Uij @ logs[j] @ Uij.conj().T
                Ds.append(rel_entropy(X[i], Uij @ X[j] @ Uij.conj().T, log, li, lj))
            else:
                raise ValueError(f"unknown transport {transport!r}")
        out.append(np.array(Ds, dtype=np.float64))
    return out


# ------------------------------------------------------------------------------------------------ energy


def energy_terms(
    rho,
    H,
    T,
    phi,
    outcome,
    cfg,
    *,
    U=None,
    eps: float = EPS,
    transport: str = "pullback",
    log: str = "logm",
    gibbs_log: str = "exact",
) -> dict:
    """Every term of F, each multiplied by its lambda, and "total" (Python floats).

    rho, H: (N, d, d) complex Hermitian; T: (N,) > 0; phi: (N, 3); outcome: (N,) ints in [0, d) or None
    (needed only when lambda_obs != 0). cfg: dict or object with d, lambda_self, lambda_belief, lambda_prior,
    lambda_obs, kappa_beta, kappa_gamma, aggregator ("softmin" | "expected") and neighbours (None/"dense",
    an (index, mask) pair, or an object with .index/.mask).
    U: optional (N, d, d) unitary frames used instead of expm(-1j phi_i . J) (phi is then ignored): lets the
    gauge-covariance test apply U_i -> W_i U_i. eps: the depolarising floor applied to every belief rho in
    the divergences (the Born term uses rho itself). transport: "pullback" or "direct" (see pair_divergences).
    log: "logm" (scipy.linalg.logm, default) or "eigh" (spectral log; see matrix_log) for the logs of
    beliefs. gibbs_log: "exact" (default) takes log sigma_i = -H_i/T_i - log Z_i I (log_gibbs), the
    receiver's log of a prior pair included; "matrix" takes matrix_log of the Gibbs matrices like beliefs.
    """
    rho = np.asarray(rho, dtype=np.complex128)
    H = np.asarray(H, dtype=np.complex128)
    T = np.asarray(T, dtype=np.float64)
    n, d, _ = rho.shape
    assert d == int(_get(cfg, "d")), (d, _get(cfg, "d"))
    if U is None:
        J = frame_generators(d)
        phi = np.asarray(phi, dtype=np.float64)
        U = np.stack([frame(phi[i], J) for i in range(n)])
    else:
        U = np.asarray(U, dtype=np.complex128)
    nbrs = neighbour_lists(_get(cfg, "neighbours"), n)
    aggregator = _get(cfg, "aggregator")
    lam = {k: float(_get(cfg, "lambda_" + k)) for k in ("self", "belief", "prior", "obs")}

    rho_eps = np.stack([floor(rho[i], eps) for i in range(n)])
    sigma = np.stack([gibbs(H[i], T[i]) for i in range(n)])
    if gibbs_log == "exact":
        log_sigma = np.stack([log_gibbs(H[i], T[i]) for i in range(n)])
    elif gibbs_log == "matrix":
        log_sigma = np.stack([matrix_log(sigma[i], log) for i in range(n)])
    else:
        raise ValueError(f"unknown gibbs_log {gibbs_log!r}")

    self_term = 0.0
    if lam["self"] != 0.0:
        self_term = sum(rel_entropy(rho_eps[i], sigma[i], log, log_s=log_sigma[i]) for i in range(n))

    belief = 0.0
    if lam["belief"] != 0.0:
        Ds = pair_divergences(rho_eps, U, nbrs, transport, log)
        belief = sum(aggregate(Ds[i], float(_get(cfg, "kappa_beta")), aggregator) for i in range(n))

    prior = 0.0
    if lam["prior"] != 0.0:
        Ds = pair_divergences(sigma, U, nbrs, transport, log, logs=log_sigma)
        prior = sum(aggregate(Ds[i], float(_get(cfg, "kappa_gamma")), aggregator) for i in range(n))

    obs = 0.0
    if lam["obs"] != 0.0:
        for i in range(n):
            y = int(outcome[i])
            e_y = np.zeros(d, complex)
            e_y[y] = 1.0
            p = (e_y.conj() @ rho[i] @ e_y).real
            obs += -math.log(p)

    terms = {
        "self": lam["self"] * float(self_term),
        "belief_align": lam["belief"] * float(belief),
        "prior_align": lam["prior"] * float(prior),
        "observation": lam["obs"] * float(obs),
    }
    terms["total"] = terms["self"] + terms["belief_align"] + terms["prior_align"] + terms["observation"]
    return terms


def oracle_config(qcfg) -> dict:
    """A plain-dict oracle config from any object with the QuantumConfig field names."""
    keys = ("d", "lambda_self", "lambda_belief", "lambda_prior", "lambda_obs", "kappa_beta", "kappa_gamma")
    cfg = {k: getattr(qcfg, k) for k in keys}
    cfg["aggregator"] = qcfg.aggregator
    nb = qcfg.neighbours
    cfg["neighbours"] = None if isinstance(nb, str) else (np.asarray(nb.index), np.asarray(nb.mask))
    return cfg


def state_arrays(state) -> dict:
    """Host complex128/float64 copies of rho, hamiltonian, temperature, phi (and outcome if present) of a
    state Dataset (or mapping of arrays)."""

    def host(a):
        a = a.data if hasattr(a, "data") else a
        if type(a).__module__.split(".")[0] == "cupy":
            a = a.get()
        return np.asarray(a)

    out = {
        "rho": np.array(host(state["rho"]), dtype=np.complex128),
        "hamiltonian": np.array(host(state["hamiltonian"]), dtype=np.complex128),
        "temperature": np.array(host(state["temperature"]), dtype=np.float64),
        "phi": np.array(host(state["phi"]), dtype=np.float64),
        "outcome": None,
    }
    if "outcome" in state:
        out["outcome"] = np.array(host(state["outcome"]), dtype=np.int64)
    return out


def reference_energy(state, qcfg, **kw) -> dict:
    """energy_terms of a state Dataset under a QuantumConfig-like object (keywords go to energy_terms)."""
    a = state_arrays(state)
    return energy_terms(
        a["rho"], a["hamiltonian"], a["temperature"], a["phi"], a["outcome"], oracle_config(qcfg), **kw
    )


# ------------------------------------------------------------------------------------ finite differences


def fd_gradient(fn, x: np.ndarray, directions, h: float) -> np.ndarray:
    """Central differences (fn(x + h E) - fn(x - h E)) / (2h) for every E in directions (same shape as x).

    For the conventions of the implementation: with a rho direction E (traceless Hermitian per agent) the
    result is sum_i tr(G_i E_i); for H directions sum_i tr(Hbar_i E_i); for a unit vector e_(i, a) of T or phi
    the partial derivative itself.
    """
    x = np.asarray(x)
    out = []
    for E in directions:
        E = np.asarray(E)
        assert E.shape == x.shape, (E.shape, x.shape)
        out.append((fn(x + h * E) - fn(x - h * E)) / (2 * h))
    return np.array(out, dtype=np.float64)


def random_hermitian(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """A random Hermitian direction (n, d, d) with unit Frobenius norm over the whole stack."""
    A = rng.standard_normal((n, d, d)) + 1j * rng.standard_normal((n, d, d))
    E = 0.5 * (A + np.conj(np.swapaxes(A, -1, -2)))
    return E / np.linalg.norm(E)


def random_traceless_hermitian(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """A random direction (n, d, d), traceless Hermitian per agent, unit Frobenius norm over the stack."""
    E = random_hermitian(rng, n, d)
    for i in range(n):
        E[i] = E[i] - np.trace(E[i]) / d * np.eye(d)
    return E / np.linalg.norm(E)


def unit_vector(shape, index) -> np.ndarray:
    """Float64 zeros of ``shape`` with a 1 at ``index`` (a direction for T (i,) or phi (i, a))."""
    e = np.zeros(shape)
    e[index] = 1.0
    return e
