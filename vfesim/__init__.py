"""vfesim: populations of agents minimising a variational free energy, on CPU and GPU."""

from ._version import __version__
from .backends import energy_and_gradient
from .config import ConfigError, ModelConfig, SparseNeighbours
from .state import StateError, make_state, random_state, validate_state

__all__ = [
    "__version__",
    "ConfigError",
    "ModelConfig",
    "SparseNeighbours",
    "StateError",
    "energy_and_gradient",
    "make_state",
    "random_state",
    "validate_state",
]
