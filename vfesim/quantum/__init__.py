"""Density-matrix ("quantum") agents (spec/quantum.md): config, state, frames and the free energy with its
exact gradient. Registered as the agent family "quantum" (:mod:`.family`); the top-level
``vfesim.random_state``, ``validate_state`` and ``energy_and_gradient`` dispatch on :class:`QuantumConfig`.
"""

from .config import QuantumConfig
from .energy import FLOOR_EPS, TERMS, divergences
from .frames import spin_generators

__all__ = ["FLOOR_EPS", "QuantumConfig", "TERMS", "divergences", "spin_generators"]
