"""Scenario files (SPEC §5): a TOML run definition, validated completely before anything runs.

Sections and keys (all optional except ``model.K`` or ``model.irreps`` and ``population.n_agents``)::

    [model]        ModelConfig fields (K, lambda_*, kappa_*, aggregator, irreps, W, R, jitter)
    [population]   n_agents, seed, mu_scale, prior_mu_scale, eig_range, prior_eig_range,
                   phi_radius, obs_scale, neighbours ("dense" | "ring"), half_width,
                   camps (>= 1 prior camps), camp_offset (distance between camp centres)
    [integrator]   method, dt, friction, options (a table passed to make_integrator)
    [run]          n_steps, save_every (a frame every save_every steps; the last step is always
                   saved), checkpoint_every, backend, dtype, seed, chunks (agents per task of
                   backend "dask"; default: vfesim.backends.dask_backend.default_chunk)
    [output]       path (relative to the working directory), time_chunk (frames per Zarr chunk),
                   keep_checkpoints (>= 2: the newest and the one before are always kept),
                   observables (built-in observables saved per frame: belief_spread,
                   mean_frame_angle, attention_entropy, attention; default: attention_entropy up to
                   1024 agents and attention up to 256, see vfesim.observables)

Agent families with their own run sections (a :class:`~vfesim.family.RunSpec`) replace ``[model]``
by their section and validate ``[population]`` and ``[integrator]`` themselves: ``[quantum]`` selects
density-matrix agents (keys in :mod:`vfesim.quantum.runs`).

Every problem raises :class:`ScenarioError` naming the key as ``section.key``. Every key's type and
description is in :data:`KEY_DOCS` (families: their ``RunSpec.docs``); :func:`key_reference` lists them
with their defaults, and the docs' scenario-key reference is generated from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from .backends import names as backend_names
from .config import MODEL_DOCS, ConfigError, ModelConfig, SparseNeighbours, _check_real
from .family import RunSpec, families, family_of
from .state import StateError, make_state, random_state

__all__ = [
    "ScenarioError",
    "Scenario",
    "load_scenario",
    "read_toml",
    "to_toml",
    "BACKENDS",
    "run_memory_bytes",
    "KEY_DOCS",
    "key_reference",
]

BACKENDS = (*backend_names(), "auto")


def _methods() -> list[str]:
    from .integrators import available

    return available()


SECTIONS = ("model", "population", "integrator", "run", "output")


class ScenarioError(ConfigError):
    """A scenario value is missing, unknown, of the wrong type or impossible; names ``section.key``.

    ``errors``: every ``(key, message)`` found (a scenario is checked whole, not up to its first
    mistake); ``key`` is the first one's. ``source``: the scenario file, when there is one.
    """

    def __init__(self, key: str, message: str, *, source: str | None = None):
        super().__init__(key, message)
        self.message = message
        self.errors: list[tuple[str, str]] = [(key, message)]
        self.source = source
        if source is not None:
            self.args = (f"{source}: {key}: {message}",)

    @classmethod
    def several(cls, errors: list[tuple[str, str]], source: str | None = None) -> ScenarioError:
        """One error reporting all of ``errors``, one line each (a single one reads as before)."""
        if len(errors) == 1:
            return cls(*errors[0], source=source)
        e = cls(*errors[0], source=source)
        e.errors = list(errors)
        lines = "".join(f"\n  {k}: {m}" for k, m in errors)
        e.args = (f"{source or 'scenario'}: {len(errors)} problems:{lines}",)
        return e


# A value that failed validation (already reported): checks that depend on it are skipped.
BAD = object()


class _Problems:
    """Collects the problems of a scenario, so that all of them are reported at once.

    homes: section -> its keys (an unknown key found in another section is pointed there)."""

    BAD = BAD

    def __init__(self, homes: dict[str, set[str]] | None = None) -> None:
        self.errors: list[tuple[str, str]] = []
        self.homes = homes

    def add(self, key: str, message: str) -> object:
        self.errors.append((key, message))
        return BAD

    def get(self, key: str, check, *args: Any, **kw: Any) -> Any:
        """``check(key, *args, **kw)``, or BAD (the problem recorded) where it raises a ConfigError
        (a ScenarioError, or a ConfigError whose key is the full ``section.key``)."""
        try:
            return check(key, *args, **kw)
        except ScenarioError as e:
            self.errors += e.errors
            return BAD
        except ConfigError as e:
            return self.add(e.key, str(e).removeprefix(f"{e.key}: "))

    def choice(self, key: str, value: Any, choices: tuple[str, ...]) -> Any:
        """``value`` if it is one of ``choices``, else BAD (recorded, with a did-you-mean)."""
        return self.get(key, _str, value, choices)

    def unknown(self, section: str, d: dict, known: dict) -> dict:
        """Record each key of ``d`` not in ``known`` (with a suggestion); return the known ones."""
        for k in d:
            if k not in known:
                self.add(f"{section}.{k}", _unknown_key(k, section, known, self.homes))
        return {k: v for k, v in d.items() if k in known}


def _int(key: str, v: Any, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ScenarioError(key, f"must be an integer, got {type(v).__name__} {v!r}")
    if lo is not None and v < lo:
        raise ScenarioError(key, f"must be >= {lo}, got {v}")
    return int(v)


def _real(key: str, v: Any, *, positive: bool = False, nonneg: bool = False) -> float:
    return _check_real(key, v, positive=positive, nonneg=nonneg, error=ScenarioError)


def _str(key: str, v: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(v, str):
        raise ScenarioError(key, f"must be a string, got {type(v).__name__} {v!r}")
    if choices is not None and v not in choices:
        raise ScenarioError(key, f"must be one of {list(choices)}, got {v!r}{_did_you_mean(v, choices)}")
    return v


def _range(key: str, v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ScenarioError(key, f"must be a pair [lo, hi], got {v!r}")
    lo, hi = (_real(key, x, positive=True) for x in v)
    if lo > hi:
        raise ScenarioError(key, f"needs lo <= hi, got [{lo}, {hi}]")
    return lo, hi


def _table(key: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ScenarioError(key, f"must be a table, got {type(v).__name__}")
    return v


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _unknown_key(key: str, section: str, known, homes: dict | None = None) -> str:
    """The message for an unknown key: a close spelling in the section, or the section it belongs to."""
    hint = _did_you_mean(key, known)
    if not hint:
        homes = [s for s, keys in (homes or _section_keys()).items() if s != section and key in keys]
        if homes:
            hint = f"; it belongs in [{homes[0]}] ({homes[0]}.{key})"
    return f"unknown key{hint} (known: {sorted(known)})"


def _section_keys() -> dict[str, set[str]]:
    model = {f.name for f in dataclasses.fields(ModelConfig)} - {"dtype", "neighbours"}
    return {
        "model": model,
        "population": set(POPULATION),
        "integrator": set(INTEGRATOR),
        "run": set(RUN) | {"chunks"},
        "output": set(OUTPUT),
    }


# Defaults of each section (None: required or derived).
POPULATION = {
    "n_agents": None,
    "seed": 0,
    "mu_scale": 1.0,
    "prior_mu_scale": None,
    "eig_range": (0.5, 2.0),
    "prior_eig_range": None,
    "phi_radius": 1.0,
    "obs_scale": 1.0,
    "neighbours": "dense",
    "half_width": None,
    "camps": 1,
    "camp_offset": 0.0,
}
INTEGRATOR = {"method": "gradient_flow", "dt": None, "friction": 0.0, "options": {}}
RUN = {
    "n_steps": None,
    "save_every": 1,
    "checkpoint_every": None,
    "backend": "numpy",
    "dtype": "float64",
    "seed": 0,
}
OUTPUT = {"path": None, "time_chunk": None, "keep_checkpoints": 2, "observables": None}

# Every key of the sections above, and of [model] (vfesim.config.MODEL_DOCS): key -> (type, one-line
# description). docs/scenario-keys is generated from these (key_reference); a key without one fails
# tests/test_docs.py and the docs build. Families with their own sections document them in RunSpec.docs.
KEY_DOCS = {
    "model": MODEL_DOCS,
    "population": {
        "n_agents": ("int >= 2", "number of agents. Required"),
        "seed": ("int >= 0", "seed of the initial population"),
        "mu_scale": ("float >= 0", "belief means ~ N(0, mu_scale^2)"),
        "prior_mu_scale": ("float >= 0", "prior means ~ N(0, prior_mu_scale^2); default: mu_scale"),
        "eig_range": ("[float, float]", "covariance eigenvalues log-uniform in [lo, hi], Haar-random axes"),
        "prior_eig_range": ("[float, float]", "the same for prior covariances; default: eig_range"),
        "phi_radius": ("float in [0, pi)", "frames uniform in the ball |phi| <= phi_radius"),
        "obs_scale": ("float >= 0", "observations ~ N(0, obs_scale^2) (with model.W and model.R)"),
        "neighbours": ('"dense" | "ring"', "every other agent, or the half_width agents on each side"),
        "half_width": ("int >= 1", 'neighbours on each side with neighbours = "ring" (then required)'),
        "camps": ("int >= 1", "prior camps: agent i in camp i % camps, saved as the coordinate camp"),
        "camp_offset": ("float >= 0", "distance between camp centres (means shifted); > 0 when camps > 1"),
    },
    "integrator": {
        "method": ("str", "integrator (vfesim.integrators.available(); see the integrator options)"),
        "dt": ("float > 0", "time step. Required"),
        "friction": ("float >= 0", "momentum damping of the Hamiltonian methods (gradient_flow: must be 0)"),
        "options": ("table", "options of the method: integrator options below (scalars, tables of scalars)"),
    },
    "run": {
        "n_steps": ("int >= 1", "number of integrator steps. Required"),
        "save_every": ("int >= 1", "a frame every save_every steps; the last step is always saved"),
        "checkpoint_every": ("int >= 1", "a checkpoint every checkpoint_every steps; default: n_steps"),
        "backend": ("str", 'backend: "numpy", "numba", "cuda", "dask" or "auto" (families: fewer)'),
        "dtype": ("str", '"float64" or "float32" (density-matrix agents: "complex128" or "complex64")'),
        "seed": ("int >= 0", "seed of the run's random draws (initial momenta, Born outcomes)"),
        "chunks": ("int >= 1", 'agents per task of backend "dask"; default: dask_backend.default_chunk'),
    },
    "output": {
        "path": ("str", "the run's Zarr store, relative to the working directory (or give --out / out=)"),
        "time_chunk": (
            "int >= 1",
            "frames per Zarr chunk along time; default: those between checkpoints, up to 16 MiB",
        ),
        "keep_checkpoints": ("int >= 2", "checkpoints kept (the newest and the one before always are)"),
        "observables": (
            "list[str]",
            "built-ins saved per frame (belief_spread, mean_frame_angle, attention_entropy, attention); "
            "default: attention_entropy up to 1024 agents, attention up to 256",
        ),
    },
}


def _documented(section: str, defaults: dict, docs: dict, where: str) -> list[tuple[str, str, Any, str]]:
    """``(key, type, default, description)`` of every key of a section, in the order of ``defaults``; a
    key without a description (or a description of no key) raises ValueError naming it and ``where``."""
    missing = sorted(set(defaults) - set(docs))
    stale = sorted(set(docs) - set(defaults))
    if missing or stale:
        raise ValueError(
            f"[{section}] scenario keys without a description in {where}: {missing}; "
            f"descriptions of keys the section does not take: {stale}"
        )
    return [(k, docs[k][0], v, docs[k][1]) for k, v in defaults.items()]


def key_reference() -> dict[str, dict[str, list[tuple[str, str, Any, str]]]]:
    """Every scenario key, documented, as the docs' scenario-key reference shows it: agent family (its
    model section's name, ``"model"`` for Gaussian agents; ``"*"`` for the sections every family shares)
    -> section -> ``(key, type, default, description)`` rows (default None: required or derived, as the
    description says). The keys are those the validation accepts; a key without a description raises
    ValueError (so a new key cannot go undocumented)."""
    model = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name in _section_keys()["model"]}
    ref = {
        "*": {
            "run": _documented("run", {**RUN, "chunks": None}, KEY_DOCS["run"], "vfesim.scenario.KEY_DOCS"),
            "output": _documented("output", OUTPUT, KEY_DOCS["output"], "vfesim.scenario.KEY_DOCS"),
        },
        "model": {
            s: _documented(s, d, KEY_DOCS[s], "vfesim.scenario.KEY_DOCS")
            for s, d in (("model", model), ("population", POPULATION), ("integrator", INTEGRATOR))
        },
    }
    for fam in families():
        spec = fam.runs
        if spec is not None:
            where = f"the RunSpec.docs of the {fam.name!r} family"
            ref[spec.section] = {
                s: _documented(s, dict(d), dict(spec.docs.get(s, {})), where)
                for s, d in spec.defaults.items()
            }
    return ref


def _required(pr: _Problems, p: dict, section: str, key: str, check, *args: Any, **kw: Any) -> Any:
    if p[key] is None:
        return pr.add(f"{section}.{key}", "is required")
    return pr.get(f"{section}.{key}", check, p[key], *args, **kw)


def _phi_radius(key: str, v: Any) -> float:
    r = _real(key, v, nonneg=True)
    if r >= math.pi:
        raise ScenarioError(key, f"must be < pi, got {r}")
    return r


def _population(d: dict, pr: _Problems) -> dict:
    p = {**POPULATION, **pr.unknown("population", d, POPULATION)}
    p["n_agents"] = _required(pr, p, "population", "n_agents", _int, 2)
    n = p["n_agents"]
    p["seed"] = pr.get("population.seed", _int, p["seed"], 0)
    p["mu_scale"] = pr.get("population.mu_scale", _real, p["mu_scale"], nonneg=True)
    if p["prior_mu_scale"] is not None:
        p["prior_mu_scale"] = pr.get("population.prior_mu_scale", _real, p["prior_mu_scale"], nonneg=True)
    p["eig_range"] = pr.get("population.eig_range", _range, p["eig_range"])
    if p["prior_eig_range"] is not None:
        p["prior_eig_range"] = pr.get("population.prior_eig_range", _range, p["prior_eig_range"])
    p["phi_radius"] = pr.get("population.phi_radius", _phi_radius, p["phi_radius"])
    p["obs_scale"] = pr.get("population.obs_scale", _real, p["obs_scale"], nonneg=True)
    p["neighbours"] = pr.get("population.neighbours", _str, p["neighbours"], ("dense", "ring"))
    if p["neighbours"] == "ring":
        if p["half_width"] is None:
            pr.add("population.half_width", "is required with neighbours = 'ring'")
            p["half_width"] = BAD
        else:
            hw = p["half_width"] = pr.get("population.half_width", _int, p["half_width"], 1)
            if hw is not BAD and n is not BAD and 2 * hw > n - 1:
                p["half_width"] = pr.add(
                    "population.half_width", f"2*half_width must be <= n_agents-1 = {n - 1}, got {hw}"
                )
    elif p["half_width"] is not None and p["neighbours"] is not BAD:
        p["half_width"] = pr.add("population.half_width", "only valid with neighbours = 'ring'")
    p["camps"] = pr.get("population.camps", _int, p["camps"], 1)
    if p["camps"] is not BAD and n is not BAD and p["camps"] > n:
        p["camps"] = pr.add("population.camps", f"must be <= n_agents, got {p['camps']}")
    p["camp_offset"] = pr.get("population.camp_offset", _real, p["camp_offset"], nonneg=True)
    if p["camps"] is not BAD and p["camps"] > 1 and p["camp_offset"] == 0:
        pr.add("population.camp_offset", "must be > 0 when camps > 1")
    return p


def _integrator(d: dict, pr: _Problems) -> dict:
    p = {**INTEGRATOR, **pr.unknown("integrator", d, INTEGRATOR)}
    p["method"] = pr.get("integrator.method", _str, p["method"], tuple(_methods()))
    p["dt"] = _required(pr, p, "integrator", "dt", _real, positive=True)
    p["friction"] = pr.get("integrator.friction", _real, p["friction"], nonneg=True)
    opts = pr.get("integrator.options", _table, p["options"])
    if opts is not BAD:
        for k, v in opts.items():
            vals = v.values() if isinstance(v, dict) else [v]
            if not all(isinstance(x, (bool, int, float, str)) for x in vals):
                pr.add(f"integrator.options.{k}", f"must be a scalar or a table of scalars, got {v!r}")
        opts = dict(opts)
    p["options"] = opts
    return p


def _run(d: dict, pr: _Problems, spec: RunSpec | None = None) -> dict:
    dtypes = ("float32", "float64") if spec is None else spec.dtypes
    backends = BACKENDS if spec is None else spec.backends
    default = {} if spec is None else {"dtype": spec.dtypes[0]}
    p = {**RUN, **default, **pr.unknown("run", d, {**RUN, "chunks": None})}
    p["n_steps"] = _required(pr, p, "run", "n_steps", _int, 1)
    p["save_every"] = pr.get("run.save_every", _int, p["save_every"], 1)
    if p["checkpoint_every"] is None:
        p["checkpoint_every"] = p["n_steps"]
        if p["n_steps"] is BAD:
            p["checkpoint_every"] = BAD
    else:
        p["checkpoint_every"] = pr.get("run.checkpoint_every", _int, p["checkpoint_every"], 1)
    p["backend"] = pr.get("run.backend", _str, p["backend"], backends)
    p["dtype"] = pr.get("run.dtype", _str, p["dtype"], dtypes)
    p["seed"] = pr.get("run.seed", _int, p["seed"], 0)
    if "chunks" in p:  # stored only when given: scenarios of earlier runs compare equal on resume
        p["chunks"] = pr.get("run.chunks", _int, p["chunks"], 1)
        if p["backend"] not in ("dask", BAD):
            pr.add("run.chunks", f"agents per chunk apply to backend 'dask', not {p['backend']!r}")
    return p


def _output_path(key: str, v: Any) -> str:
    if not _str(key, v):
        raise ScenarioError(key, "must not be empty")
    return v


def _output(d: dict, pr: _Problems, n_agents: Any = BAD) -> dict:
    p = {**OUTPUT, **pr.unknown("output", d, OUTPUT)}
    if p["path"] is not None:
        p["path"] = pr.get("output.path", _output_path, p["path"])
    if p["time_chunk"] is not None:
        p["time_chunk"] = pr.get("output.time_chunk", _int, p["time_chunk"], 1)
    p["keep_checkpoints"] = pr.get("output.keep_checkpoints", _int, p["keep_checkpoints"], 2)
    if p["observables"] is not None:
        p["observables"] = pr.get("output.observables", _observables, p["observables"], n_agents)
    return p


def _observables(key: str, v: Any, n_agents: Any) -> list[str]:
    """A list of distinct built-in observable names (vfesim.observables.BUILTINS)."""
    from .observables import ATTENTION_FULL_MAX, unknown_builtin

    if not isinstance(v, (list, tuple)):
        raise ScenarioError(key, f"must be a list of observable names, got {type(v).__name__} {v!r}")
    problems = [(f"{key}[{i}]", m) for i, name in enumerate(v) if (m := unknown_builtin(name))]
    seen = set()
    for i, name in enumerate(v):
        if isinstance(name, str) and name in seen:
            problems.append((f"{key}[{i}]", f"{name!r} is listed twice"))
        seen.add(name if isinstance(name, str) else None)
    if "attention" in v and n_agents is not BAD and n_agents > ATTENTION_FULL_MAX:
        why = f"'attention' saves N^2 values per frame: at most {ATTENTION_FULL_MAX} agents, got {n_agents}"
        problems.append((key, why))
    if problems:
        raise ScenarioError.several(problems)
    return list(v)


# A run holds at least the state, its gradient and the integrator's copy (momenta or moments).
RUN_COPIES = 3


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def run_memory_bytes(n_agents: int, K: int, obs_dim: int, dtype: str) -> int:
    """Lower bound on a run's memory: RUN_COPIES copies of the Gaussian state (mu_q, mu_p (N, K);
    sigma_q, sigma_p (N, K, K); phi (N, 3); obs (N, obs_dim)) and the float64 generators (3, K, K)."""
    per_agent = 2 * K + 2 * K * K + 3 + obs_dim
    return RUN_COPIES * n_agents * per_agent * np.dtype(dtype).itemsize + 3 * K * K * 8


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _check_memory(model: ModelConfig, pop: dict, dtype: str) -> None:
    """Refuse, before anything is allocated, a population that cannot fit in this machine's memory;
    name the key that makes it too large (model.K when even two agents do not fit)."""
    have = physical_memory()
    n, K = pop["n_agents"], model.K
    need = run_memory_bytes(n, K, model.obs_dim, dtype)
    if have is None or need <= have:
        return
    key = "model.K" if run_memory_bytes(2, K, model.obs_dim, dtype) > have else "population.n_agents"
    raise ScenarioError(
        key,
        f"{n} agents with K = {K} in {dtype} need at least {_size(need)} (state, gradient and "
        f"integrator copy), more than this machine's {_size(have)} of memory",
    )


def _model(d: dict, pr: _Problems, pop: dict, dtype: Any) -> ModelConfig | object:
    """The ModelConfig of ``[model]``; BAD where a problem is found (or a key it needs is bad)."""
    d = dict(d)
    if "dtype" in d:
        pr.add("model.dtype", "set the dtype in run.dtype")
        del d["dtype"]
    if "neighbours" in d:
        pr.add("model.neighbours", "set neighbours in population.neighbours")
        del d["neighbours"]
    n_bad = len(pr.errors)
    d = pr.unknown("model", d, _section_keys()["model"])
    if "K" not in d and "irreps" not in d:
        pr.add("model.K", "is required (or model.irreps)")
    if len(pr.errors) > n_bad or BAD in (dtype, pop["neighbours"], pop["n_agents"], pop["half_width"]):
        return BAD
    if "irreps" in d and isinstance(d["irreps"], list):
        d["irreps"] = tuple(d["irreps"])
    if pop["neighbours"] == "ring":
        d["neighbours"] = SparseNeighbours.ring(pop["n_agents"], pop["half_width"])
    try:
        return ModelConfig(**d, dtype=dtype)
    except ConfigError as e:
        return pr.add(f"model.{e.key}", str(e).split(": ", 1)[1])
    except (TypeError, ValueError) as e:
        return pr.add("model", str(e))


@dataclasses.dataclass(frozen=True, eq=False)
class Scenario:
    """A validated run definition. ``to_dict()`` is the resolved config stored with every run."""

    model: Any  # a ModelConfig, or the config of a family with its own run sections (RunSpec)
    population: dict
    integrator: dict
    run: dict
    output: dict
    name: str = "scenario"

    @classmethod
    def from_dict(cls, d: dict, name: str = "scenario", source: str | Path | None = None) -> Scenario:
        """Validate a nested dict (as read from TOML); raise one ScenarioError naming every bad key
        (and ``source``, the file it came from, if given)."""
        src = None if source is None else str(source)
        if not isinstance(d, dict):
            raise ScenarioError("scenario", f"must be a table, got {type(d).__name__}", source=src)
        specs = [f.runs for f in families() if f.runs is not None and f.runs.section in d]
        spec = specs[0] if specs else None
        sections = SECTIONS if spec is None else (spec.section, *SECTIONS[1:])
        homes = None
        if spec is not None:
            homes = {**{s: set(keys) for s, keys in spec.defaults.items()}, "run": set(RUN) | {"chunks"}}
            homes["output"] = set(OUTPUT)
        pr = _Problems(homes)
        known = (*SECTIONS, *(f.runs.section for f in families() if f.runs is not None))
        for k in d:
            if k not in sections:
                if k in known:
                    names = ", ".join(f"[{s}]" for s in ("model", *(x.section for x in specs)) if s in d)
                    pr.add(k, f"a scenario has one model section; this one has {names}")
                else:
                    pr.add(k, f"unknown section{_did_you_mean(k, known)} (known: {list(known)})")
        sec = {}
        for s in sections:
            t = pr.get(s, _table, d.get(s, {}))
            sec[s] = {} if t is BAD else t
        if spec is not None:
            run = _run(sec["run"], pr, spec)
            out = _output(sec["output"], pr)
            model, pop, integ = spec.validate(sec, run["dtype"], pr)
            if pr.errors:
                raise ScenarioError.several(pr.errors, src)
            return cls(model, pop, integ, run, out, name)
        pop = _population(sec["population"], pr)
        integ = _integrator(sec["integrator"], pr)
        run = _run(sec["run"], pr)
        out = _output(sec["output"], pr, pop["n_agents"])
        model = _model(sec["model"], pr, pop, run["dtype"])
        if not pr.errors:
            try:
                _check_memory(model, pop, run["dtype"])
            except ScenarioError as e:
                pr.errors += e.errors
        if pr.errors:
            raise ScenarioError.several(pr.errors, src)
        return cls(model, pop, integ, run, out, name)

    @classmethod
    def from_toml(cls, path: str | Path) -> Scenario:
        """Read and validate a TOML scenario file."""
        return cls.from_dict(read_toml(path), name=Path(path).stem, source=find_scenario(path))

    @classmethod
    def from_json(cls, s: str) -> Scenario:
        d = json.loads(s)
        return cls.from_dict(d["scenario"], name=d.get("name", "scenario"))

    @property
    def spec(self) -> RunSpec | None:
        """The run sections of the model's family (None: the Gaussian ones of this module)."""
        return family_of(self.model).runs

    def to_dict(self) -> dict[str, Any]:
        """The resolved scenario as plain JSON-able data (defaults filled in)."""
        spec = self.spec
        if spec is not None:
            model, section = spec.config_dict(self.model), spec.section
        else:
            model, section = self._gaussian_model_dict(), "model"

        def plain(sec: dict) -> dict:
            return {k: list(v) if isinstance(v, tuple) else v for k, v in sec.items() if v is not None}

        return {
            section: model,
            "population": plain(self.population),
            "integrator": plain(self.integrator),
            "run": plain(self.run),
            "output": plain(self.output),
        }

    def _gaussian_model_dict(self) -> dict[str, Any]:
        model = self.model.to_dict(neighbour_lists=False)
        for k in ("dtype", "neighbours"):
            model.pop(k)
        model = {k: v for k, v in model.items() if v is not None}
        if len(self.model.irreps) == 1:
            model.pop("irreps")
        return model

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "scenario": self.to_dict()}, sort_keys=True)

    def to_toml(self) -> str:
        """The resolved scenario as a TOML file (``Scenario.from_toml`` reads it back equal)."""
        return to_toml(self.to_dict())

    def replace(self, section: str, **changes: Any) -> Scenario:
        """A new scenario with keys of one section changed (validated again)."""
        d = self.to_dict()
        d[section] = {**d[section], **changes}
        return Scenario.from_dict(d, name=self.name)

    def initial_state(self) -> xr.Dataset:
        """The population's initial state (random_state, then prior camps if asked; a family with its
        own run sections builds it)."""
        p = self.population
        spec = self.spec
        if spec is not None:
            try:
                return spec.initial_state(self.model, p, self.integrator, self.run["dtype"])
            except (ConfigError, StateError) as e:
                raise ScenarioError("population", str(e)) from None
        kw = {
            k: p[k]
            for k in ("mu_scale", "prior_mu_scale", "eig_range", "prior_eig_range", "phi_radius")
            if p[k] is not None
        }
        if self.model.obs_dim:
            kw["obs_scale"] = p["obs_scale"]
        try:
            # A scale too large for the dtype overflows: validation below names the key, not a warning.
            with np.errstate(over="ignore", invalid="ignore"):
                state = random_state(self.model, p["n_agents"], seed=p["seed"], dtype=self.run["dtype"], **kw)
        except StateError as e:
            key = self._population_key(e.variable)
            raise ScenarioError(f"population.{key}", f"{key} = {p[key]!r} gives {e}") from None
        if p["camps"] > 1:
            state = _prior_camps(state, self.model, p["camps"], p["camp_offset"])
        return state

    def observables(self) -> list[str]:
        """The built-in observables a run of this scenario saves per frame: ``output.observables``, or
        by default :func:`vfesim.observables.default_observables` of the population size."""
        from .observables import default_observables

        given = self.output.get("observables")
        return list(given) if given is not None else default_observables(self.population["n_agents"])

    def labels(self) -> dict[str, np.ndarray]:
        """Population labels saved as coordinates on ``agent``: ``camp`` (agent i is in prior camp
        ``i % camps``, as :meth:`initial_state` places it)."""
        p = self.population
        return {"camp": np.arange(p["n_agents"], dtype=np.int64) % p.get("camps", 1)}

    def _population_key(self, variable: str) -> str:
        """The population key that sets a state variable (what to blame when it comes out bad)."""
        p = self.population
        return {
            "mu_q": "mu_scale",
            "mu_p": "mu_scale" if p["prior_mu_scale"] is None else "prior_mu_scale",
            "sigma_q": "eig_range",
            "sigma_p": "eig_range" if p["prior_eig_range"] is None else "prior_eig_range",
            "phi": "phi_radius",
            "obs": "obs_scale",
        }.get(variable, "n_agents")


def _prior_camps(state: xr.Dataset, cfg: ModelConfig, camps: int, offset: float) -> xr.Dataset:
    """Shift prior (and belief) means of agent i by the centre of camp ``i % camps``.

    Centres lie on a circle of diameter ``offset`` in the plane of the first two latent axes
    (on the first axis, at +-offset/2, when K = 1 or camps = 2).
    """
    n, K = state.sizes["agent"], cfg.K
    ang = 2 * np.pi * np.arange(camps) / camps
    centres = np.zeros((camps, K))
    centres[:, 0] = 0.5 * offset * np.cos(ang)
    if K > 1:
        centres[:, 1] = 0.5 * offset * np.sin(ang)
    shift = centres[np.arange(n) % camps].astype(state["mu_p"].dtype)
    arrays = {k: state[k].values for k in state.data_vars}
    arrays["mu_p"] = arrays["mu_p"] + shift
    arrays["mu_q"] = arrays["mu_q"] + shift
    return make_state(cfg, **arrays)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        v = float(v)
        return repr(v) if math.isfinite(v) else ("nan" if v != v else "inf" if v > 0 else "-inf")
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def to_toml(d: dict[str, dict[str, Any]]) -> str:
    """A scenario dict (sections of keys) as TOML text: one ``[section]`` per table, tables inside a
    section written inline."""
    blocks = []
    # A family's own model section (e.g. [quantum]) first, where [model] would be.
    order = [s for s in d if s not in SECTIONS] + [s for s in SECTIONS if s in d]
    for section, keys in ((s, d[s]) for s in order):
        lines = [f"[{_toml_key(section)}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in keys.items()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def packaged_dir() -> Path:
    """Where the scenarios shipped with vfesim are: ``vfesim/scenarios`` in an installed wheel (setup.cfg
    maps the repository's ``scenarios/`` there), the repository's ``scenarios/`` in a source checkout
    or an editable install (the one copy of the files)."""
    installed = Path(__file__).resolve().parent / "scenarios"
    return installed if installed.is_dir() else Path(__file__).resolve().parents[1] / "scenarios"


def packaged_scenarios() -> dict[str, Path]:
    """The scenarios shipped with vfesim, by name (file stem), sorted."""
    d = packaged_dir()
    return {p.stem: p for p in sorted(d.glob("*.toml"))} if d.is_dir() else {}


def describe(path: str | Path) -> str:
    """A scenario file's one-line description: the first sentence of its leading comment."""
    text = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text.append(line.lstrip("#").strip())
    first = " ".join(text).split(". ", 1)[0].rstrip(".")
    return first + "." if first else "(no description)"


def find_scenario(source: str | os.PathLike) -> Path:
    """The scenario file ``source`` names: a path, else the name of a packaged scenario (``consensus``
    or ``consensus.toml``). A path that is neither raises ScenarioError listing the packaged names."""
    path = Path(source)
    if path.exists() or len(path.parts) != 1:
        return path
    known = packaged_scenarios()
    name = path.name.removesuffix(".toml")
    if name in known:
        return known[name]
    raise ScenarioError(
        str(source),
        f"no such scenario file, nor a scenario shipped with vfesim{_did_you_mean(name, known)} "
        f"(shipped: {', '.join(known) or 'none'}; `vfesim scenarios` describes them)",
    )


def read_toml(path: str | Path) -> dict:
    """The raw nested dict of a TOML file (not yet validated); ``path`` may name a packaged scenario."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "scenario: expected a Scenario, a TOML file path or a dict of sections (simulate also "
            f"takes a ModelConfig), got {type(path).__module__}.{type(path).__name__}"
        )
    path = find_scenario(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ScenarioError(str(path), "scenario file not found") from None
    except IsADirectoryError:
        raise ScenarioError(str(path), "is a directory, not a scenario file") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(
            str(path), f"not a text (UTF-8) TOML file: byte {e.object[e.start]:#04x} at offset {e.start}"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(str(path), f"invalid TOML: {e}") from None
    except OSError as e:
        raise ScenarioError(str(path), f"cannot be read ({e.strerror or e})") from None


def load_scenario(source: str | Path | dict | Scenario) -> Scenario:
    """A Scenario from a TOML path, a nested dict, or a Scenario (returned as is)."""
    if isinstance(source, Scenario):
        return source
    if isinstance(source, dict):
        return Scenario.from_dict(source)
    return Scenario.from_toml(source)
