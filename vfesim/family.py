"""Agent families: the one interface between the model of a kind of agent and the layers that run it.

A family (Gaussian point agents, density-matrix agents, field agents) is an :class:`AgentFamily`
record: its config type, its state schema, its energy terms, the variables integrators move, and the
functions that build, validate and differentiate its states. Everything outside the family's own
package (state dispatch, backends, integrators, io, dynamics, plots) asks the family instead of naming
its variables. One registry maps a config type to its family; :func:`family_of` looks a config up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AgentFamily", "RunSpec", "register", "family_of", "family_named", "families"]

# Modules that define the built-in families (imported on first lookup; each calls register()).
BUILTIN = ("vfesim.gaussian.family", "vfesim.quantum.family", "vfesim.fields.family")


@dataclass(frozen=True)
class RunSpec:
    """How a family runs from a scenario file (:mod:`vfesim.scenario`) in the run loop
    (:mod:`vfesim.simulate`), for families whose runs are not the Gaussian ones.

    section: the scenario section holding the family's config (its presence selects the family).
    defaults: section -> {key: default} of the family's sections (``section``, population, integrator);
        used for unknown-key hints.
    validate(sections, dtype, problems) -> (cfg, population, integrator): the family's three sections
        (``sections``: section -> raw dict), every problem recorded in ``problems`` (``add(key, msg)``,
        ``get(key, check, *args)``, ``unknown(section, d, known)``, ``choice(key, value, choices)``;
        keys are ``section.key``); any of the three may be returned as ``problems.BAD``.
    config_dict(cfg) -> dict: the family's section as stored with a run (read back by ``validate``).
    initial_state(cfg, population, integrator, dtype) -> Dataset (sections as ``validate`` returned them).
    make_integrator(cfg, integrator, *, backend, seed) -> an init/step/restore triple (an
        :class:`~vfesim.integrators.Integrator`-like named tuple; an optional ``trajectory`` field names
        the variables saved per frame instead of the family's ``trajectory``).
    dtypes: values of ``run.dtype`` (the first is the default). backends: values of ``run.backend``.
    docs: section -> {key: (type, one-line description)} of every key in ``defaults`` (the scenario-key
        reference of the docs is generated from it; :func:`vfesim.scenario.key_reference`).
    """

    section: str
    defaults: Mapping[str, Mapping[str, Any]]
    validate: Callable[..., tuple[Any, Any, Any]]
    config_dict: Callable[[Any], dict]
    initial_state: Callable[..., Any]
    make_integrator: Callable[..., Any]
    dtypes: tuple[str, ...]
    backends: tuple[str, ...]
    docs: Mapping[str, Mapping[str, tuple[str, str]]] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentFamily:
    """What the rest of vfesim knows about one kind of agent.

    name: short identifier stored with states and runs ("gaussian").
    config_type: the frozen config class whose instances select this family.
    variables: the state schema, variable -> dims (optional variables included).
    attributes: variable -> CF attributes (``long_name``, ``units``) of the state variables, carried by
        states, run stores and gradients (docs/outputs.md lists them).
    required: variables every state has.
    terms: energy term names in order; ``terms["total"]`` is their sum.
    trajectory: variables that change during a run (saved per frame; the rest are saved once).
    make_state(cfg, *arrays, validate=True) -> Dataset; random_state(cfg, n_agents, seed, dtype, **kw);
    validate_state(state_or_mapping, cfg, check_spd=True) -> None (raises StateError).
    energy_and_gradient(arrays, cfg, backend) -> (terms, grads): the one assembly of the family's free
        energy over raw arrays, executed with the capabilities of ``backend`` (a :class:`Backend`).
    attention(arrays, cfg, which) -> weights (NumPy).
    geometry: integrator coordinates of the family (fields grouped as the integrators move them);
        optional hooks: ``adapt_updates(ops, cfg)`` (the backend's point-agent update operations for the
        family's arrays) and ``frozen(state)`` (a mask of points Hamiltonian momenta start at rest on).
    dynamics(state, cfg, method, dt, n_steps, *, record_every, backend, friction, seed, observables,
        **options) ->
        (final state, history): the family's own in-memory dynamics, for families whose motion is not a
        flow of the shared integrators (``geometry`` None); :func:`vfesim.run_dynamics` calls it.
    runs: a :class:`RunSpec` (scenario sections and run-loop steppers of the family); None: the
        Gaussian scenario sections and the shared integrators.
    """

    name: str
    config_type: type
    variables: Mapping[str, tuple[str, ...]]
    required: tuple[str, ...]
    terms: tuple[str, ...]
    trajectory: tuple[str, ...]
    make_state: Callable[..., Any]
    random_state: Callable[..., Any]
    validate_state: Callable[..., None]
    energy_and_gradient: Callable[..., tuple[dict[str, float], dict[str, Any]]]
    attention: Callable[..., Any]
    attributes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    geometry: Any = field(default=None)
    dynamics: Callable[..., Any] | None = field(default=None)
    runs: RunSpec | None = field(default=None)


_REGISTRY: dict[type, AgentFamily] = {}
_loaded = False


def register(family: AgentFamily) -> AgentFamily:
    """Add a family (its config type must be new)."""
    other = _REGISTRY.get(family.config_type)
    if other is not None and other is not family:
        raise ValueError(f"config type {family.config_type.__name__} already has family {other.name!r}")
    _REGISTRY[family.config_type] = family
    return family


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in BUILTIN:
            importlib.import_module(mod)
        _loaded = True


def families() -> tuple[AgentFamily, ...]:
    """Every registered family."""
    _load()
    return tuple(_REGISTRY.values())


def family_of(cfg: Any) -> AgentFamily:
    """The family of a config instance; a TypeError names the type when no family takes it."""
    _load()
    for t in type(cfg).__mro__:
        if t in _REGISTRY:
            return _REGISTRY[t]
    known = ", ".join(f.config_type.__name__ for f in _REGISTRY.values())
    raise TypeError(f"config: no agent family takes a {type(cfg).__name__} (known: {known})")


def family_named(name: str) -> AgentFamily:
    """The family with a given name (as stored in state and run attrs)."""
    for fam in families():
        if fam.name == name:
            return fam
    raise ValueError(f"family: unknown {name!r}; known: {[f.name for f in families()]}")
