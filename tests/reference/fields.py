"""Slow, obviously-correct loop oracle for the field free energy (vfesim.fields.energy).

Float64 only. A direct loop over grid points, agents and pairs: frames by ``scipy.linalg.expm``, every
transport ``Omega_ij = R_i R_j^T`` formed explicitly, every KL by ``inv``/``slogdet`` (the point-agent
oracle's helpers, :mod:`reference.loop`). Only the config and the state Dataset come from vfesim.

At a grid point c the agents with chi_i(c) > 0 are present; receiver i's softmax runs over its present
neighbours; pair weights chi_i chi_j multiply outside it:
  "expected": chi_i sum_j chi_j beta_ij KL_ij;  "softmin": chi_i (sum_j chi_j beta_ij) softmin_j(KL_ij).
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from .loop import aggregate, frame, kl_gauss, so3_generators

__all__ = ["reference_neighbours", "reference_field_energy", "reference_field_attention"]


def _arrays(state: xr.Dataset, cfg) -> dict:
    out = {k: np.array(state[k].data, dtype=np.float64) for k in state.data_vars}
    for k in ("sigma_q", "sigma_p"):
        out[k] = out[k] + cfg.jitter * np.eye(cfg.K)
    return out


def reference_neighbours(support: np.ndarray, cfg) -> list[list[int]]:
    """N(i) by its definition: overlap (max over points of chi_i chi_j >= threshold), all, or the list."""
    n = support.shape[0]
    if not isinstance(cfg.neighbours, str):
        idx, mask = np.asarray(cfg.neighbours.index), np.asarray(cfg.neighbours.mask)
        return [[int(idx[i, k]) for k in range(idx.shape[1]) if mask[i, k]] for i in range(n)]
    out = []
    for i in range(n):
        row = []
        for j in range(n):
            if j == i:
                continue
            if cfg.neighbours == "dense":
                row.append(j)
                continue
            peak = max(float(support[i][pt] * support[j][pt]) for pt in np.ndindex(support.shape[1:]))
            if peak >= cfg.overlap_threshold:
                row.append(j)
        out.append(row)
    return out


def _weight(cfg) -> float:
    if cfg.cell_volume == "sum":
        return 1.0
    if cfg.cell_volume == "grid":
        return cfg.spacing ** len(cfg.grid)
    return float(cfg.cell_volume)


def _pair_kls(a, i, js, pt, kmu, ksig, G):
    Ri = frame(a["phi"][(i, *pt)], G)
    kls = []
    for j in js:
        Omega = Ri @ frame(a["phi"][(j, *pt)], G).T
        mj, Sj = a[kmu][(j, *pt)], a[ksig][(j, *pt)]
        kls.append(kl_gauss(a[kmu][(i, *pt)], a[ksig][(i, *pt)], Omega @ mj, Omega @ Sj @ Omega.T))
    return np.array(kls)


def _softmax(kls: np.ndarray, kappa: float) -> np.ndarray:
    e = np.exp(-(kls - kls.min()) / kappa)
    return e / e.sum()


def reference_field_attention(state: xr.Dataset, cfg, which: str = "belief") -> np.ndarray:
    """beta (N, *grid, N): beta[i, c, j], 0 off the present neighbours."""
    a = _arrays(state, cfg)
    chi = a["support"]
    n, grid = chi.shape[0], chi.shape[1:]
    G = so3_generators(cfg.irreps)
    nbrs = reference_neighbours(chi, cfg)
    kmu, ksig, kappa = (
        ("mu_q", "sigma_q", cfg.kappa_beta) if which == "belief" else ("mu_p", "sigma_p", cfg.kappa_gamma)
    )
    out = np.zeros((n, *grid, n))
    for pt in np.ndindex(grid):
        for i in range(n):
            js = [j for j in nbrs[i] if chi[(j, *pt)] > 0]
            if chi[(i, *pt)] > 0 and js:
                out[(i, *pt)][js] = _softmax(_pair_kls(a, i, js, pt, kmu, ksig, G), kappa)
    return out


def reference_field_energy(state: xr.Dataset, cfg) -> dict:
    """Every term of the field free energy (times its lambda) and "total", as Python floats."""
    a = _arrays(state, cfg)
    chi = a["support"]
    n, grid = chi.shape[0], chi.shape[1:]
    w = _weight(cfg)
    G = so3_generators(cfg.irreps)
    nbrs = reference_neighbours(chi, cfg)
    self_e = obs_e = 0.0
    align = {"mu_q": 0.0, "mu_p": 0.0}
    kappas = {"mu_q": cfg.kappa_beta, "mu_p": cfg.kappa_gamma}
    for pt in np.ndindex(grid):
        for i in range(n):
            ci = chi[(i, *pt)]
            if ci <= 0:
                continue
            at = (i, *pt)
            self_e += w * ci * kl_gauss(a["mu_q"][at], a["sigma_q"][at], a["mu_p"][at], a["sigma_p"][at])
            if cfg.W is not None:
                W, Rn = np.asarray(cfg.W), np.asarray(cfg.R)
                r = a["obs"][at] - W @ a["mu_q"][at]
                obs_e += (
                    w
                    * ci
                    * 0.5
                    * (
                        W.shape[0] * math.log(2 * math.pi)
                        + np.linalg.slogdet(Rn)[1]
                        + np.trace(np.linalg.inv(Rn) @ W @ a["sigma_q"][at] @ W.T)
                        + r @ np.linalg.inv(Rn) @ r
                    )
                )
            js = [j for j in nbrs[i] if chi[(j, *pt)] > 0]
            if not js:
                continue
            cj = np.array([chi[(j, *pt)] for j in js])
            for kmu, ksig in (("mu_q", "sigma_q"), ("mu_p", "sigma_p")):
                kls = _pair_kls(a, i, js, pt, kmu, ksig, G)
                beta = _softmax(kls, kappas[kmu])
                if cfg.aggregator == "expected":
                    align[kmu] += w * ci * float(np.sum(cj * beta * kls))
                else:
                    align[kmu] += w * ci * float(np.sum(cj * beta)) * aggregate(kls, kappas[kmu], "softmin")
    smooth = 0.0
    for pt in np.ndindex(grid):
        for d in range(len(grid)):
            nxt = list(pt)
            nxt[d] += 1
            if nxt[d] == grid[d]:
                if cfg.boundary == "bounded":
                    continue
                nxt[d] = 0
            for i in range(n):
                if chi[(i, *pt)] > 0 and chi[(i, *nxt)] > 0:
                    diff = (a["phi"][(i, *nxt)] - a["phi"][(i, *pt)]) / cfg.spacing
                    smooth += w * chi[(i, *pt)] * float(diff @ diff)
    terms = {
        "self": cfg.lambda_self * self_e,
        "belief_align": cfg.lambda_belief * align["mu_q"],
        "prior_align": cfg.lambda_prior * align["mu_p"],
        "observation": cfg.lambda_obs * obs_e,
        "gauge_smoothness": cfg.lambda_phi * smooth,
    }
    terms["total"] = sum(terms.values())
    return terms
