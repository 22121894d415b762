"""Backend registry: one place that maps a backend name to its implementation and detects devices.

A backend module provides ``energy_and_gradient(arrays, cfg) -> (terms, grads)`` over raw arrays
(NumPy for "numpy"/"numba", CuPy for "cuda") and ``to_device(arrays)`` / ``to_host(arrays)``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import numpy as np
import xarray as xr

from ..config import ModelConfig
from ..state import STATE_DIMS, validate_state

__all__ = ["BACKENDS", "resolve", "get", "energy_and_gradient_arrays", "energy_and_gradient"]

log = logging.getLogger("vfesim")

BACKENDS = {
    "numpy": "vfesim.backends.numpy_backend",
    "numba": "vfesim.backends.numba_backend",
    "cuda": "vfesim.backends.cuda_backend",
}


def cuda_available() -> bool:
    """True when CuPy imports and sees a CUDA device (or the Numba CUDA simulator is on)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True  # the simulator stands in for the device, with NumPy arrays
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - any import/driver failure means "no GPU"
        return False


def resolve(name: str) -> str:
    """Validate a backend name; "auto" picks "cuda" when a GPU is present, else "numba" (logged)."""
    if name == "auto":
        chosen = "cuda" if cuda_available() else "numba"
        log.info("backend 'auto' resolved to %r", chosen)
        return chosen
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    if name == "cuda" and not cuda_available():
        raise RuntimeError(
            "backend 'cuda' needs CuPy and a CUDA GPU, and none was found "
            "(install the 'gpu' extra, or use backend='numba' or 'auto')"
        )
    return name


def get(name: str):
    """The backend module for a (resolved) name."""
    return importlib.import_module(BACKENDS[resolve(name)])


def energy_and_gradient_arrays(
    arrays: dict[str, Any], cfg: ModelConfig, backend: str = "numpy"
) -> tuple[dict[str, float], dict[str, Any]]:
    """Energy terms and exact gradient for raw arrays already on the backend's device."""
    return get(backend).energy_and_gradient(arrays, cfg)


def energy_and_gradient(
    state: xr.Dataset, cfg: ModelConfig, backend: str = "numpy", *, validate: bool = True
) -> tuple[dict[str, float], xr.Dataset]:
    """Free-energy terms (dict of floats) and the exact gradient Dataset (SPEC §1, §2.2–2.3).

    terms: "self", "belief_align", "prior_align", "observation", "total".
    grads: same variables, dims and dtype as ``state``; covariance gradients are symmetric.
    """
    if validate:
        validate_state(state, cfg)
    mod = get(backend)
    arrays = mod.to_device({k: state[k].data for k in state.data_vars})
    terms, grads = mod.energy_and_gradient(arrays, cfg)
    grads = mod.to_host(grads) if isinstance(state[next(iter(state.data_vars))].data, np.ndarray) else grads
    ds = xr.Dataset({k: (STATE_DIMS[k], v) for k, v in grads.items()}, attrs=dict(state.attrs))
    return terms, ds
