"""The field free energy and its exact gradient: every point-agent term evaluated pointwise and summed
over the grid, with the grid as a batch axis of the point-agent stages.

With w the cell volume (:attr:`FieldConfig.weight`), chi_i the supports and N(i) the neighbour lists
(:func:`vfesim.fields.supports.neighbour_lists`)::

    F = lambda_self sum_c w sum_i chi_i KL(q_i || p_i)
      + lambda_beta sum_c w sum_i chi_i Agg_j(chi_j, {KL(q_i || Omega_ij q_j)}_j)        (same for priors)
      + lambda_obs  sum_c w sum_i chi_i E_q_i[-log N(o_i; W z, R)]
      + lambda_phi  sum_c w sum_i chi_i sum_d |phi_i(c + e_d) - phi_i(c)|^2 / h^2

all fields taken at the grid point c. At c the population is the agents whose support covers c
(chi > 0): the attention softmax of receiver i runs over j in N(i) covering c, and the pair weights
chi_i chi_j multiply outside it (:mod:`vfesim.pairwise.weighted`: "expected": sum_j chi_j beta_ij KL_ij;
"softmin": (sum_j chi_j beta_ij) (-kappa log sum_j e^(-KL_ij/kappa))). Points outside a support are
excluded by weight and never evaluated: no term, no gradient there (their field values are unused).
The smoothness differences are forward differences (spacing h), wrapped on a periodic grid, omitted
past a bounded grid's edge, and counted only where both points are covered.

Gradient with respect to the support: exact where chi > 0. Where chi = 0 it is 0: there the energy is
not differentiable in chi (an agent joins the softmax at a point its support comes to cover); it is the
gradient with the covered sets held fixed.

Stages: the covered (point, agent) pairs form one batch of point agents (point-major rows), run through
the Gaussian per-agent stages (:class:`~vfesim.gaussian.energy.AgentOps`: a backend's kernels, or the
array-generic NumPy/CuPy ones); the pairs run through the backend's weighted pairs batched over points
(``pairwise_points``, the contract of :func:`vfesim.pairwise.weighted.pairwise_points_weighted`: NumPy
block of points by block of points, Numba CPU and CUDA kernels). Memory O(N P D + block), never N x N x P.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..arrays import array_module as _xp
from ..arrays import host_array, total
from ..gaussian.energy import NUMPY_AGENT_OPS, AgentOps, _with_jitter
from ..gaussian.terms import observation, observation_vjp
from ..groups import generators
from ..pairwise.weighted import pairwise_points_weighted
from .config import FieldConfig
from .supports import neighbour_lists

__all__ = [
    "TERMS",
    "BACKENDS",
    "Layout",
    "layout",
    "energy_and_gradient",
    "energy_and_gradient_arrays",
    "attention",
    "gauge_smoothness",
]

TERMS = ("self", "belief_align", "prior_align", "observation", "gauge_smoothness")
BACKENDS = ("numpy", "numba", "cuda", "dask")


class Layout(NamedTuple):
    """The covered (point, agent) pairs as a batch of point agents, point-major (host NumPy arrays).

    point, agent: (M,) of each row; rowmap (P, N): the row of a pair, -1 where not covered; offsets
    (P + 1,): rows of point p are offsets[p]:offsets[p+1].
    """

    point: np.ndarray
    agent: np.ndarray
    rowmap: np.ndarray
    offsets: np.ndarray


def layout(chi) -> Layout:
    """chi (N, P) (host or device) -> the Layout of its covered pairs (chi > 0)."""
    cov = np.asarray(host_array(chi) > 0).T  # (P, N)
    P, N = cov.shape
    rows = np.flatnonzero(cov.ravel())
    rowmap = np.full(P * N, -1, np.int64)
    rowmap[rows] = np.arange(rows.size)
    offsets = np.concatenate([[0], np.cumsum(cov.sum(axis=1))]).astype(np.int64)
    return Layout(rows // N, rows % N, rowmap.reshape(P, N), offsets)


def _to_rows(a, idx, N: int, P: int, gnd: int):
    """(N, *grid, *tail) -> covered rows (M, *tail); idx: agent * P + point of the rows, on a's device."""
    return a.reshape(N * P, *a.shape[1 + gnd :])[idx]


def _from_rows(g, idx, N: int, grid: tuple[int, ...]):
    """Covered rows (M, *tail) -> (N, *grid, *tail), zero where not covered."""
    P = int(np.prod(grid))
    full = _xp(g).zeros((N * P, *g.shape[1:]), g.dtype)
    full[idx] = g
    return full.reshape(N, *grid, *g.shape[1:])


def gauge_smoothness(phi, chi, cfg: FieldConfig):
    """``sum_i sum_c w chi_i sum_d |phi_i(c + e_d) - phi_i(c)|^2 / h^2`` over edges with both ends covered:
    phi ``(N, *grid, 3)``, chi ``(N, *grid)`` -> (E, g_phi, g_chi). NumPy or CuPy arrays."""
    xp = _xp(phi)
    h, w = cfg.spacing, cfg.weight
    cov = chi > 0
    g_phi = xp.zeros_like(phi)
    g_chi = xp.zeros_like(chi)
    E = 0.0
    for d in range(cfg.ndim):
        ax = 1 + d
        diff = (xp.roll(phi, -1, axis=ax) - phi) / h
        edge = cov & xp.roll(cov, -1, axis=ax)
        if cfg.boundary == "bounded":
            last = [slice(None)] * chi.ndim
            last[ax] = -1
            edge[tuple(last)] = False
        sq = xp.where(edge, (diff * diff).sum(axis=-1), 0.0)
        E += total(w * chi * sq)
        g_chi += w * sq
        gd = xp.where(edge, 2.0 * w * chi, 0.0)[..., None] * diff / h  # dE/d(phi(c + e_d)), = -dE/d(phi(c))
        g_phi += xp.roll(gd, 1, axis=ax) - gd
    return E, g_phi, g_chi


def energy_and_gradient_arrays(
    arrays: dict[str, Any],
    cfg: FieldConfig,
    *,
    agent_ops: AgentOps = NUMPY_AGENT_OPS,
    neighbours=None,
    pairwise_points: Callable = pairwise_points_weighted,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Energy terms and the gradient of ``terms["total"]`` for raw arrays (no validation).

    arrays: the field state's variables ``(agent, *grid, ...)``, NumPy or CuPy. neighbours: (index, mask)
    host arrays (default: from the support and ``cfg``, :func:`~vfesim.fields.supports.neighbour_lists`).
    agent_ops: the per-agent stages of point agents, run on the covered (point, agent) batch.
    pairwise_points: the weighted pairs batched over points (the contract of
    :func:`vfesim.pairwise.weighted.pairwise_points_weighted`: a backend's kernels, or NumPy).
    """
    ops = agent_ops
    mu_q = arrays["mu_q"]
    xp = _xp(mu_q)
    N, grid, gnd = mu_q.shape[0], tuple(mu_q.shape[1:-1]), mu_q.ndim - 2
    P = int(np.prod(grid))
    chi = arrays["support"]
    lay = layout(chi.reshape(N, P))
    idx = xp.asarray(lay.agent * P + lay.point)
    rows = lambda k: _to_rows(arrays[k], idx, N, P, gnd)
    a = {k: rows(k) for k in arrays if k != "support"}
    chi_r = rows("support")
    S = {k: _with_jitter(a[k], cfg.jitter) for k in ("sigma_q", "sigma_p")}
    g = {k: xp.zeros_like(v) for k, v in a.items()}
    g_chi = xp.zeros_like(chi_r)
    w = cfg.weight
    terms = dict.fromkeys(TERMS, 0.0)

    if cfg.lambda_self > 0:
        kl, *gk = ops.self_kl(a["mu_q"], S["sigma_q"], a["mu_p"], S["sigma_p"], 1.0)
        wt = (cfg.lambda_self * w) * chi_r
        terms["self"] = total(wt * kl)
        for k, gv in zip(("mu_q", "sigma_q", "mu_p", "sigma_p"), gk, strict=True):
            g[k] += wt.reshape(-1, *[1] * (gv.ndim - 1)) * gv
        g_chi += (cfg.lambda_self * w) * kl

    if cfg.lambda_obs > 0:
        dt = mu_q.dtype
        e, cache = observation(
            a["mu_q"], S["sigma_q"], a["obs"], xp.asarray(cfg.W, dt), xp.asarray(cfg.R, dt)
        )
        wt = (cfg.lambda_obs * w) * chi_r
        terms["observation"] = total(wt * e)
        g_mu, g_sigma, g_obs = observation_vjp(wt, cache)
        g["mu_q"] += g_mu
        g["sigma_q"] += g_sigma
        g["obs"] += g_obs
        g_chi += (cfg.lambda_obs * w) * e

    active = [
        (name, lam, kappa, kmu, ksig)
        for name, lam, kappa, kmu, ksig in (
            ("belief_align", cfg.lambda_belief, cfg.kappa_beta, "mu_q", "sigma_q"),
            ("prior_align", cfg.lambda_prior, cfg.kappa_gamma, "mu_p", "sigma_p"),
        )
        if lam > 0
    ]
    if active:
        index, mask = neighbour_lists(chi, cfg) if neighbours is None else neighbours
        R = ops.frames(a["phi"], cfg.irreps)
        g_R = xp.zeros_like(R)
        for name, lam, kappa, kmu, ksig in active:
            A, B, c, cache = ops.features(a[kmu], S[ksig], R, ksig)
            E, gA, gB, gc, gu, gv = pairwise_points(
                A, B, c, chi_r, chi_r, lay.offsets, lay.agent, lay.rowmap, index, mask, kappa, cfg.aggregator
            )
            s = lam * w
            terms[name] = s * E
            g_mu, g_sigma, g_Rk = ops.features_vjp(s * gA, s * gB, s * gc, cache)
            g[kmu] += g_mu
            g[ksig] += g_sigma
            g_R += g_Rk
            g_chi += s * (gu + gv)
        g["phi"] += ops.phi_grad(g_R, R, a["phi"], generators(cfg.irreps))

    grads = {k: _from_rows(v, idx, N, grid) for k, v in g.items()}
    grads["support"] = _from_rows(g_chi, idx, N, grid)
    if cfg.lambda_phi > 0:
        E, g_phi, gx = gauge_smoothness(arrays["phi"], chi, cfg)
        terms["gauge_smoothness"] = cfg.lambda_phi * E
        grads["phi"] += cfg.lambda_phi * g_phi
        grads["support"] += cfg.lambda_phi * gx
    terms["total"] = sum(terms[k] for k in TERMS)
    return terms, grads


def _agent_ops(backend) -> AgentOps:
    """The backend's point-agent stages where it has them as an AgentOps (numba's kernels), else the
    array-generic ones (NumPy or CuPy arrays)."""
    ops = backend.agent_ops.get("gaussian", NUMPY_AGENT_OPS)
    return ops if isinstance(ops, AgentOps) else NUMPY_AGENT_OPS


def energy_and_gradient(arrays: dict[str, Any], cfg: FieldConfig, backend) -> tuple[dict[str, float], dict]:
    """Terms and the gradient of ``terms["total"]`` with ``backend``'s point-agent stages ("numba": its
    CPU kernels; "numpy", "cuda": the array-generic ones on NumPy / CuPy arrays) and its weighted pairs
    batched over points (``backend.pairwise_points``)."""
    if backend.pairwise_points is None:
        raise ValueError(
            f"backend: {backend.name!r} has no pairs batched over grid points (pairwise_points) for field "
            f"agents; field agents run on {list(BACKENDS)}"
        )
    return energy_and_gradient_arrays(
        arrays, cfg, agent_ops=_agent_ops(backend), pairwise_points=backend.pairwise_points
    )


def attention(arrays: dict[str, Any], cfg: FieldConfig, which: str = "belief") -> np.ndarray:
    """Attention weights per grid point ``(N, *grid, k)``, aligned with ``neighbour_lists(support, cfg)``'s
    index; 0 where the receiver or the sender does not cover the point. NumPy arrays."""
    if which not in ("belief", "prior"):
        raise ValueError(f"which: must be 'belief' or 'prior', got {which!r}")
    kmu, ksig, kappa = (
        ("mu_q", "sigma_q", cfg.kappa_beta) if which == "belief" else ("mu_p", "sigma_p", cfg.kappa_gamma)
    )
    mu = arrays[kmu]
    N, grid, gnd = mu.shape[0], tuple(mu.shape[1:-1]), mu.ndim - 2
    P = int(np.prod(grid))
    chi = arrays["support"]
    lay = layout(chi.reshape(N, P))
    idx = lay.agent * P + lay.point
    index, mask = neighbour_lists(chi, cfg)
    rows = lambda k: _to_rows(arrays[k], idx, N, P, gnd)
    R = NUMPY_AGENT_OPS.frames(rows("phi"), cfg.irreps)
    A, B, c, _ = NUMPY_AGENT_OPS.features(rows(kmu), _with_jitter(rows(ksig), cfg.jitter), R, ksig)
    u = rows("support")
    out = pairwise_points_weighted(
        A,
        B,
        c,
        u,
        u,
        lay.offsets,
        lay.agent,
        lay.rowmap,
        index,
        mask,
        kappa,
        cfg.aggregator,
        return_beta=True,
    )
    return _from_rows(out[-1], idx, N, grid)
