"""Supports chi_i(c) in [0, 1] of field agents, and agent placement on the grid.

Distances are measured in coordinate units (``spacing`` per grid step); on a periodic grid they are
minimum-image distances on the ring or torus of length ``n * spacing`` per dim. Arrays are NumPy,
shaped (agent, *grid) (the neighbour lists also take CuPy supports).
"""

from __future__ import annotations

import math

import numpy as np

from ..arrays import array_module
from .config import FieldConfig

__all__ = [
    "distances",
    "radius_from_area",
    "gaussian_bumps",
    "discs",
    "random_centres",
    "lattice_centres",
    "overlap_neighbours",
    "neighbour_lists",
    "CUTOFF_SIGMAS",
]

# Gaussian bumps are cut to 0 beyond this many sigmas (the reference system's default).
CUTOFF_SIGMAS = 3.0


def _centres(cfg: FieldConfig, centres) -> np.ndarray:
    c = np.asarray(centres, dtype=np.float64)
    if c.ndim == 1 and cfg.ndim == 1:
        c = c[:, None]
    if c.ndim != 2 or c.shape[1] != cfg.ndim:
        raise ValueError(f"centres: must have shape (n_agents, {cfg.ndim}), got {c.shape}")
    if not np.isfinite(c).all():
        raise ValueError("centres: must be finite")
    return c


def distances(cfg: FieldConfig, centres) -> np.ndarray:
    """Distance from each centre (n, ndim) to every grid point: (n, *grid), minimum image on a periodic
    grid."""
    c = _centres(cfg, centres)
    sq = np.zeros((c.shape[0], *cfg.grid))
    for d, x in enumerate(cfg.coords().values()):
        diff = x[None, :] - c[:, d : d + 1]  # (n, n_d)
        if cfg.boundary == "periodic":
            length = cfg.grid[d] * cfg.spacing
            diff = diff - length * np.round(diff / length)
        shape = [c.shape[0]] + [1] * cfg.ndim
        shape[1 + d] = cfg.grid[d]
        sq = sq + (diff**2).reshape(shape)
    return np.sqrt(sq)


def radius_from_area(cfg: FieldConfig, area: float) -> float:
    """The radius of a ball of the given area (2-D: pi r^2) or length (1-D: 2 r), in coordinate units."""
    if not (area > 0 and math.isfinite(area)):
        raise ValueError(f"area: must be finite and > 0, got {area}")
    return math.sqrt(area / math.pi) if cfg.ndim == 2 else 0.5 * area


def gaussian_bumps(cfg: FieldConfig, centres, *, area: float | None = None, sigma: float | None = None):
    """chi_i(c) = exp(-|c - c_i|^2 / (2 sigma^2)), set to 0 beyond ``CUTOFF_SIGMAS`` sigma: (n, *grid).

    Give ``sigma``, or ``area`` (sigma = the radius of a ball of that area, :func:`radius_from_area`).
    """
    if (area is None) == (sigma is None):
        raise ValueError("gaussian_bumps: give exactly one of area and sigma")
    s = radius_from_area(cfg, area) if sigma is None else float(sigma)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"sigma: must be finite and > 0, got {sigma}")
    r = distances(cfg, centres)
    return np.where(r <= CUTOFF_SIGMAS * s, np.exp(-0.5 * (r / s) ** 2), 0.0)


def discs(cfg: FieldConfig, centres, radius: float) -> np.ndarray:
    """chi_i(c) = 1 within ``radius`` of the centre, else 0: (n, *grid)."""
    if not (radius > 0 and math.isfinite(radius)):
        raise ValueError(f"radius: must be finite and > 0, got {radius}")
    return (distances(cfg, centres) <= radius).astype(np.float64)


def random_centres(cfg: FieldConfig, n_agents: int, rng: np.random.Generator) -> np.ndarray:
    """Centres uniform over the grid's extent [0, n * spacing) per dim: (n_agents, ndim)."""
    extent = np.asarray(cfg.grid, np.float64) * cfg.spacing
    return rng.uniform(size=(n_agents, cfg.ndim)) * extent


def lattice_centres(cfg: FieldConfig, n_agents: int) -> np.ndarray:
    """Centres on a regular lattice (1-D: n evenly spaced; 2-D: a near-square a x b lattice, a b >= n,
    filled row by row), offset by half a cell: (n_agents, ndim)."""
    extent = np.asarray(cfg.grid, np.float64) * cfg.spacing
    if cfg.ndim == 1:
        return ((np.arange(n_agents) + 0.5) / n_agents * extent[0])[:, None]
    a = math.ceil(math.sqrt(n_agents))
    b = math.ceil(n_agents / a)
    k = np.arange(n_agents)
    return np.stack([(k // b + 0.5) / a * extent[0], (k % b + 0.5) / b * extent[1]], axis=1)


def overlap_neighbours(support, threshold: float) -> list[list[int]]:
    """N(i) = [j != i with max_c chi_i(c) chi_j(c) >= threshold], ascending: support (n, *grid), NumPy
    or CuPy (the peaks are computed where the support lives, one (n, n) transfer)."""
    xp = array_module(support)
    chi = xp.asarray(support, dtype=np.float64).reshape(support.shape[0], -1)
    n = chi.shape[0]
    peaks = xp.stack([(chi[i][None, :] * chi).max(axis=1) for i in range(n)])  # O(n P) at a time
    peaks = peaks if isinstance(peaks, np.ndarray) else peaks.get()
    out = []
    for i in range(n):
        peak = peaks[i].copy()
        peak[i] = -np.inf
        out.append([int(j) for j in np.flatnonzero(peak >= threshold)])
    return out


def neighbour_lists(support, cfg: FieldConfig) -> tuple[np.ndarray, np.ndarray]:
    """The neighbour lists of ``cfg`` for a support (n, *grid): (index (n, k), mask (n, k)), from the
    overlap rule, all pairs ("dense"), or the config's explicit list."""
    n = support.shape[0]
    if not cfg.dense:
        return cfg.neighbours.index, cfg.neighbours.mask
    if cfg.neighbours == "dense":
        lists = [[j for j in range(n) if j != i] for i in range(n)]
    else:
        lists = overlap_neighbours(support, cfg.overlap_threshold)
    width = max(1, max(len(row) for row in lists))
    index = np.zeros((n, width), np.int64)
    mask = np.zeros((n, width), bool)
    for i, row in enumerate(lists):
        index[i, : len(row)] = row
        mask[i, : len(row)] = True
    return index, mask
