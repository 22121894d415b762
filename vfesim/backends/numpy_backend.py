"""NumPy backend: the vectorised reference (array-generic per-agent stages, row-blocked GEMM pairs)."""

from __future__ import annotations

import numpy as np

from .. import pairwise
from ..gaussian.geometry import NumpyUpdates
from . import Backend

__all__ = ["BACKEND", "to_device", "to_host", "energy_and_gradient"]


def to_device(arrays: dict) -> dict:
    return arrays


def to_host(arrays: dict) -> dict:
    return arrays


BACKEND = Backend(
    name="numpy",
    array_module=lambda: np,
    to_device=to_device,
    to_host=to_host,
    pairwise_dense=pairwise.pairwise_dense,
    pairwise_sparse=pairwise.pairwise_sparse,
    updates=NumpyUpdates,
    pairwise_points=pairwise.weighted.pairwise_points_weighted,
)


def energy_and_gradient(arrays: dict, cfg) -> tuple[dict, dict]:
    return BACKEND.energy_and_gradient(arrays, cfg)
