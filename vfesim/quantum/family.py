"""Density-matrix ("quantum") agents as an agent family (spec/quantum.md): the record the registry
hands out. No integrator geometry yet (``geometry=None``): dynamics of this family come next."""

from __future__ import annotations

from ..family import AgentFamily, register
from . import state
from .config import QuantumConfig
from .energy import TERMS, attention, energy_and_gradient

__all__ = ["QUANTUM"]

QUANTUM = register(
    AgentFamily(
        name="quantum",
        config_type=QuantumConfig,
        variables=state.VARIABLES,
        required=state.REQUIRED,
        terms=TERMS,
        trajectory=("rho", "phi"),
        make_state=state.make_state,
        random_state=state.random_state,
        validate_state=state.validate_state,
        energy_and_gradient=energy_and_gradient,
        attention=attention,
        geometry=None,
    )
)
