"""Numba backend: the shared per-agent code with the tiled, streaming CPU pairwise kernels (SPEC §2.4).

Arrays stay NumPy arrays on the host; the pairwise part runs in :mod:`vfesim_kernels.pairwise_cpu`
(parallel over receiver / sender blocks, deterministic, no N x N array). Thread count: Numba's
(``NUMBA_NUM_THREADS`` or ``numba.set_num_threads``).
"""

from __future__ import annotations

from vfesim_kernels.pairwise_cpu import pairwise_dense, pairwise_sparse

from ..gaussian.energy import energy_and_gradient_arrays

__all__ = ["to_device", "to_host", "energy_and_gradient"]


def to_device(arrays: dict) -> dict:
    return arrays


def to_host(arrays: dict) -> dict:
    return arrays


def energy_and_gradient(arrays: dict, cfg) -> tuple[dict, dict]:
    """Terms and gradients (SPEC §2.2–2.3) of NumPy arrays, pairwise work in Numba CPU kernels."""
    return energy_and_gradient_arrays(
        arrays, cfg, pairwise_dense=pairwise_dense, pairwise_sparse=pairwise_sparse
    )
