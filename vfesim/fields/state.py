"""The field state Dataset: schema, constructors and validation.

Dims: ``agent``, the grid dims ``x`` (and ``y``) with coordinates, ``latent``, ``latent_b``, ``gauge``
(= 3), ``obs_dim``. Variables: ``mu_q, mu_p`` (agent, *grid, latent); ``sigma_q, sigma_p`` (agent, *grid,
latent, latent_b); ``phi`` (agent, *grid, gauge); ``support`` (agent, *grid), chi_i(c) in [0, 1];
optional ``obs`` (agent, *grid, obs_dim).

Every field must be a valid point-agent value at every grid point, inside the support or not: points
outside a support (chi = 0) carry no weight in the energy and are never evaluated there, so no sentinel
values are needed (or used) to exclude them.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping

import numpy as np
import xarray as xr

from ..gaussian import state as point_state
from ..gaussian.state import ATTRIBUTES as _GAUSSIAN_ATTRIBUTES
from ..schema import attrs_of
from ..state import StateError, state_dataset
from . import supports as sup
from .config import FieldConfig

__all__ = ["VARIABLES", "REQUIRED", "variables", "make_state", "random_state", "validate_state"]

POINT_VARIABLES = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi", "obs")
REQUIRED = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi", "support")
_TAIL = {
    "mu_q": ("latent",),
    "sigma_q": ("latent", "latent_b"),
    "mu_p": ("latent",),
    "sigma_p": ("latent", "latent_b"),
    "phi": ("gauge",),
    "support": (),
    "obs": ("obs_dim",),
}


def variables(cfg_or_ndim: FieldConfig | int) -> dict[str, tuple[str, ...]]:
    """Variable -> dims for a config's grid (or a number of grid dims, 1 or 2)."""
    ndim = cfg_or_ndim if isinstance(cfg_or_ndim, int) else cfg_or_ndim.ndim
    grid = ("x", "y")[:ndim]
    return {k: ("agent", *grid, *tail) for k, tail in _TAIL.items()}


# The schema of the family record: 2-D grids (1-D grids drop "y"; see variables()).
VARIABLES = variables(2)
# Attributes (docs/outputs.md): the point-agent variables' (now fields over the grid) and the support.
ATTRIBUTES = {
    **_GAUSSIAN_ATTRIBUTES,
    "support": {"long_name": "support chi_i of the agent over the grid", "units": "1"},
}


def make_state(
    cfg: FieldConfig, mu_q, sigma_q, mu_p, sigma_p, phi, support, obs=None, *, validate: bool = True
) -> xr.Dataset:
    """Wrap arrays into the field state Dataset (grid coordinates from ``cfg``); attrs carry the family,
    config JSON, version and dtype."""
    data = {
        "mu_q": mu_q,
        "sigma_q": sigma_q,
        "mu_p": mu_p,
        "sigma_p": sigma_p,
        "phi": phi,
        "support": support,
    }
    if obs is not None:
        data["obs"] = obs
    if validate:  # on the arrays first: a shape error names the variable, not an xarray dim clash
        validate_state(data, cfg)
    ds = state_dataset("field", variables(cfg), data, cfg, mu_q.dtype, ATTRIBUTES)
    if tuple(ds.sizes[d] for d in cfg.grid_dims) == cfg.grid:
        ds = ds.assign_coords({d: (d, v, attrs_of(d)) for d, v in cfg.coords().items()})
    return ds


def random_state(
    cfg: FieldConfig,
    n_agents: int,
    seed: int = 0,
    dtype: str | None = None,
    *,
    support="bump",
    placement="random",
    area: float | None = None,
    sigma: float | None = None,
    radius: float | None = None,
    constant: bool = False,
    **point_options,
) -> xr.Dataset:
    """A reproducible random field population.

    Field values: independent draws per (agent, grid point) of :func:`vfesim.gaussian.state.random_state`
    (``point_options``: mu_scale, eig_range, phi_radius, ...). support: "bump" (Gaussian bumps, cut to 0
    beyond 3 sigma; ``area`` (default: twice the grid's area per agent) or ``sigma``), "disc" (``radius``,
    default from the same area), "full" (chi = 1 everywhere) or an array ``(n_agents, *grid)``.
    placement of bump and disc centres: "random", "lattice" or an array (n_agents, ndim).
    constant: one draw per agent (:func:`vfesim.gaussian.state.random_state` of ``n_agents`` point
    agents), the same at every grid point: fields constant over the grid.
    """
    if isinstance(n_agents, bool) or not isinstance(n_agents, (int, np.integer)) or n_agents < 1:
        raise StateError("n_agents", f"must be a positive integer, got {n_agents!r}")
    if not cfg.dense and cfg.neighbours.n_agents != n_agents:
        raise StateError(
            "agent", f"config has sparse neighbours for {cfg.neighbours.n_agents} agents, not {n_agents}"
        )
    P = 1 if constant else cfg.n_points
    point_cfg = cfg.point.replace(neighbours="dense")
    pts = point_state.random_state(point_cfg, n_agents * P, seed, dtype or cfg.dtype, **point_options)
    dt = pts["mu_q"].dtype
    shape = lambda k: (n_agents, *cfg.grid, *pts[k].shape[1:])
    if constant:
        grid1 = (1,) * cfg.ndim
        arrays = {
            k: np.broadcast_to(pts[k].data.reshape(n_agents, *grid1, *pts[k].shape[1:]), shape(k)).copy()
            for k in pts.data_vars
        }
    else:
        arrays = {k: pts[k].data.reshape(shape(k)) for k in pts.data_vars}
    chi = _random_support(cfg, n_agents, seed, support, placement, area, sigma, radius)
    return make_state(cfg, *(arrays[k] for k in POINT_VARIABLES[:5]), chi.astype(dt), arrays.get("obs"))


def _random_support(cfg, n, seed, support, placement, area, sigma, radius) -> np.ndarray:
    if not isinstance(support, str):
        chi = np.asarray(support, dtype=np.float64)
        if chi.shape != (n, *cfg.grid):
            raise StateError("support", f"shape must be {(n, *cfg.grid)}, got {chi.shape}")
        return chi
    if support == "full":
        return np.ones((n, *cfg.grid))
    if support not in ("bump", "disc"):
        raise StateError("support", f"must be 'bump', 'disc', 'full' or an array, got {support!r}")
    if isinstance(placement, str):
        if placement == "random":
            centres = sup.random_centres(cfg, n, np.random.default_rng((seed, 14)))
        elif placement == "lattice":
            centres = sup.lattice_centres(cfg, n)
        else:
            raise StateError(
                "support", f"placement must be 'random', 'lattice' or centres, got {placement!r}"
            )
    else:
        centres = placement
    if area is None and sigma is None and radius is None:
        area = 2.0 * cfg.n_points * cfg.spacing**cfg.ndim / n
    if support == "disc":
        return sup.discs(cfg, centres, radius if radius is not None else sup.radius_from_area(cfg, area))
    return sup.gaussian_bumps(cfg, centres, area=area, sigma=sigma)


def _where(cfg_grid: tuple[int, ...], P: int, row: int) -> tuple[int, str]:
    """(agent, "x=.., y=..") of a row of the flattened (agent, point) batch."""
    pt = np.unravel_index(row % P, cfg_grid)
    names = ("x", "y")[: len(cfg_grid)]
    return row // P, ", ".join(f"{d}={int(v)}" for d, v in zip(names, pt, strict=True))


def validate_state(
    state: xr.Dataset | Mapping, cfg: FieldConfig, *, check_spd: bool = True, conditioning: str = "exact"
) -> None:
    """Raise :class:`StateError` naming the variable, agent and grid point for the first problem found.

    Checks presence, dims and shapes (the config's grid), one float dtype, supports finite in [0, 1] and
    not zero everywhere, and at every grid point the checks of the point-agent state
    (:func:`vfesim.gaussian.state.validate_state`: finiteness, magnitudes, SPD, conditioning).
    """
    is_ds = isinstance(state, xr.Dataset)
    get = (lambda k: state[k].data) if is_ds else (lambda k: state[k])
    names = set(state.data_vars) if is_ds else set(state)
    dims = variables(cfg)
    for k in REQUIRED:
        if k not in names:
            raise StateError(k, "missing from the state")
    unknown = names - set(dims)
    if unknown:
        raise StateError(sorted(unknown)[0], f"unknown state variable (known: {list(dims)})")
    if cfg.obs_dim and "obs" not in names:
        raise StateError("obs", "the config has an observation model but the state has no obs")
    mu = get("mu_q")
    n = mu.shape[0] if mu.ndim else 0
    if n == 0:
        raise StateError("agent", "the state has no agents")
    tails = {"latent": cfg.K, "latent_b": cfg.K, "gauge": 3, "obs_dim": cfg.obs_dim}
    dtype = np.dtype(mu.dtype)
    if dtype not in (np.float32, np.float64):
        raise StateError("mu_q", f"dtype must be float32 or float64, got {dtype}")
    for k in sorted(names, key=list(dims).index):
        a = get(k)
        if is_ds and state[k].dims != dims[k]:
            raise StateError(k, f"dims must be {dims[k]}, got {state[k].dims}")
        expect = (n, *cfg.grid, *(tails[d] for d in _TAIL[k]))
        if tuple(a.shape) != expect:
            raise StateError(
                k, f"shape must be {expect} (agents={n}, grid={cfg.grid}, K={cfg.K}), got {tuple(a.shape)}"
            )
        if np.dtype(a.dtype) != dtype:
            raise StateError(k, f"dtype {a.dtype} differs from mu_q's {dtype}")
    if not cfg.dense and cfg.neighbours.n_agents != n:
        raise StateError(
            "agent",
            f"config has sparse neighbours for {cfg.neighbours.n_agents} agents but the state has {n}",
        )
    chi = get("support")
    chi = np.asarray(chi if isinstance(chi, np.ndarray) else chi.get()).reshape(n, -1)  # CuPy: to host
    bad = ~((chi >= 0) & (chi <= 1)).all(axis=1)  # NaN compares False
    if bad.any():
        i = int(np.argmax(bad))
        j = int(np.argmax(~((chi[i] >= 0) & (chi[i] <= 1))))
        _, where = _where(cfg.grid, chi.shape[1], i * chi.shape[1] + j)
        raise StateError("support", f"at grid point ({where}): must lie in [0, 1], got {chi[i, j]}", agent=i)
    empty = ~(chi > 0).any(axis=1)
    if empty.any():
        raise StateError(
            "support", "is zero everywhere (the agent has no support)", agent=int(np.argmax(empty))
        )
    # Every grid point as a point agent: the checks of the point-agent state, errors mapped back.
    P = cfg.n_points
    flat = {k: get(k).reshape(n * P, *get(k).shape[1 + cfg.ndim :]) for k in names if k != "support"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            point_state.validate_state(
                flat, cfg.point.replace(neighbours="dense"), check_spd=check_spd, conditioning=conditioning
            )
        except StateError as e:
            raise _field_error(e, cfg.grid, P) from None
    for w in caught:
        warnings.warn(_relabel(str(w.message), cfg.grid, P), w.category, stacklevel=2)


def _relabel(message: str, grid: tuple[int, ...], P: int) -> str:
    """Replace "[agent=ROW]" of a flattened (agent, point) row by "[agent=i, x=.., y=..]"."""

    def sub(m):
        a, where = _where(grid, P, int(m.group(1)))
        return f"[agent={a}, {where}]"

    return re.sub(r"\[agent=(\d+)\]", sub, message)


def _field_error(e: StateError, grid: tuple[int, ...], P: int) -> StateError:
    if e.agent is None:
        return StateError(e.variable, str(e)[len(e.variable) + 2 :])
    prefix = f"{e.variable}[agent={e.agent}]: "
    a, where = _where(grid, P, e.agent)
    return StateError(e.variable, f"at grid point ({where}): {str(e)[len(prefix) :]}", agent=a)
