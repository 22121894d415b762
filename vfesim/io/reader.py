"""Reading runs: ``open_run`` gives the trajectory as a lazy xarray Dataset (SPEC §5)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import xarray as xr

from .store import RunStore, StoreError

__all__ = ["open_run"]


def open_run(path: str | Path, *, chunks: dict | str | None = "auto") -> xr.Dataset:
    """The trajectory of a run, lazily (Dask when installed), trimmed to the frames written so far.

    Dims: ``time`` (one frame per ``save_every`` steps and one at the last step; coordinates
    ``time`` = step * dt and ``step``), ``agent``, ``latent``, ``latent_b``, ``gauge``. Variables:
    ``mu_q, sigma_q, mu_p, sigma_p, phi``, ``system_free_energy``, ``system_energy_<term>`` and
    ``saved``. attrs: the scenario and model config as JSON, ``vfesim_version``, ``dtype``,
    ``backend``, ``status``.
    Density-matrix runs: dims ``bra``, ``ket`` instead of the latent ones, ``rho`` a complex Zarr v3
    array (complex128 or complex64, fill NaN), ``outcome`` (int, fill -1) when the run observes;
    ``hamiltonian``, ``temperature``, ``phi`` written once (a ``fit`` run saves ``hamiltonian`` per frame).
    The same store opens with ``xr.open_zarr(path, consolidated=False)``, showing the fill values for
    frames not yet written.
    """
    path = Path(path)
    if not RunStore.is_run(path):
        raise StoreError(f"{path}: not a vfesim run store (no zarr.json with format attrs)")
    if chunks == "auto" and importlib.util.find_spec("dask") is None:
        chunks = None  # still lazy (xarray's lazy indexing), just not Dask
    ds = xr.open_zarr(path, consolidated=False, zarr_format=3, chunks=chunks)
    saved = np.asarray(ds["saved"].values, bool)
    # Frames are written in order, so the written ones are a prefix.
    n = int(np.argmin(saved)) if not saved.all() else saved.size
    return ds.isel(time=slice(0, n))
