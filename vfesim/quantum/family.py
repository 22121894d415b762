"""Density-matrix ("quantum") agents as an agent family (spec/quantum.md): the record the registry
hands out. Their motion is not a flow of the shared integrators (``geometry=None``): channels, unitary
steps and F-flows of :mod:`.evolve` (spec §3), reached through :func:`vfesim.run_dynamics`."""

from __future__ import annotations

from ..family import AgentFamily, RunSpec, register
from . import runs, state
from .config import QuantumConfig
from .energy import NUMPY_OPS, TERMS, attention, energy_and_gradient
from .evolve import QuantumDynamics, evolve

# run_dynamics methods of this family: the synchronous step of spec §3 (coupling channels, unitary step,
# dephasing, optional mirror-descent steps), and pure mirror descent on F (§3.4).
METHODS = ("channels", "mirror_descent")


def run_dynamics(state, cfg, method, dt, n_steps, *, record_every=1, backend="numpy", friction=0.0, seed=0,
                 observables=None, **options):  # fmt: skip
    """:func:`vfesim.run_dynamics` for density-matrix agents: ``options`` are the fields of
    :class:`.evolve.QuantumDynamics`; method "mirror_descent" means no coupling and ``mirror_steps``
    (default 1) Armijo mirror-descent steps per step. The per-agent stages run in the backend's kernels
    ("numpy" or "numba"). The dynamics is deterministic: ``seed`` is unused. ``observables``: see
    :func:`vfesim.run_dynamics`."""
    from ..backends import get

    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not a density-matrix method; choose one of {list(METHODS)}")
    if friction != 0.0:
        raise ValueError("friction: density-matrix dynamics have no momenta (friction must be 0)")
    be = get(backend)
    if be.name not in ("numpy", "numba"):
        raise ValueError(
            f"backend: density-matrix dynamics run on 'numpy' or 'numba', got {be.name!r} (runs of scenario "
            "files, vfesim.simulate and `vfesim run`, also take 'dask')"
        )
    known = set(QuantumDynamics.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown option of density-matrix dynamics (known: {sorted(known)})")
    if method == "mirror_descent":
        options = {"coupling": "none", "mirror_steps": 1} | options
    ops = be.agent_ops.get("quantum", NUMPY_OPS)
    return evolve(
        state, cfg, QuantumDynamics(**options), dt, n_steps, record_every=record_every, ops=ops,
        observables=observables,
    )  # fmt: skip


__all__ = ["QUANTUM"]

QUANTUM = register(
    AgentFamily(
        name="quantum",
        config_type=QuantumConfig,
        variables=state.VARIABLES,
        attributes=state.ATTRIBUTES,
        required=state.REQUIRED,
        terms=TERMS,
        trajectory=("rho", "phi"),
        make_state=state.make_state,
        random_state=state.random_state,
        validate_state=state.validate_state,
        energy_and_gradient=energy_and_gradient,
        attention=attention,
        geometry=None,
        dynamics=run_dynamics,
        runs=RunSpec(
            section=runs.SECTION,
            defaults=runs.DEFAULTS,
            validate=runs.validate,
            config_dict=runs.config_dict,
            initial_state=runs.initial_state,
            make_integrator=runs.make_integrator,
            dtypes=runs.RUN_DTYPES,
            backends=runs.BACKENDS,
            docs=runs.DOCS,
        ),
    )
)
