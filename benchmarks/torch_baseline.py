"""Baseline: a straightforward PyTorch autograd implementation of the free energy of SPEC §2.2.

It materialises every transport Omega_ij = R_i R_j^T as an (N, N, K, K) tensor, the transported beliefs
Omega_ij q_j, their inverses and log-determinants, and lets autograd produce the gradient. This is what
the cuda backend is compared against (benchmarks/bench_gpu.py). PyTorch is not a dependency of vfesim:
only this script imports it.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def frames(phi: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """R_i = exp(phi_i . G): (N, 3), (3, K, K) -> (N, K, K)."""
    return torch.linalg.matrix_exp(torch.einsum("na,akl->nkl", phi, G))


def kl_gauss(mu_a, S_a, mu_b, S_b):
    """KL(N(mu_a, S_a) || N(mu_b, S_b)) over broadcast batches; mu (..., K), S (..., K, K)."""
    K = mu_a.shape[-1]
    Sb_inv = torch.linalg.inv(S_b)
    d = (mu_b - mu_a).unsqueeze(-1)
    tr = torch.einsum("...kl,...lk->...", Sb_inv, S_a)
    quad = (d.transpose(-1, -2) @ Sb_inv @ d)[..., 0, 0]
    return 0.5 * (tr + quad - K + torch.logdet(S_b) - torch.logdet(S_a))


def alignment(mu, S, R, kappa: float, aggregator: str):
    """sum_i A_kappa({KL(q_i || Omega_ij q_j)}_{j != i}) with dense (N, N, K, K) transports."""
    N = mu.shape[0]
    Omega = R[:, None] @ R.transpose(-1, -2)[None, :]  # (N, N, K, K)
    mu_t = (Omega @ mu[None, :, :, None])[..., 0]  # Omega_ij mu_j
    S_t = Omega @ S[None] @ Omega.transpose(-1, -2)  # Omega_ij S_j Omega_ij^T
    KL = kl_gauss(mu[:, None], S[:, None], mu_t, S_t)  # (N, N)
    eye = torch.eye(N, dtype=torch.bool, device=mu.device)
    logits = (-KL / kappa).masked_fill(eye, -math.inf)
    if aggregator == "softmin":
        return (-kappa * torch.logsumexp(logits, dim=1)).sum()
    beta = torch.softmax(logits, dim=1)
    return (beta * KL.masked_fill(eye, 0.0)).sum()


def energy(arrays: dict, G: torch.Tensor, cfg) -> torch.Tensor:
    """Total free energy (self + belief + prior alignment; no observation term) as a torch scalar."""
    R = frames(arrays["phi"], G)
    F = cfg.lambda_self * kl_gauss(arrays["mu_q"], arrays["sigma_q"], arrays["mu_p"], arrays["sigma_p"]).sum()
    if cfg.lambda_belief > 0:
        F = F + cfg.lambda_belief * alignment(
            arrays["mu_q"], arrays["sigma_q"], R, cfg.kappa_beta, cfg.aggregator
        )
    if cfg.lambda_prior > 0:
        F = F + cfg.lambda_prior * alignment(
            arrays["mu_p"], arrays["sigma_p"], R, cfg.kappa_gamma, cfg.aggregator
        )
    return F


def energy_and_gradient(arrays: dict, G: torch.Tensor, cfg) -> tuple[float, dict]:
    """(F, dF/dx for every array) by autograd. arrays: torch tensors on one device."""
    x = {k: v.detach().clone().requires_grad_(True) for k, v in arrays.items()}
    F = energy(x, G, cfg)
    grads = torch.autograd.grad(F, list(x.values()))
    # Covariance gradients as the symmetric G with dF = tr(G dSigma), as vfesim reports them.
    out = {}
    for (k, _), g in zip(x.items(), grads, strict=True):
        out[k] = 0.5 * (g + g.transpose(-1, -2)) if k.startswith("sigma") else g
    return float(F.detach()), out


def from_numpy(arrays: dict, device: str = "cuda") -> dict:
    return {k: torch.as_tensor(np.ascontiguousarray(v), device=device) for k, v in arrays.items()}
