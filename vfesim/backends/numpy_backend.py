"""NumPy backend: the vectorised reference (row-blocked GEMMs, SPEC §2.3)."""

from __future__ import annotations

from ..gaussian.energy import energy_and_gradient_arrays


def to_device(arrays: dict) -> dict:
    return arrays


def to_host(arrays: dict) -> dict:
    return arrays


def energy_and_gradient(arrays: dict, cfg) -> tuple[dict, dict]:
    return energy_and_gradient_arrays(arrays, cfg)
