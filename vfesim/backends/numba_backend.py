"""Numba backend: per-agent and pairwise stages as Numba CPU kernels (SPEC §2.3–2.4).

Arrays stay NumPy arrays on the host. The per-agent stages (frames, features, their adjoint, dF/dphi)
run in :mod:`vfesim_kernels.agent_cpu` through :class:`~vfesim.gaussian.energy.AgentOps`; the pairwise
part in :mod:`vfesim_kernels.pairwise_cpu` (parallel over receiver / sender blocks, deterministic, no
N x N array). Thread count: Numba's (``NUMBA_NUM_THREADS`` or ``numba.set_num_threads``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from vfesim_kernels import agent_cpu
from vfesim_kernels.pairwise_cpu import pairwise_dense, pairwise_sparse

from ..gaussian.energy import TERMS, AgentOps, energy_and_gradient_arrays
from ..gaussian.features import agent_features
from ..gaussian.terms import self_kl
from ..groups import generators

__all__ = ["to_device", "to_host", "energy_and_gradient", "AGENT_OPS"]


def to_device(arrays: dict) -> dict:
    return arrays


def to_host(arrays: dict) -> dict:
    return arrays


def _frames(phi, irreps):
    """R = exp(phi . G) (N, K, K): the algorithm of vfesim.groups.expm_so3, fused per agent."""
    return agent_cpu.frames(phi, generators(irreps), max(irreps))


def _features(mu, sigma, R, name: str = "sigma"):
    """agent_features in one kernel (the cache holds what agent_cpu.features_vjp reads). Where a
    transported covariance is not positive definite the NumPy code takes over: it raises the StateError
    naming the agent and ``name`` (its FeatureCache has the fields of agent_cpu's cache, in order)."""
    A, B, c, cache, ok = agent_cpu.features(mu, sigma, R)
    if not ok.all():
        return agent_features(mu, sigma, R, name)
    return A, B, c, cache


AGENT_OPS = AgentOps(_frames, _features, agent_cpu.features_vjp, agent_cpu.phi_grad)


# The config the shared code sees: the self term is computed here, by a kernel (see energy_and_gradient).
# One entry (the last config): dataclasses.replace re-validates the config (~50 us) and runs repeat it.
_NO_SELF: list = [None, None]


def _without_self(cfg):
    if _NO_SELF[0] is not cfg:
        _NO_SELF[:] = [cfg, dataclasses.replace(cfg, lambda_self=0.0)]
    return _NO_SELF[1]


def _self_term(arrays: dict, cfg, terms: dict, grads: dict) -> None:
    """Adds lambda_self * sum_i KL(q_i || p_i) and its gradient (vfesim.gaussian.terms) from one kernel."""
    mu_q, mu_p = arrays["mu_q"], arrays["mu_p"]
    S = [arrays[k] for k in ("sigma_q", "sigma_p")]
    if cfg.jitter != 0.0:
        S = [x + cfg.jitter * np.eye(x.shape[-1], dtype=x.dtype) for x in S]
    lam = np.full(mu_q.shape[0], cfg.lambda_self, mu_q.dtype)
    kl, *g, ok = agent_cpu.self_kl(mu_q, S[0], mu_p, S[1], lam)
    if not ok.all():
        self_kl(mu_q, S[0], mu_p, S[1])  # raises the StateError naming the agent and the covariance
    terms["self"] = cfg.lambda_self * float(kl.sum(dtype=np.float64))
    for k, gk in zip(("mu_q", "sigma_q", "mu_p", "sigma_p"), g, strict=True):
        grads[k] += gk


def energy_and_gradient(arrays: dict, cfg) -> tuple[dict, dict]:
    """Terms and gradients (SPEC §2.2–2.3) of NumPy arrays, per-agent and pairwise work in Numba kernels.

    The self term runs in agent_cpu.self_kl (the shared code sees lambda_self = 0): its batched NumPy
    Cholesky + two inv calls took ~1.5 ms of the ~7 ms at N = 64, K = 21.
    """
    terms, grads = energy_and_gradient_arrays(
        arrays,
        _without_self(cfg) if cfg.lambda_self > 0 else cfg,
        pairwise_dense=pairwise_dense,
        pairwise_sparse=pairwise_sparse,
        agent_ops=AGENT_OPS,
    )
    if cfg.lambda_self > 0:
        _self_term(arrays, cfg, terms, grads)
        terms["total"] = sum(terms[k] for k in TERMS)
    return terms, grads
