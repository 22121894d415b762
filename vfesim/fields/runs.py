"""Field-agent runs from scenario files (issue 14 "Runs"): the family's scenario sections; the run loop
(:mod:`vfesim.simulate`) drives the shared integrators, so checkpoints and bitwise resume are the
Gaussian runs'.

Sections of a field scenario (the ``[field]`` section selects the family; every key is optional except
``field.K`` (or ``field.irreps``), ``field.grid``, ``population.n_agents`` and ``integrator.dt``)::

    [field]        FieldConfig fields: K, irreps, lambda_self, lambda_belief, lambda_prior, lambda_obs,
                   kappa_beta, kappa_gamma, aggregator, W, R, jitter, grid ([nx] or [nx, ny]),
                   boundary ("periodic" | "bounded"), spacing, overlap_threshold, cell_volume
                   ("sum" | "grid" | a number), lambda_phi
    [population]   n_agents, seed, support ("bump" | "disc" | "full"), placement ("random" |
                   "lattice"), area (bump or disc; default: twice the grid's area per agent), sigma
                   (bump), radius (disc), constant_fields (one draw per agent, the same at every grid
                   point; default false: independent draws per (agent, point)), mu_scale,
                   prior_mu_scale, eig_range, prior_eig_range, phi_radius, obs_scale, neighbours
                   ("overlap": supports overlapping by at least field.overlap_threshold, "dense" or
                   "ring" with half_width)
    [integrator]   method, dt, friction, options: as for Gaussian agents (every integrator)
    [run]          as for every run; dtype "float64" (default) or "float32"; backend "numpy", "numba",
                   "cuda" or "dask" (agent chunks, `run.chunks`)

Frames hold mu_q, sigma_q, mu_p, sigma_p and phi over (agent, x[, y], ...) with the grid coordinates;
the support is saved once. The built-in observables are support-weighted over the grid
(:data:`vfesim.observables.FAMILY_BUILTINS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import xarray as xr

from ..config import MODEL_DOCS, ConfigError, SparseNeighbours, scenario_bool, scenario_range, scenario_real
from .config import FieldConfig
from .state import random_state

__all__ = ["SECTION", "DEFAULTS", "validate", "config_dict", "initial_state", "make_integrator"]

SECTION = "field"
BACKENDS = ("numpy", "numba", "cuda", "dask")
RUN_DTYPES = ("float64", "float32")
SUPPORTS = ("bump", "disc", "full")
PLACEMENTS = ("random", "lattice")
NEIGHBOURS = ("overlap", "dense", "ring")

CONFIG = {f.name: f.default for f in dataclasses.fields(FieldConfig) if f.name not in ("dtype", "neighbours")}
# Keys whose check needs others (W, R: K; irreps sets K): checked with the whole section.
_JOINT = ("K", "irreps", "W", "R", "lambda_obs")
POPULATION = {
    "n_agents": None,
    "seed": 0,
    "support": "bump",
    "placement": "random",
    "area": None,
    "sigma": None,
    "radius": None,
    "constant_fields": False,
    "mu_scale": 1.0,
    "prior_mu_scale": None,
    "eig_range": (0.5, 2.0),
    "prior_eig_range": None,
    "phi_radius": 1.0,
    "obs_scale": 1.0,
    "neighbours": "overlap",
    "half_width": None,
}
# Population keys passed to vfesim.gaussian.state.random_state (the per-point draws).
POINT_OPTIONS = ("mu_scale", "prior_mu_scale", "eig_range", "prior_eig_range", "phi_radius")


def _int(key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ConfigError(key, f"must be an integer, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ConfigError(key, f"must be >= {lo}, got {v}")
    return int(v)


def _real(key: str, v: Any, lo: float = 0.0, strict: bool = False, hi: float | None = None) -> float:
    return scenario_real(key, v, lo, strict, hi)


_bool, _range = scenario_bool, scenario_range


def _plain(d: dict) -> dict:
    """TOML values as FieldConfig takes them (lists of grid and irreps as tuples)."""
    return {k: tuple(v) if k in ("grid", "irreps") and isinstance(v, list) else v for k, v in d.items()}


def _config_key(key: str, k: str, v: Any) -> None:
    """Check one [field] key on its own (with a stand-in K and grid where it is not the key)."""
    try:
        FieldConfig(**{"K": 3, "grid": (1,), **_plain({k: v})})
    except ConfigError as e:
        if e.key == k:
            raise ConfigError(key, str(e).split(": ", 1)[1]) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(key, f"invalid value {v!r} ({e})") from None


def _config(d: dict, pr, nb: Any, dtype: Any) -> Any:
    """The FieldConfig of ``[field]`` (neighbours ``nb`` from the population); BAD on a problem."""
    d = dict(d)
    for k, where in (("dtype", "run.dtype"), ("neighbours", "population.neighbours")):
        if k in d:
            pr.add(f"{SECTION}.{k}", f"set it in {where}")
            del d[k]
    sec = pr.unknown(SECTION, d, CONFIG)
    n_bad = len(pr.errors)
    if "K" not in sec and "irreps" not in sec:
        pr.add(f"{SECTION}.K", "is required (or field.irreps)")
    if "grid" not in sec:
        pr.add(f"{SECTION}.grid", "is required: [nx] or [nx, ny]")
    sec["aggregator"] = pr.choice(
        f"{SECTION}.aggregator", sec.get("aggregator", "expected"), ("expected", "softmin")
    )
    for k, v in sec.items():  # every key on its own: all problems at once
        if k not in _JOINT and k != "aggregator":
            pr.get(f"{SECTION}.{k}", _config_key, k, v)
    if len(pr.errors) > n_bad or pr.BAD in (dtype, nb):
        return pr.BAD
    try:
        return FieldConfig(**_plain(sec), neighbours=nb, dtype=dtype)
    except ConfigError as e:
        return pr.add(f"{SECTION}.{e.key}", str(e).split(": ", 1)[1])
    except (TypeError, ValueError) as e:
        return pr.add(SECTION, str(e))


def _population(d: dict, pr) -> dict:
    p = {**POPULATION, **pr.unknown("population", d, POPULATION)}
    if p["n_agents"] is None:
        p["n_agents"] = pr.add("population.n_agents", "is required")
    else:
        p["n_agents"] = pr.get("population.n_agents", _int, p["n_agents"], 1)
    n = p["n_agents"]
    p["seed"] = pr.get("population.seed", _int, p["seed"], 0)
    kind = p["support"] = pr.choice("population.support", p["support"], SUPPORTS)
    p["placement"] = pr.choice("population.placement", p["placement"], PLACEMENTS)
    shape_keys = {"bump": ("area", "sigma"), "disc": ("area", "radius"), "full": ()}
    for k in ("area", "sigma", "radius"):
        if p[k] is None:
            continue
        if kind is not pr.BAD and k not in shape_keys[kind]:
            p[k] = pr.add(
                f"population.{k}", f"not used with support = {kind!r} (it takes {shape_keys[kind]})"
            )
        else:
            p[k] = pr.get(f"population.{k}", _real, p[k], 0.0, strict=True)
    if kind is not pr.BAD:
        given = [k for k in shape_keys[kind] if p[k] is not None]
        if len(given) > 1:
            pr.add(f"population.{given[1]}", f"give at most one of {given} with support = {kind!r}")
    p["constant_fields"] = pr.get("population.constant_fields", _bool, p["constant_fields"])
    p["mu_scale"] = pr.get("population.mu_scale", _real, p["mu_scale"])
    p["phi_radius"] = pr.get("population.phi_radius", _real, p["phi_radius"], hi=np.pi)
    p["obs_scale"] = pr.get("population.obs_scale", _real, p["obs_scale"])
    p["eig_range"] = pr.get("population.eig_range", _range, p["eig_range"])
    if p["prior_mu_scale"] is not None:
        p["prior_mu_scale"] = pr.get("population.prior_mu_scale", _real, p["prior_mu_scale"])
    if p["prior_eig_range"] is not None:
        p["prior_eig_range"] = pr.get("population.prior_eig_range", _range, p["prior_eig_range"])
    nb = p["neighbours"] = pr.choice("population.neighbours", p["neighbours"], NEIGHBOURS)
    if p["half_width"] is None:
        if nb == "ring":
            p["half_width"] = pr.add("population.half_width", "is required with neighbours = 'ring'")
    elif nb != "ring":
        if nb is not pr.BAD:
            p["half_width"] = pr.add("population.half_width", "only valid with neighbours = 'ring'")
    else:
        hw = p["half_width"] = pr.get("population.half_width", _int, p["half_width"], 1)
        if pr.BAD not in (hw, n) and 2 * hw > n - 1:
            p["half_width"] = pr.add(
                "population.half_width", f"2*half_width must be <= n_agents-1 = {n - 1}, got {hw}"
            )
    return p


def neighbours(pop: dict) -> Any:
    """The population's neighbours: "overlap", "dense" or a SparseNeighbours ring."""
    if pop["neighbours"] == "ring":
        return SparseNeighbours.ring(pop["n_agents"], pop["half_width"])
    return pop["neighbours"]


def validate(sections: dict, dtype: Any, pr) -> tuple[Any, Any, Any]:
    """The family's sections (RunSpec.validate): (FieldConfig, population, integrator)."""
    from ..scenario import _integrator  # the Gaussian integrator section: every shared integrator

    pop = _population(sections["population"], pr)
    integ = _integrator(sections["integrator"], pr)
    bad_nb = pr.BAD in (pop["n_agents"], pop["neighbours"], pop["half_width"])
    cfg = _config(sections[SECTION], pr, pr.BAD if bad_nb else neighbours(pop), dtype)
    if cfg is not pr.BAD and pop["support"] == "disc" and pop["radius"] not in (None, pr.BAD):
        if pop["radius"] < 0.5 * cfg.spacing:
            pr.add("population.radius", f"{pop['radius']} < half the grid spacing: a disc may cover no point")
    return cfg, pop, integ


def config_dict(cfg: FieldConfig) -> dict:
    """The [field] section of a config (as stored with a run; ``validate`` reads it back)."""
    d = {k: v for k, v in cfg.to_dict(neighbour_lists=False).items() if k in CONFIG and v is not None}
    if len(cfg.irreps) == 1:
        d.pop("irreps")
    return d


def initial_state(cfg: FieldConfig, pop: dict, integ: dict, dtype: str) -> xr.Dataset:
    """The population (:func:`.state.random_state` with the population keys)."""
    kw = {k: pop[k] for k in POINT_OPTIONS if pop[k] is not None}
    kw.update({k: pop[k] for k in ("area", "sigma", "radius") if pop[k] is not None})
    if cfg.obs_dim:
        kw["obs_scale"] = pop["obs_scale"]
    for k in ("eig_range", "prior_eig_range"):
        if k in kw:
            kw[k] = tuple(kw[k])
    # A scale too large for the dtype overflows: validation names the variable, not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        return random_state(
            cfg,
            pop["n_agents"],
            seed=pop["seed"],
            dtype=dtype,
            support=pop["support"],
            placement=pop["placement"],
            constant=pop["constant_fields"],
            **kw,
        )


def make_integrator(cfg: FieldConfig, integ: dict, *, backend: str = "numpy", seed: int = 0):
    """The shared integrator of a validated integrator section (RunSpec.make_integrator)."""
    from ..backends import get
    from ..integrators import make_integrator as make

    be = get(backend)
    if be.name not in BACKENDS:
        raise ValueError(f"backend: field runs take {list(BACKENDS)}, got {be.name!r}")
    return make(
        integ["method"],
        cfg,
        integ["dt"],
        backend=be,
        friction=integ["friction"],
        seed=seed,
        **integ["options"],
    )


# The integrator section's keys (those of vfesim.scenario.INTEGRATOR), for unknown-key hints.
INTEGRATOR = {"method": "gradient_flow", "dt": None, "friction": 0.0, "options": {}}
DEFAULTS = {SECTION: CONFIG, "population": POPULATION, "integrator": INTEGRATOR}

# Every key of the sections above: key -> (type, one-line description); the scenario-key reference of the
# docs is generated from these (RunSpec.docs, vfesim.scenario.key_reference).
DOCS = {
    SECTION: {
        **MODEL_DOCS,
        "K": ("int", "latent dimension at every grid point; odd for one so(3) irrep. Required, or irreps"),
        "grid": ("[int] | [int, int]", "grid shape, [nx] or [nx, ny]. Required"),
        "boundary": ('"periodic" | "bounded"', "a ring or torus, or a bounded grid"),
        "spacing": ("float > 0", "distance between grid points (coordinates spacing * arange(n))"),
        "overlap_threshold": ("float in [0, 1]", 'neighbours = "overlap": max_c chi_i chi_j at least this'),
        "cell_volume": ('"sum" | "grid" | float > 0', "weight of a grid point: 1, spacing^ndim, or a number"),
        "lambda_phi": ("float >= 0", "weight of the gauge smoothness sum_i sum_c chi_i |grad phi_i|^2"),
    },
    "population": {
        "n_agents": ("int >= 1", "number of agents. Required"),
        "seed": ("int >= 0", "seed of the initial population (supports, centres and fields)"),
        "support": (
            '"bump" | "disc" | "full"',
            "each agent's support chi_i: Gaussian bump, disc or everywhere",
        ),
        "placement": ('"random" | "lattice"', "support centres drawn uniformly, or on a lattice"),
        "area": ("float > 0", "area of a bump or disc; default: twice the grid's area per agent"),
        "sigma": ("float > 0", 'width of a bump (support = "bump"; instead of area)'),
        "radius": ("float > 0", 'radius of a disc (support = "disc"; instead of area)'),
        "constant_fields": ("bool", "one draw per agent at every grid point (false: one per point)"),
        "mu_scale": ("float >= 0", "belief means ~ N(0, mu_scale^2)"),
        "prior_mu_scale": ("float >= 0", "prior means ~ N(0, prior_mu_scale^2); default: mu_scale"),
        "eig_range": ("[float, float]", "covariance eigenvalues log-uniform in [lo, hi]"),
        "prior_eig_range": ("[float, float]", "the same for prior covariances; default: eig_range"),
        "phi_radius": ("float in [0, pi)", "frames uniform in the ball |phi| <= phi_radius"),
        "obs_scale": ("float >= 0", "observations ~ N(0, obs_scale^2) (with field.W and field.R)"),
        "neighbours": ('"overlap" | "dense" | "ring"', "overlapping supports, every other agent, or a ring"),
        "half_width": ("int >= 1", 'neighbours on each side with neighbours = "ring" (then required)'),
    },
    "integrator": {
        "method": ("str", "integrator, as for Gaussian agents (every method of vfesim.integrators)"),
        "dt": ("float > 0", "time step. Required"),
        "friction": ("float >= 0", "momentum damping of the Hamiltonian methods (gradient_flow: must be 0)"),
        "options": ("table", "options of the method (the integrator options)"),
    },
}
