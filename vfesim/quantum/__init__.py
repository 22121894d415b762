"""Density-matrix ("quantum") agents (spec/quantum.md): config, state, frames and the free energy with its
exact gradient; dynamics (channels, unitary steps, Lindblad integrators, F-flows, ``evolve``), rollouts
with exact hand-written adjoints (``rollout``) and fitting on them (``fit``). Registered as the agent
family "quantum" (:mod:`.family`); the top-level ``vfesim.random_state``, ``validate_state`` and
``energy_and_gradient`` dispatch on :class:`QuantumConfig`.
"""

from .config import QuantumConfig
from .energy import FLOOR_EPS, TERMS, divergences
from .evolve import QuantumDynamics, evolve
from .fit import FitResult, fit
from .flows import lie_midpoint_step, mirror_descent_step
from .frames import spin_generators
from .lindblad import lindblad_evolve
from .rollout import RolloutResult, Schedule, rollout

__all__ = [
    "FLOOR_EPS",
    "FitResult",
    "QuantumConfig",
    "QuantumDynamics",
    "RolloutResult",
    "Schedule",
    "TERMS",
    "divergences",
    "evolve",
    "fit",
    "lie_midpoint_step",
    "lindblad_evolve",
    "mirror_descent_step",
    "rollout",
    "spin_generators",
]
