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
real Hermitian coordinates of :func:`.linalg.hvec` (length d^2):

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
(C~, M~ the pulled-back cotangents), then one Daleckii–Krein of exp(-i phi . J) (rule R2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import pairwise as _pairwise
from ..arrays import array_module as _xp
from ..arrays import total
from .config import QuantumConfig
from .frames import frames, frames_vjp, spin_generators
from .linalg import dagger, dd_exp, dd_log, dk, eigh, from_eig, herm, hmat, hvec, trace, traceless

__all__ = [
    "TERMS",
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


def floor_eps(dtype) -> float:
    """The floor eps of a complex dtype (FLOOR_EPS)."""
    return FLOOR_EPS[np.dtype(dtype).name]


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
    return hvec(_pull(U, a)), -2.0 * hvec(_pull(U, log_a))


def _pull_vjp(gA, gB, U, a, log_a):
    d = U.shape[-1]
    C = hmat(gA, d)  # cotangent of a~
    M = hmat(-2.0 * gB, d)  # cotangent of (log a)~
    Ud = dagger(U)
    return U @ C @ Ud, U @ M @ Ud, 2.0 * (a @ U @ C + log_a @ U @ M)


def _dk_log(s, W, E):
    return dk(W, dd_log(s).astype(W.dtype), E)


def _dk_exp(l, p, V, E):
    return dk(V, dd_exp(l, p).astype(V.dtype), E)


def _no_step_vjp(d: int) -> None:
    """The array code's channel step has no kernel adjoint (QuantumOps.step_vjp)."""
    return None


class QuantumOps(NamedTuple):
    """The per-agent stages of the density-matrix free energy; a backend may supply kernels for them
    (NumPy/CuPy array code by default, :data:`NUMPY_OPS`). Batched over agents; ``d x d`` complex.

    eig_log(x) -> (s (N, d), W, log x, tr(x log x) (N,)): floored beliefs' eigen-decomposition and log
    gibbs(H, T) -> (sigma, log sigma, l, p, V): Gibbs priors, log-eigenvalues l, p = exp(l), eigenvectors
    frames(phi, J, dtype) -> (U, cache): U_i = exp(-i phi_i . J), cache = (k, V) of phi_i . J
    pull_features(U, a, log a) -> (A, B) = (hvec(U^dagger a U), -2 hvec(U^dagger (log a) U)) (N, d^2)
    pull_vjp(gA, gB, U, a, log a) -> (a_bar, log_a_bar, U_bar): adjoint of pull_features
    dk_log(s, W, E) -> Dlog(x)[E];  dk_exp(l, p, V, E) -> Dexp(L)[E] (Daleckii–Krein)
    frames_vjp(U_bar, cache, J) -> phi_bar (N, 3)
    channel_step(P, rho, dt, dynamics, senders=None) -> rho after one Jacobi step of the channels,
        forward only (vfesim.quantum.evolve: P its Prepared caches, dynamics a QuantumDynamics);
        ``senders`` = (states, frames) of the agents the coupling window P.index names when they are
        not rho's (a chunk of a population; P.M then transports from those frames)
    step_vjp(d) -> the adjoint of ``channel_step`` for d x d states by per-agent kernels (a
        ``vjp(P, rho, out_bar, dt, dynamics)`` of :func:`.kernel_ops.kernel_step_vjp`, forward recomputed
        per agent), or None where ``channel_step`` is array code: rollouts then differentiate the array
        code's step from its tape (vfesim.quantum.rollout)
    pairwise_dense, pairwise_sparse: the backend's pair kernels (:mod:`vfesim.pairwise` signatures) the
        free energy takes when a caller names no others (rollouts, mirror steps); None: the array code
    """

    eig_log: Callable
    gibbs: Callable
    frames: Callable
    pull_features: Callable
    pull_vjp: Callable
    dk_log: Callable
    dk_exp: Callable
    frames_vjp: Callable
    channel_step: Callable
    step_vjp: Callable = _no_step_vjp
    pairwise_dense: Callable | None = None
    pairwise_sparse: Callable | None = None


def _channel_step(P, rho, dt, dyn, senders=None):
    from .evolve import agent_update, window  # evolve imports this module

    S = rho if senders is None else senders[0]  # a chunk's senders: (states, frames) of other agents
    return agent_update(P, slice(None), rho, S[window(P, _xp(rho))[0]], dt, dyn)[0]


NUMPY_OPS = QuantumOps(
    _eig_log, _gibbs, frames, _pull_features, _pull_vjp, _dk_log, _dk_exp, frames_vjp, _channel_step
)


def _alignment(ops, a, log_a, c_half, U, kappa, aggregator, neighbours, dense, sparse):
    """One alignment term over states a (own frames) with their logs.

    c_half: tr(a log a) per agent. Returns (E, a_bar, log_a_bar, U_bar, gc): cotangents (own frame) of a
    and of log a from the features A and B, gc (the coefficient of tr(a log a) is 2 gc), and U's
    cotangent (dL = Re tr(U_bar^dagger dU)).
    """
    A, B = ops.pull_features(U, a, log_a)
    E, gA, gB, gc = _pairwise.pairwise_energy(
        A, B, 2.0 * c_half, kappa, aggregator, neighbours, dense=dense, sparse=sparse
    )
    return (E, *ops.pull_vjp(gA, gB, U, a, log_a), gc)


def energy_and_gradient_arrays(
    arrays: dict[str, Any],
    cfg: QuantumConfig,
    *,
    pairwise_dense: Callable | None = None,
    pairwise_sparse: Callable | None = None,
    neighbours: tuple | None = None,
    ops: QuantumOps = NUMPY_OPS,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Energy terms and the gradient of ``terms["total"]`` for raw arrays (no validation).

    arrays: rho, hamiltonian (N, d, d) complex; temperature (N,), phi (N, 3) real; outcome (N,) integer
    when lambda_obs > 0. Gradient conventions: module docstring. neighbours: (index, mask) for sparse
    configs (default: from cfg). ops: the per-agent stages (array code by default, or a backend's kernels).
    pairwise_dense / pairwise_sparse: the pair kernels (default: those of ``ops``, else the array code).
    """
    pairwise_dense = pairwise_dense or ops.pairwise_dense or _pairwise.pairwise_dense
    pairwise_sparse = pairwise_sparse or ops.pairwise_sparse or _pairwise.pairwise_sparse
    rho, H, T, phi = arrays["rho"], arrays["hamiltonian"], arrays["temperature"], arrays["phi"]
    xp = _xp(rho)
    N, d = rho.shape[0], rho.shape[-1]
    if not cfg.dense and neighbours is None:
        neighbours = (cfg.neighbours.index, cfg.neighbours.mask)
    nb = None if cfg.dense else neighbours
    x, eps = _floored(rho)
    x_bar = xp.zeros_like(rho)  # cotangent of x (own frame)
    logx_bar = xp.zeros_like(rho)  # cotangent of log x
    U_bar = xp.zeros_like(rho)
    grads = {k: xp.zeros_like(v) for k, v in arrays.items() if k != "outcome"}
    terms = dict.fromkeys(TERMS, 0.0)

    if cfg.lambda_self > 0 or cfg.lambda_belief > 0:
        s, W, log_x, x_log_x = ops.eig_log(x)  # x_log_x = tr(x log x) = -S(x)
    if cfg.lambda_self > 0 or cfg.lambda_prior > 0:
        sigma, log_sigma, l, p, V = ops.gibbs(H, T)
        sigma_bar = xp.zeros_like(rho)
        logsig_bar = xp.zeros_like(rho)
    if cfg.lambda_belief > 0 or cfg.lambda_prior > 0:
        J = spin_generators(d)
        U, fcache = ops.frames(phi, J, rho.dtype)

    if cfg.lambda_self > 0:
        lam = cfg.lambda_self
        # D(x || sigma) = tr x log x - tr x log sigma; d/dx = log x - log sigma (+ I, dropped)
        e = x_log_x - xp.einsum("nkl,nlk->n", x, log_sigma).real
        terms["self"] = lam * total(e)
        x_bar += lam * (log_x - log_sigma)
        logsig_bar -= lam * x

    if cfg.lambda_obs > 0:
        lam = cfg.lambda_obs
        y = xp.asarray(arrays["outcome"])
        idx = xp.arange(N)
        pyy = x[idx, y, y].real
        terms["observation"] = lam * total(-xp.log(pyy))
        x_bar[idx, y, y] -= lam / pyy

    if cfg.lambda_belief > 0:
        lam = cfg.lambda_belief
        E, a_bar, la_bar, Ub, gc = _alignment(
            ops, x, log_x, x_log_x, U, cfg.kappa_beta, cfg.aggregator, nb, pairwise_dense, pairwise_sparse
        )
        terms["belief_align"] = lam * E
        x_bar += lam * (a_bar + (2.0 * gc)[:, None, None] * log_x)  # d tr(x log x) = tr((log x + I) dx)
        logx_bar += lam * la_bar
        U_bar += lam * Ub

    if cfg.lambda_prior > 0:
        lam = cfg.lambda_prior
        sig_log_sig = (p * l).sum(axis=1)
        E, a_bar, la_bar, Ub, gc = _alignment(
            ops,
            sigma,
            log_sigma,
            sig_log_sig,
            U,
            cfg.kappa_gamma,
            cfg.aggregator,
            nb,
            pairwise_dense,
            pairwise_sparse,
        )
        terms["prior_align"] = lam * E
        sigma_bar += lam * (a_bar + (2.0 * gc)[:, None, None] * log_sigma)
        logsig_bar += lam * la_bar
        U_bar += lam * Ub

    if cfg.lambda_self > 0 or cfg.lambda_belief > 0:
        x_bar = x_bar + ops.dk_log(s, W, logx_bar)
    grads["rho"] = (1.0 - eps) * traceless(herm(x_bar))

    if cfg.lambda_self > 0 or cfg.lambda_prior > 0:
        # Total cotangent of L = log sigma (sigma = exp(L)), then L = -H/T - log Z(H, T) I:
        # H_bar = (-M + tr(M) sigma)/T, T_bar = (tr(M H) - tr(M) tr(sigma H))/T^2.
        M = logsig_bar + ops.dk_exp(l, p, V, sigma_bar)
        trM = trace(M).real
        Tc = T[:, None, None]
        grads["hamiltonian"] = herm(-M + trM[:, None, None] * sigma) / Tc
        tr_MH = xp.einsum("nkl,nlk->n", M, H).real
        tr_sH = xp.einsum("nkl,nlk->n", sigma, H).real
        grads["temperature"] = ((tr_MH - trM * tr_sH) / T**2).astype(T.dtype)

    if cfg.lambda_belief > 0 or cfg.lambda_prior > 0:
        grads["phi"] = ops.frames_vjp(U_bar, fcache, J).astype(phi.dtype)

    terms["total"] = sum(terms[k] for k in TERMS)
    return terms, grads


def energy_and_gradient(arrays: dict[str, Any], cfg: QuantumConfig, backend) -> tuple[dict[str, float], dict]:
    """Terms and the gradient of ``terms["total"]`` with the capabilities of ``backend`` (no validation).

    The per-agent stages are the backend's kernels (``backend.agent_ops["quantum"]``, a
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


def _pulled(arrays: dict[str, Any], cfg: QuantumConfig, which: str):
    """Pulled-back states and logs (a~, (log a)~) and tr(a log a) of the belief or prior term."""
    if which == "belief":
        x, _ = _floored(arrays["rho"])
        s, W = eigh(x)
        a, log_a, c_half = x, from_eig(W, np.log(s)), (s * np.log(s)).sum(axis=1)
    elif which == "prior":
        a, log_a, l, p, _ = _gibbs(arrays["hamiltonian"], arrays["temperature"])
        c_half = (p * l).sum(axis=1)
    else:
        raise ValueError(f"which: must be 'belief' or 'prior', got {which!r}")
    U, _ = frames(arrays["phi"], spin_generators(cfg.d), arrays["rho"].dtype)
    return _pull(U, a), _pull(U, log_a), c_half


def divergences(arrays: dict[str, Any], cfg: QuantumConfig, which: str = "belief") -> np.ndarray:
    """All pairwise D(a~_i || a~_j) (N, N) by the feature GEMM of the alignment term (NumPy arrays).

    which: "belief" (floored rho) or "prior" (Gibbs states). The diagonal is 0 up to rounding.
    """
    at, lt, c_half = _pulled(arrays, cfg, which)
    return 0.5 * (hvec(at) @ (-2.0 * hvec(lt)).T + 2.0 * c_half[:, None])


def attention(arrays: dict[str, Any], cfg: QuantumConfig, which: str = "belief") -> np.ndarray:
    """Attention weights (dense: (N, N), zero diagonal; sparse: (N, k) aligned with the index).

    which: "belief" (beta, kappa_beta) or "prior" (gamma, kappa_gamma). NumPy arrays.
    """
    at, lt, c_half = _pulled(arrays, cfg, which)
    A, B, c = hvec(at), -2.0 * hvec(lt), 2.0 * c_half
    kappa = cfg.kappa_beta if which == "belief" else cfg.kappa_gamma
    if cfg.dense:
        return _pairwise.pairwise_dense(A, B, c, kappa, cfg.aggregator, return_beta=True)[-1]
    nb = cfg.neighbours
    return _pairwise.pairwise_sparse(A, B, c, nb.index, nb.mask, kappa, cfg.aggregator, return_beta=True)[-1]
