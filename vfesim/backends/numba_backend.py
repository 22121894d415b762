"""Numba backend: per-agent and pairwise stages as Numba CPU kernels (SPEC §2.3–2.4).

Arrays stay NumPy arrays on the host. The per-agent stages (frames, features, their adjoint, dF/dphi)
run in :mod:`vfesim_kernels.agent_cpu` through :class:`~vfesim.gaussian.energy.AgentOps`; the pairwise
part in :mod:`vfesim_kernels.pairwise_cpu` (parallel over receiver / sender blocks, deterministic, no
N x N array). Thread count: Numba's (``NUMBA_NUM_THREADS`` or ``numba.set_num_threads``).
"""

from __future__ import annotations

import numpy as np
from vfesim_kernels import agent_cpu
from vfesim_kernels.pairwise_cpu import pairwise_dense, pairwise_sparse

from ..gaussian.energy import AgentOps, energy_and_gradient_arrays
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


def _self_kl(mu_q, sigma_q, mu_p, sigma_p, lam: float):
    """lam * KL(q_i || p_i) per agent and its gradient in one kernel. The batched NumPy Cholesky and two
    inv calls it replaces took ~1.5 ms of ~7 ms at N = 64, K = 21. Where a covariance is not positive
    definite the NumPy code runs to raise the StateError naming the agent and the covariance."""
    kl, *g, ok = agent_cpu.self_kl(mu_q, sigma_q, mu_p, sigma_p, np.full(mu_q.shape[0], lam, mu_q.dtype))
    if not ok.all():
        self_kl(mu_q, sigma_q, mu_p, sigma_p)
    return (kl, *g)


AGENT_OPS = AgentOps(_frames, _features, agent_cpu.features_vjp, agent_cpu.phi_grad, _self_kl)


def energy_and_gradient(arrays: dict, cfg) -> tuple[dict, dict]:
    """Terms and gradients (SPEC §2.2–2.3) of NumPy arrays, per-agent and pairwise work in Numba kernels."""
    return energy_and_gradient_arrays(
        arrays, cfg, pairwise_dense=pairwise_dense, pairwise_sparse=pairwise_sparse, agent_ops=AGENT_OPS
    )
