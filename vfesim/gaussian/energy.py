"""The Gaussian free energy (SPEC §2.2) and its exact gradient: the one assembly, for every backend.

:func:`energy_and_gradient` runs the stages with a backend's capabilities (:class:`vfesim.backends.Backend`):
its pairwise kernels (``pairwise_dense`` / ``pairwise_sparse``, the contract of :mod:`vfesim.pairwise`)
and, where it has them, its per-agent kernels (:class:`AgentOps`); otherwise the array-generic NumPy/CuPy
stages of :mod:`.features` and :mod:`.terms`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import pairwise as _np_pairwise
from ..arrays import array_module as _xp
from ..arrays import host_floats, lazy_total
from ..config import ModelConfig
from ..groups import generators, phi_grad_from_R
from .features import agent_features, features_vjp, frames
from .terms import observation, observation_vjp, self_kl, self_kl_vjp

__all__ = [
    "TERMS",
    "AgentOps",
    "StagedStages",
    "NUMPY_AGENT_OPS",
    "energy_and_gradient",
    "energy_and_gradient_arrays",
    "attention",
]

TERMS = ("self", "belief_align", "prior_align", "observation")


class AgentOps(NamedTuple):
    """The per-agent stages of the alignment terms; a backend may replace them with kernels.

    frames(phi (N,3), irreps) -> R (N,K,K)
    features(mu (N,K), sigma (N,K,K), R, name) -> (A (N,D), B (N,D), c (N,), cache)
    features_vjp(gA, gB, gc, cache) -> (g_mu, g_sigma, g_R)
    phi_grad(g_R, R, phi, G (3,K,K)) -> g_phi (N,3)
    self_kl(mu_q, sigma_q, mu_p, sigma_p, lam) -> (kl (N,), g_mu_q, g_sigma_q, g_mu_p, g_sigma_p),
        the gradients of lam * sum_i KL(q_i || p_i)
    """

    frames: Callable
    features: Callable
    features_vjp: Callable
    phi_grad: Callable
    self_kl: Callable


def _self_kl_and_grad(mu_q, sigma_q, mu_p, sigma_p, lam: float):
    kl, cache = self_kl(mu_q, sigma_q, mu_p, sigma_p)
    xp = _xp(kl)
    return (kl, *self_kl_vjp(xp.full(kl.shape, lam, kl.dtype), cache))


NUMPY_AGENT_OPS = AgentOps(frames, agent_features, features_vjp, phi_grad_from_R, _self_kl_and_grad)


def _with_jitter(S, eps: float):
    if eps == 0.0:
        return S
    xp = _xp(S)
    return S + eps * xp.eye(S.shape[-1], dtype=S.dtype)


def _alignment_pairs(cfg: ModelConfig):
    """(term name, lambda, kappa, mean key, covariance key) of the two alignment terms."""
    return (
        ("belief_align", cfg.lambda_belief, cfg.kappa_beta, "mu_q", "sigma_q"),
        ("prior_align", cfg.lambda_prior, cfg.kappa_gamma, "mu_p", "sigma_p"),
    )


class StagedStages:
    """The per-agent stages of one evaluation, run stage by stage through an :class:`AgentOps` on NumPy
    or CuPy arrays, with the gradient buffers they accumulate into.

    A stages object (this class, or a backend's fused one, e.g. ``vfesim.backends.cuda_backend``) offers:
    ``grads`` (variable -> array, accumulated in place), ``total(e)`` (float64 sum of a per-agent energy),
    ``self_term(lam)``, ``alignment(active, pairwise_dense, pairwise_sparse, neighbours)`` (energy values
    per term), ``collect(named values) -> floats`` and ``result() -> grads``. Energy values may stay on the
    device until :meth:`collect`.
    """

    def __init__(self, ops: AgentOps, arrays: dict[str, Any], cfg: ModelConfig, S: dict[str, Any]):
        self.ops, self.arrays, self.cfg, self.S = ops, arrays, cfg, S
        xp = _xp(arrays["mu_q"])
        self.grads = {k: xp.zeros_like(v) for k, v in arrays.items()}

    @staticmethod
    def total(e):
        return lazy_total(e)

    def self_term(self, lam: float) -> float:
        a, S = self.arrays, self.S
        kl, *g = self.ops.self_kl(a["mu_q"], S["sigma_q"], a["mu_p"], S["sigma_p"], lam)
        for k, gk in zip(("mu_q", "sigma_q", "mu_p", "sigma_p"), g, strict=True):
            self.grads[k] += gk
        return lam * self.total(kl)

    def alignment(self, active, pairwise_dense: Callable, pairwise_sparse: Callable, neighbours) -> list:
        """Energies of the active alignment terms (SPEC §2.2–2.3); gradients into ``grads``."""
        ops, cfg, grads = self.ops, self.cfg, self.grads
        phi = self.arrays["phi"]
        R = ops.frames(phi, cfg.irreps)
        g_R = _xp(R).zeros_like(R)
        out = []
        for name, lam, kappa, kmu, ksig in active:
            A, B, c, cache = ops.features(self.arrays[kmu], self.S[ksig], R, ksig)
            E, gA, gB, gc = _np_pairwise.pairwise_energy(
                A, B, c, kappa, cfg.aggregator, None if cfg.dense else neighbours,
                dense=pairwise_dense, sparse=pairwise_sparse,
            )  # fmt: skip
            out.append((name, lam * E))
            g_mu, g_sigma, g_Rk = ops.features_vjp(lam * gA, lam * gB, lam * gc, cache)
            grads[kmu] += g_mu
            grads[ksig] += g_sigma
            g_R += g_Rk
        grads["phi"] += ops.phi_grad(g_R, R, phi, generators(cfg.irreps))
        return out

    @staticmethod
    def collect(values: list) -> dict[str, float]:
        return host_floats(dict(values))

    def result(self) -> dict[str, Any]:
        return self.grads


def energy_and_gradient_arrays(
    arrays: dict[str, Any],
    cfg: ModelConfig,
    *,
    pairwise_dense: Callable = _np_pairwise.pairwise_dense,
    pairwise_sparse: Callable = _np_pairwise.pairwise_sparse,
    neighbours: tuple | None = None,
    agent_ops: AgentOps | Callable = NUMPY_AGENT_OPS,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Energy terms and the gradient of ``terms["total"]`` for raw arrays (no validation): the one
    assembly of the Gaussian free energy, whatever runs its stages.

    arrays: mu_q, mu_p (N, K); sigma_q, sigma_p (N, K, K); phi (N, 3); obs (N, D) if needed.
    neighbours: (index, mask) for sparse configs (default: from cfg).
    agent_ops: the per-agent stages, an :class:`AgentOps` (run by :class:`StagedStages`) or a factory
        ``(arrays, cfg, S) -> stages`` of a backend's own (fused) stages.
    """
    xp = _xp(arrays["mu_q"])
    S = {k: _with_jitter(arrays[k], cfg.jitter) for k in ("sigma_q", "sigma_p")}
    if isinstance(agent_ops, AgentOps):
        stages = StagedStages(agent_ops, arrays, cfg, S)
    else:
        stages = agent_ops(arrays, cfg, S)
    grads = stages.grads
    values = []

    if cfg.lambda_self > 0:
        values.append(("self", stages.self_term(cfg.lambda_self)))

    if cfg.lambda_obs > 0:
        W = xp.asarray(cfg.W, dtype=arrays["mu_q"].dtype)
        R = xp.asarray(cfg.R, dtype=arrays["mu_q"].dtype)
        e, cache = observation(arrays["mu_q"], S["sigma_q"], arrays["obs"], W, R)
        values.append(("observation", cfg.lambda_obs * stages.total(e)))
        g_mu, g_sigma, g_obs = observation_vjp(xp.full(e.shape, cfg.lambda_obs, e.dtype), cache)
        grads["mu_q"] += g_mu
        grads["sigma_q"] += g_sigma
        grads["obs"] += g_obs

    active = [p for p in _alignment_pairs(cfg) if p[1] > 0]
    if active:
        if not cfg.dense and neighbours is None:
            neighbours = (cfg.neighbours.index, cfg.neighbours.mask)
        values += stages.alignment(active, pairwise_dense, pairwise_sparse, neighbours)

    terms = dict.fromkeys(TERMS, 0.0)
    terms.update(stages.collect(values))
    terms["total"] = sum(terms[k] for k in TERMS)
    return terms, stages.result()


def energy_and_gradient(arrays: dict[str, Any], cfg: ModelConfig, backend) -> tuple[dict[str, float], dict]:
    """Terms and the gradient of ``terms["total"]`` with the capabilities of ``backend`` (no validation):
    its pairwise kernels and its per-agent stages (array-generic ones where it has none)."""
    return energy_and_gradient_arrays(
        arrays,
        cfg,
        pairwise_dense=backend.pairwise_dense,
        pairwise_sparse=backend.pairwise_sparse,
        agent_ops=backend.agent_ops.get("gaussian", NUMPY_AGENT_OPS),
    )


def attention(arrays: dict[str, Any], cfg: ModelConfig, which: str = "belief") -> np.ndarray:
    """Attention weights beta (dense: (N, N), zero diagonal; sparse: (N, k) aligned with the index).

    which: "belief" (beta, kappa_beta, q) or "prior" (gamma, kappa_gamma, p). NumPy arrays.
    """
    if which not in ("belief", "prior"):
        raise ValueError(f"which: must be 'belief' or 'prior', got {which!r}")
    kmu, ksig, kappa = (
        ("mu_q", "sigma_q", cfg.kappa_beta) if which == "belief" else ("mu_p", "sigma_p", cfg.kappa_gamma)
    )
    R = frames(arrays["phi"], cfg.irreps)
    A, B, c, _ = agent_features(arrays[kmu], _with_jitter(arrays[ksig], cfg.jitter), R)
    if cfg.dense:
        return _np_pairwise.pairwise_dense(A, B, c, kappa, cfg.aggregator, return_beta=True)[-1]
    nb = cfg.neighbours
    return _np_pairwise.pairwise_sparse(A, B, c, nb.index, nb.mask, kappa, cfg.aggregator, return_beta=True)[
        -1
    ]
