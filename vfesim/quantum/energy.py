"""The density-matrix free energy (spec/quantum.md §2) and its exact hand-written gradient: the one
assembly of the family, NumPy reference (vectorised, batched ``eigh``).

Model. Every belief enters through its depolarising floor (spec §2.3)

    x_i = (1 - eps) rho_i + eps I / d,     eps = FLOOR_EPS[dtype] (1e-12 complex128, 1e-6 complex64),

so logs are finite for rank-deficient rho (no clamp). The energy is defined on x and differentiated
exactly: F(rho) := F_0(x(rho)). Priors are Gibbs states sigma_i = exp(-H_i/T_i)/Z_i, full rank, with the
closed-form log sigma_i = -H_i/T_i - log Z_i. Frames U_i = exp(-i phi_i . J) (:mod:`.frames`); pulled-back
states y~_i = U_i^dagger y_i U_i. Terms::

    self          lambda_self   sum_i D(x_i || sigma_i)
    belief_align  lambda_belief sum_i Agg_kappa_beta({D(x~_i || x~_j)}_{j in N(i)})
    prior_align   lambda_prior  sum_i Agg_kappa_gamma({D(sigma~_i || sigma~_j)}_{j in N(i)})
    observation   lambda_obs    sum_i -log <y_i| x_i |y_i>

with D(a || b) = tr a (log a - log b) and the aggregators of :mod:`vfesim.pairwise`.

Pairwise part (spec §2.4). D(a~_i || a~_j) = -S(a_i) - tr(a~_i log a~_j) = 1/2 (A_i . B_j + c_i) with the
real Hermitian coordinates of :func:`.linalg.hvec` (length d^2; ``trace_first``: the trace is the first
coordinate, so that the pair cotangents' large identity parts do not cost their traceless parts precision):

    A_i = hvec(a~_i),   B_j = -2 hvec(log a~_j),   c_i = 2 tr(a_i log a_i),

so one real GEMM gives all D_ij; the family-free layer (``pairwise_dense`` / ``pairwise_sparse`` of the
backend) returns the energy and the cotangents gA, gB, gc.

Gradients (the layout of the state; :func:`energy_and_gradient_arrays`):
- ``rho``: the traceless Hermitian G with dF = tr(G d rho) for every traceless Hermitian d rho;
- ``hamiltonian``: the Hermitian Hbar with dF = tr(Hbar dH) for every Hermitian dH (traceless, since
  H + c I gives the same prior);
- ``temperature``, ``phi``: plain partial derivatives; ``outcome`` has none (not in the result).
The neighbour sums arrive as the cotangents of each agent's own a and log a, so the chain through log is
one Daleckii–Krein per agent (not per pair): x_bar += Dlog(x)[log-cotangent]; for the prior, through
sigma = exp(log sigma) and log sigma(H, T); for the frames, U_bar = 2 a U C~ + 2 (log a) U M~ per term
(C~, M~ the traceless parts of the pulled-back cotangents: their identity parts add U H, H Hermitian,
which rule R2 maps to 0), then one Daleckii–Krein of exp(-i phi . J) (rule R2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import pairwise as _pairwise
from ..arrays import array_module as _xp
from ..arrays import host_floats, lazy_total
from .config import QuantumConfig
from .frames import frames, frames_vjp, spin_generators
from .linalg import dagger, dd_exp, dd_log, dk, eigh, from_eig, herm, hmat, hvec, trace, traceless

__all__ = [
    "TERMS",
    "Forward",
    "QuantumOps",
    "NUMPY_OPS",
    "FLOOR_EPS",
    "floor_eps",
    "energy_and_gradient",
    "energy_and_gradient_arrays",
    "divergences",
    "attention",
]

TERMS = ("self", "belief_align", "prior_align", "observation")

# Depolarising floor (spec §2.3): x = (1 - eps) rho + eps I/d. log(eps/d) bounds every log eigenvalue.
FLOOR_EPS = {"complex128": 1e-12, "complex64": 1e-6}


_FLOOR_BY_DTYPE = {np.dtype(name): eps for name, eps in FLOOR_EPS.items()}


def floor_eps(dtype) -> float:
    """The floor eps of a complex dtype (FLOOR_EPS)."""
    eps = _FLOOR_BY_DTYPE.get(dtype)  # (a lookup per rollout step: NumPy's dtype names are slow)
    return FLOOR_EPS[np.dtype(dtype).name] if eps is None else eps


def _floored(rho):
    """x = (1 - eps) herm(rho) + eps I/d (N, d, d) and eps."""
    xp = _xp(rho)
    d = rho.shape[-1]
    eps = floor_eps(rho.dtype)
    return (1.0 - eps) * herm(rho) + (eps / d) * xp.eye(d, dtype=rho.dtype), eps


def _gibbs(H, T):
    """Gibbs prior sigma = exp(-H/T)/Z: (sigma, log sigma, l, p, V) with H = V diag(h) V^dagger,
    l = -h/T - log Z (log-eigenvalues, computed without log p) and p = exp(l)."""
    xp = _xp(H)
    h, V = eigh(H)
    a = -h / T[:, None]
    m = a.max(axis=1, keepdims=True)
    l = a - (m + xp.log(xp.exp(a - m).sum(axis=1, keepdims=True)))
    p = xp.exp(l)
    return from_eig(V, p), from_eig(V, l), l, p, V


def _pull(U, X):
    return dagger(U) @ X @ U


def _eig_log(x):
    s, W = eigh(x)
    log_s = _xp(s).log(s)
    return s, W, from_eig(W, log_s), (s * log_s).sum(axis=1)


def _pull_features(U, a, log_a):
    return hvec(_pull(U, a), trace_first=True), -2.0 * hvec(_pull(U, log_a), trace_first=True)


def _pull_vjp(gA, gB, U, a, log_a):
    """Cotangents of a, log a and U from those of the feature rows. The identity parts of C and M (the
    features' first coordinate) are added to a's and log a's cotangents apart and stay out of U's: they add
    U H (H Hermitian), which rule R2 maps to 0 exactly, but would dominate U_bar and cost the phi gradient
    (a small part of it) precision in complex64."""
    xp = _xp(U)
    d = U.shape[-1]
    C, cC = _split_trace(gA, d)  # cotangent of a~: C + cC I
    M, cM = _split_trace(-2.0 * gB, d)  # cotangent of (log a)~: M + cM I
    Ud = dagger(U)
    eye = xp.eye(d, dtype=C.dtype)
    return (
        U @ C @ Ud + cC[:, None, None] * eye,
        U @ M @ Ud + cM[:, None, None] * eye,
        2.0 * (a @ U @ C + log_a @ U @ M),
    )


def _split_trace(v, d: int):
    """(traceless part, identity coefficient) of hmat(v, d, trace_first=True)."""
    w = v.copy()
    w[:, 0] = 0.0
    return hmat(w, d, trace_first=True), v[:, 0] * (1.0 / math.sqrt(d))  # a Python float: v's dtype


def _dk_log(s, W, E):
    return dk(W, dd_log(s).astype(W.dtype), E)


def _dk_exp(l, p, V, E):
    return dk(V, dd_exp(l, p).astype(V.dtype), E)


def _no_step_vjp(d: int) -> None:
    """The array code's channel step has no kernel adjoint (QuantumOps.step_vjp)."""
    return None


class Forward(NamedTuple):
    """The per-agent part of one free energy, as a :class:`QuantumOps` forward pass returns it.

    energies: "self" -> D(x_i || sigma_i), "observation" -> -log <y_i| x_i |y_i> (N,), for terms on;
    features: "belief_align" / "prior_align" -> (A, B, c) of the pulled-back states (module docstring);
    cache: what the same ops' backward pass needs (its own layout).
    """

    energies: dict
    features: dict
    cache: Any


class QuantumOps(NamedTuple):
    """The per-agent stages of density-matrix agents; a backend may supply kernels for them (NumPy/CuPy
    array code by default, :data:`NUMPY_OPS`). Batched over agents; ``d x d`` complex. ``weights`` are
    the terms' (lambda_self, lambda_belief, lambda_prior, lambda_obs); a term is on where its weight is
    positive.

    forward(arrays, weights) -> :class:`Forward`: floored beliefs and their logs, Gibbs priors, frames
        U_i = exp(-i phi_i . J), per-agent energies and the alignment terms' feature rows
    backward(arrays, forward, weights, cotangents) -> gradients of rho, hamiltonian, temperature, phi
        (conventions of :func:`energy_and_gradient_arrays`) from the pair cotangents (gA, gB, gc) of
        each alignment term on: its pull-back adjoints, one Daleckii–Krein of log per belief, one of
        exp per prior, rule R2 per frame
    channel_step(P, rho, dt, dynamics, senders=None) -> rho after one Jacobi step of the channels,
        forward only (vfesim.quantum.evolve: P its Prepared caches, dynamics a QuantumDynamics);
        ``senders`` = (states, frames) of the agents the coupling window P.index names when they are
        not rho's (a chunk of a population; P.M then transports from those frames)
    step_vjp(d) -> the adjoint of ``channel_step`` for d x d states by per-agent kernels (a
        ``vjp(P, rho, out_bar, dt, dynamics)`` of :func:`.kernel_ops.kernel_step_vjp`, forward recomputed
        per agent), or None where ``channel_step`` is array code: rollouts then differentiate the array
        code's step from its tape (vfesim.quantum.rollout)
    pairwise_dense, pairwise_sparse: the backend's pair kernels (:mod:`vfesim.pairwise` signatures; E may
        be a 0-d device array, as :class:`vfesim.backends.Backend` allows) the free energy takes when a
        caller names no others (rollouts, mirror steps); None: the array code
    born: the Born terms of rollouts by the backend's kernels (a :class:`vfesim.quantum.born.BornOps`);
        None: the array code (``vfesim.quantum.born.ARRAY_BORN``)
    """

    forward: Callable
    backward: Callable
    channel_step: Callable
    step_vjp: Callable = _no_step_vjp
    pairwise_dense: Callable | None = None
    pairwise_sparse: Callable | None = None
    born: Any = None


def _channel_step(P, rho, dt, dyn, senders=None):
    from .evolve import agent_update, window  # evolve imports this module

    S = rho if senders is None else senders[0]  # a chunk's senders: (states, frames) of other agents
    return agent_update(P, slice(None), rho, S[window(P, _xp(rho))[0]], dt, dyn)[0]


def terms_on(weights) -> tuple[bool, bool, bool, bool]:
    """(self, belief, prior, observation) on: their weights are positive."""
    return tuple(bool(w > 0) for w in weights)


def _forward(arrays: dict[str, Any], weights) -> Forward:
    """The array code's forward pass (QuantumOps.forward)."""
    fs, fb, fp, fo = terms_on(weights)
    rho, H, T, phi = arrays["rho"], arrays["hamiltonian"], arrays["temperature"], arrays["phi"]
    xp = _xp(rho)
    x, eps = _floored(rho)
    c: dict[str, Any] = dict(x=x, eps=eps)
    energies, features = {}, {}
    if fs or fb:
        c["s"], c["W"], c["log_x"], x_log_x = _eig_log(x)  # x_log_x = tr(x log x) = -S(x)
    if fs or fp:
        c["sigma"], c["log_sigma"], c["l"], c["p"], c["V"] = _gibbs(H, T)
    if fb or fp:
        c["J"] = spin_generators(rho.shape[-1])
        c["U"], c["fcache"] = frames(phi, c["J"], rho.dtype)
    if fs:  # D(x || sigma) = tr x log x - tr x log sigma
        energies["self"] = x_log_x - xp.einsum("nkl,nlk->n", x, c["log_sigma"]).real
    if fo:
        c["y"] = y = xp.asarray(arrays["outcome"])
        energies["observation"] = -xp.log(x[xp.arange(x.shape[0]), y, y].real)
    if fb:
        A, B = _pull_features(c["U"], x, c["log_x"])
        features["belief_align"] = (A, B, 2.0 * x_log_x)
    if fp:
        A, B = _pull_features(c["U"], c["sigma"], c["log_sigma"])
        features["prior_align"] = (A, B, 2.0 * (c["p"] * c["l"]).sum(axis=1))
    return Forward(energies, features, c)


def _backward(arrays: dict[str, Any], fw: Forward, weights, cot: dict) -> dict[str, Any]:
    """The array code's backward pass (QuantumOps.backward)."""
    fs, fb, fp, fo = terms_on(weights)
    ls, lb, lp, lo = weights
    c = fw.cache
    x, H, T = c["x"], arrays["hamiltonian"], arrays["temperature"]
    xp = _xp(x)
    x_bar = xp.zeros_like(x)  # cotangent of x (own frame)
    logx_bar = xp.zeros_like(x)  # cotangent of log x
    U_bar = xp.zeros_like(x)
    sigma_bar = xp.zeros_like(x)
    logsig_bar = xp.zeros_like(x)
    if fs:  # d/dx D(x || sigma) = log x - log sigma (+ I, dropped); d/d(log sigma) = -x
        x_bar += ls * (c["log_x"] - c["log_sigma"])
        logsig_bar -= ls * x
    if fo:
        y, idx = c["y"], xp.arange(x.shape[0])
        x_bar[idx, y, y] -= lo / x[idx, y, y].real
    alignment = (
        ("belief_align", lb, x, c.get("log_x"), x_bar, logx_bar),
        ("prior_align", lp, c.get("sigma"), c.get("log_sigma"), sigma_bar, logsig_bar),
    )
    for name, lam, a, log_a, a_bar, la_bar in alignment:
        if lam > 0:
            gA, gB, gc = cot[name]
            ab, lab, Ub = _pull_vjp(gA, gB, c["U"], a, log_a)
            a_bar += lam * (ab + (2.0 * gc)[:, None, None] * log_a)  # d tr(a log a) = tr((log a + I) da)
            la_bar += lam * lab
            U_bar += lam * Ub
    grads = {}
    if fs or fb:
        x_bar = x_bar + _dk_log(c["s"], c["W"], logx_bar)
    grads["rho"] = (1.0 - c["eps"]) * traceless(herm(x_bar))
    if fs or fp:
        # Total cotangent of L = log sigma (sigma = exp(L)), then L = -H/T - log Z(H, T) I:
        # H_bar = (-M + tr(M) sigma)/T, T_bar = (tr(M H) - tr(M) tr(sigma H))/T^2.
        sigma = c["sigma"]
        M = logsig_bar + _dk_exp(c["l"], c["p"], c["V"], sigma_bar)
        trM = trace(M).real
        grads["hamiltonian"] = herm(-M + trM[:, None, None] * sigma) / T[:, None, None]
        tr_MH = xp.einsum("nkl,nlk->n", M, H).real
        tr_sH = xp.einsum("nkl,nlk->n", sigma, H).real
        grads["temperature"] = (tr_MH - trM * tr_sH) / T**2
    else:
        grads["hamiltonian"], grads["temperature"] = xp.zeros_like(H), xp.zeros_like(T)
    if fb or fp:
        grads["phi"] = frames_vjp(U_bar, c["fcache"], c["J"])
    else:
        grads["phi"] = xp.zeros_like(arrays["phi"])
    return grads


NUMPY_OPS = QuantumOps(_forward, _backward, _channel_step)


def energy_and_gradient_arrays(
    arrays: dict[str, Any],
    cfg: QuantumConfig,
    *,
    pairwise_dense: Callable | None = None,
    pairwise_sparse: Callable | None = None,
    neighbours: tuple | None = None,
    ops: QuantumOps = NUMPY_OPS,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Energy terms and the gradient of ``terms["total"]`` for raw arrays (no validation): the one
    assembly of the density-matrix free energy, whatever runs its per-agent passes.

    arrays: rho, hamiltonian (N, d, d) complex; temperature (N,), phi (N, 3) real; outcome (N,) integer
    when lambda_obs > 0. Gradient conventions: module docstring. neighbours: (index, mask) for sparse
    configs (default: from cfg). ops: the per-agent passes (array code by default, or a backend's kernels).
    pairwise_dense / pairwise_sparse: the pair kernels (default: those of ``ops``, else the array code).
    """
    pairwise_dense = pairwise_dense or ops.pairwise_dense or _pairwise.pairwise_dense
    pairwise_sparse = pairwise_sparse or ops.pairwise_sparse or _pairwise.pairwise_sparse
    if not cfg.dense and neighbours is None:
        neighbours = (cfg.neighbours.index, cfg.neighbours.mask)
    nb = None if cfg.dense else neighbours
    weights = (cfg.lambda_self, cfg.lambda_belief, cfg.lambda_prior, cfg.lambda_obs)
    fw = ops.forward(arrays, weights)
    # Each term's value where it was computed (device sums stay on the device until one transfer at the
    # end: no synchronisation between the passes), and its weight. The pairs first: on a GPU the host
    # queues the per-agent sums while they run.
    values, lams = {}, {}
    alignment = {
        "belief_align": (cfg.lambda_belief, cfg.kappa_beta),
        "prior_align": (cfg.lambda_prior, cfg.kappa_gamma),
    }
    cot = {}
    for name, (A, B, c) in fw.features.items():
        lam, kappa = alignment[name]
        values[name], *cot[name] = _pairwise.pairwise_energy(
            A, B, c, kappa, cfg.aggregator, nb, dense=pairwise_dense, sparse=pairwise_sparse
        )
        lams[name] = lam
    for name, lam in (("self", cfg.lambda_self), ("observation", cfg.lambda_obs)):
        if lam > 0:
            values[name], lams[name] = lazy_total(fw.energies[name]), lam
    grads = ops.backward(arrays, fw, weights, cot)
    grads["temperature"] = grads["temperature"].astype(arrays["temperature"].dtype, copy=False)
    grads["phi"] = grads["phi"].astype(arrays["phi"].dtype, copy=False)
    terms = dict.fromkeys(TERMS, 0.0)
    terms |= {name: lams[name] * v for name, v in host_floats(values).items()}
    terms["total"] = sum(terms[k] for k in TERMS)
    return terms, grads


def energy_and_gradient(arrays: dict[str, Any], cfg: QuantumConfig, backend) -> tuple[dict[str, float], dict]:
    """Terms and the gradient of ``terms["total"]`` with the capabilities of ``backend`` (no validation).

    The per-agent passes are the backend's kernels (``backend.agent_ops["quantum"]``, a
    :class:`QuantumOps`: Jacobi eigensolvers and Daleckii–Krein adjoints per agent on the CPU and the GPU)
    or, where it has none, array code on its arrays; the pairwise part runs in the backend's own
    family-free pair kernels.
    """
    return energy_and_gradient_arrays(
        arrays,
        cfg,
        pairwise_dense=backend.pairwise_dense,
        pairwise_sparse=backend.pairwise_sparse,
        ops=backend.agent_ops.get("quantum", NUMPY_OPS),
    )


def _features(arrays: dict[str, Any], which: str):
    """(A, B, c) of the belief or prior alignment term: the array code's forward pass with that term on."""
    if which not in ("belief", "prior"):
        raise ValueError(f"which: must be 'belief' or 'prior', got {which!r}")
    weights = (0.0, 1.0, 0.0, 0.0) if which == "belief" else (0.0, 0.0, 1.0, 0.0)
    return _forward(arrays, weights).features[f"{which}_align"]


def divergences(arrays: dict[str, Any], cfg: QuantumConfig, which: str = "belief") -> np.ndarray:
    """All pairwise D(a~_i || a~_j) (N, N) by the feature GEMM of the alignment term (NumPy arrays).

    which: "belief" (floored rho) or "prior" (Gibbs states). The diagonal is 0 up to rounding.
    """
    A, B, c = _features(arrays, which)
    return 0.5 * (A @ B.T + c[:, None])


def attention(arrays: dict[str, Any], cfg: QuantumConfig, which: str = "belief") -> np.ndarray:
    """Attention weights (dense: (N, N), zero diagonal; sparse: (N, k) aligned with the index).

    which: "belief" (beta, kappa_beta) or "prior" (gamma, kappa_gamma). NumPy arrays.
    """
    A, B, c = _features(arrays, which)
    kappa = cfg.kappa_beta if which == "belief" else cfg.kappa_gamma
    if cfg.dense:
        return _pairwise.pairwise_dense(A, B, c, kappa, cfg.aggregator, return_beta=True)[-1]
    nb = cfg.neighbours
    return _pairwise.pairwise_sparse(A, B, c, nb.index, nb.mask, kappa, cfg.aggregator, return_beta=True)[-1]
