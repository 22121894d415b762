"""vfesim: populations of agents minimising a variational free energy, on CPU and GPU."""

from . import integrators, quantum
from ._version import __version__
from .backends import energy_and_gradient
from .config import ConfigError, ModelConfig, SparseNeighbours
from .dynamics import run_dynamics
from .family import family_of
from .fields import FieldConfig
from .io import open_run
from .observables import Observable, attention
from .quantum import QuantumConfig
from .simulate import Run, simulate
from .state import ConditioningWarning, NonFiniteError, StateError, make_state, random_state, validate_state

__all__ = [
    "__version__",
    "ConditioningWarning",
    "ConfigError",
    "FieldConfig",
    "ModelConfig",
    "NonFiniteError",
    "Observable",
    "QuantumConfig",
    "Run",
    "SparseNeighbours",
    "StateError",
    "attention",
    "energy_and_gradient",
    "family_of",
    "make_state",
    "open_run",
    "integrators",
    "quantum",
    "random_state",
    "run_dynamics",
    "simulate",
    "validate_state",
]
