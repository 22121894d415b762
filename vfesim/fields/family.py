"""Field agents as an agent family: the record the registry hands out. They move with the shared
integrators, every (agent, grid point) a point agent (:mod:`.geometry`)."""

from __future__ import annotations

from ..family import AgentFamily, RunSpec, register
from . import geometry, runs, state
from .config import FieldConfig
from .energy import TERMS, attention, energy_and_gradient

__all__ = ["FIELD"]

FIELD = register(
    AgentFamily(
        name="field",
        config_type=FieldConfig,
        variables=state.VARIABLES,
        attributes=state.ATTRIBUTES,
        required=state.REQUIRED,
        terms=TERMS,
        trajectory=geometry.MOVABLE,
        make_state=state.make_state,
        random_state=state.random_state,
        validate_state=state.validate_state,
        energy_and_gradient=energy_and_gradient,
        attention=attention,
        geometry=geometry,
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
