"""Field agents as an agent family: the record the registry hands out. Their dynamics are not built
yet (``geometry=None``, no ``dynamics``): integrators refuse them by name."""

from __future__ import annotations

from ..family import AgentFamily, register
from . import state
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
        trajectory=("mu_q", "sigma_q", "mu_p", "sigma_p", "phi"),
        make_state=state.make_state,
        random_state=state.random_state,
        validate_state=state.validate_state,
        energy_and_gradient=energy_and_gradient,
        attention=attention,
    )
)
