"""Field agents: Gaussian beliefs, priors and frames as fields over a 1-D or 2-D grid, each agent on a
support chi_i(c) in [0, 1]; every point-agent term evaluated pointwise and summed over the grid
(:mod:`.energy`), the grid a batch axis of the point-agent stages."""

from . import supports
from .config import FieldConfig
from .energy import TERMS, attention, energy_and_gradient_arrays, gauge_smoothness
from .state import make_state, random_state, validate_state, variables

__all__ = [
    "FieldConfig",
    "TERMS",
    "attention",
    "energy_and_gradient_arrays",
    "gauge_smoothness",
    "make_state",
    "random_state",
    "supports",
    "validate_state",
    "variables",
]
