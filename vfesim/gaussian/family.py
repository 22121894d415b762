"""Gaussian point agents as an agent family (SPEC §1.1, §2): the record the registry hands out."""

from __future__ import annotations

from ..config import ModelConfig
from ..family import AgentFamily, register
from . import geometry, state
from .energy import TERMS, attention, energy_and_gradient

__all__ = ["GAUSSIAN"]

GAUSSIAN = register(
    AgentFamily(
        name="gaussian",
        config_type=ModelConfig,
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
    )
)
