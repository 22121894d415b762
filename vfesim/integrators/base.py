"""Integrator protocol (SPEC §2.5): immutable carries, ``init``/``step``/``restore`` triples, the NaN guard.

An integrator is an :class:`Integrator` ``(name, init, step, restore)`` built by
:func:`vfesim.integrators.make_integrator`. ``init(state) -> Carry`` and ``step(Carry) -> Carry`` are pure:
a carry is replaced, never mutated. ``restore(state, step, aux, rng_state)`` rebuilds a carry from a
checkpoint; stepping a restored carry is bitwise identical to stepping the original.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from ..config import ModelConfig
from ..state import StateError, validate_state

__all__ = [
    "Carry",
    "DynamicsError",
    "EnergyFn",
    "Integrator",
    "check_options",
    "energy_fn",
    "guard_state",
    "guard_terms",
    "with_arrays",
]

# (arrays) -> (terms, grads): the model energy over raw arrays keyed by state variable name.
EnergyFn = Callable[[dict[str, np.ndarray]], tuple[dict[str, float], dict[str, np.ndarray]]]


class DynamicsError(RuntimeError):
    """A step produced a non-finite value or a non-SPD covariance; names step, agent and variable."""

    def __init__(self, step: int, variable: str, message: str, agent: int | None = None):
        self.step = step
        self.variable = variable
        self.agent = agent
        where = variable if agent is None else f"{variable}[agent={agent}]"
        super().__init__(f"step {step}: {where}: {message}")


@dataclasses.dataclass(frozen=True)
class Carry:
    """Integrator state after ``step`` steps.

    state: positions in the SPEC §1.1 schema; aux: integrator arrays (momenta ``p_<var>``, Cholesky
    coordinates ``theta_<var>``, Adam moments ``adam_m_<var>``/``adam_v_<var>``); terms: energy terms at
    ``state`` (plus ``kinetic``, ``hamiltonian`` for Hamiltonian methods); rng_state: the NumPy
    bit-generator state after the init draws (None when nothing was drawn).

    Integrators attach the force at ``state`` to a carry as a private attribute (not a field: it is
    never checkpointed); a carry without it, e.g. from ``dataclasses.replace``, recomputes it.
    """

    state: xr.Dataset
    step: int
    aux: dict[str, np.ndarray]
    terms: dict[str, float]
    rng_state: dict | None


class Integrator(NamedTuple):
    """A named ``init``/``step``/``restore`` triple."""

    name: str
    init: Callable[[xr.Dataset], Carry]
    step: Callable[[Carry], Carry]
    restore: Callable[[xr.Dataset, int, dict[str, np.ndarray], dict | None], Carry]


def check_options(method: str, options: Mapping[str, Any], known: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``options`` over the defaults ``known``; an unknown key raises ValueError naming it."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"method {method!r}: unknown option(s) {unknown}; known options: {sorted(known)}")
    out = dict(known)
    out.update(options)
    return out


def check_fields(method: str, key: str, value: Any, fields: tuple[str, ...]) -> dict[str, float]:
    """A per-field positive/non-negative multiplier table (``{"mu_q": 1.0, ...}``), validated."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"method {method!r}: option {key!r} must be a dict field -> float, got {value!r}")
    bad = sorted(set(value) - set(fields))
    if bad:
        raise ValueError(f"method {method!r}: option {key!r} has unknown field(s) {bad}; fields: {fields}")
    out = {}
    for k, v in value.items():
        v = float(v)
        if not np.isfinite(v) or v < 0:
            raise ValueError(f"method {method!r}: option {key!r}[{k!r}] must be finite and >= 0, got {v}")
        out[k] = v
    return out


def energy_fn(cfg: ModelConfig, backend, override: EnergyFn | None = None) -> EnergyFn:
    """The energy over raw arrays for ``backend`` (a name or Backend; or ``override``, a custom potential)."""
    if override is not None:
        if not callable(override):
            raise ValueError(f"option 'energy' must be callable (arrays) -> (terms, grads), got {override!r}")
        return override
    from ..backends import get

    # Look the backend up once: a per-call lookup re-checks device availability every time. The backend
    # runs the family's assembly (the dask backend schedules it over agent chunks).
    be = get(backend)

    def fn(arrays):
        return be.energy_and_gradient(arrays, cfg)

    return fn


def update_ops(cfg: ModelConfig, backend) -> Any:
    """The integrator update operations of ``backend`` (a Backend) for ``cfg``'s family: the backend's
    point-agent operations (``backend.updates(K)``), adapted by the family's geometry where it has
    ``adapt_updates(ops, cfg)`` (field agents: the grid flattened into the batch)."""
    return adapt_ops(backend.updates(cfg.K), cfg)


def adapt_ops(ops: Any, cfg) -> Any:
    """Point-agent update operations ``ops`` adapted to ``cfg``'s family (its geometry's
    ``adapt_updates``, if any)."""
    from ..family import family_of

    adapt = getattr(family_of(cfg).geometry, "adapt_updates", None)
    return ops if adapt is None else adapt(ops, cfg)


def with_arrays(state: xr.Dataset, arrays: Mapping[str, Any]) -> xr.Dataset:
    """A new Dataset like ``state`` with some variables' data replaced (no copy of the rest)."""
    data = {k: (v.dims, arrays[k] if k in arrays else v.data, v.attrs) for k, v in state.data_vars.items()}
    return xr.Dataset(data, coords=state.coords, attrs=dict(state.attrs))


def state_arrays(state: xr.Dataset) -> dict[str, np.ndarray]:
    return {k: state[k].data for k in state.data_vars}


def guard_state(
    step: int, arrays: Mapping[str, Any], cfg: ModelConfig, aux: Mapping[str, Any] | None = None
) -> None:
    """Raise :class:`DynamicsError` naming step, agent and variable if a state variable or aux array is
    not finite, or a covariance is not SPD or beyond the dtype's condition-number limit (SPEC §5; the
    cheap Cholesky estimate of the condition number, no warnings: the run's first state had the exact check).
    """
    try:
        validate_state(arrays, cfg, conditioning="estimate")
    except StateError as e:
        msg = str(e).split(": ", 1)[-1]
        raise DynamicsError(step, e.variable, msg, agent=e.agent) from e
    for k, a in (aux or {}).items():
        bad = ~np.isfinite(a).reshape(a.shape[0], -1).all(axis=1)
        if bad.any():
            raise DynamicsError(step, k, "contains NaN or Inf", agent=int(np.argmax(bad)))


def guard_terms(step: int, terms: Mapping[str, float]) -> None:
    """Raise :class:`DynamicsError` if an energy term is not finite."""
    for k, v in terms.items():
        if not np.isfinite(v):
            raise DynamicsError(step, f"terms[{k!r}]", f"energy term is {v}")


__all__ += ["check_fields", "state_arrays", "update_ops"]


def make_restore(name: str, cfg: ModelConfig, aux_names, dev, efn: EnergyFn, make_carry: Callable):
    """``restore(state, step, aux, rng_state, *, validate=True)`` for an integrator: validates (unless the
    caller just did, where the state lives), moves host checkpoints onto the device (``dev`` is None on
    the CPU) and recomputes the cached force at ``state``, so a restored carry steps bitwise like the
    original. ``make_carry(state, step, aux, terms, grads, rng_state)``."""

    def restore(
        state: xr.Dataset, step: int, aux: dict, rng_state: dict | None = None, *, validate: bool = True
    ) -> Carry:
        if set(aux) != set(aux_names):
            raise ValueError(f"{name} restore: aux keys {sorted(aux)} != expected {sorted(aux_names)}")
        if dev is not None:  # checkpoints and initial states may arrive on the host
            state, aux = dev.put_state(state), dev.put_aux(aux)
            dev.prepare(state, cfg)
        if validate:
            validate_state(state, cfg)  # where the state will be used (device checks on a GPU)
        terms, grads = efn(state_arrays(state))
        return make_carry(state, int(step), dict(aux), terms, grads, rng_state)

    return restore
