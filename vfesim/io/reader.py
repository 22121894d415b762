"""Reading runs: ``open_run`` gives the trajectory as a lazy xarray Dataset (SPEC §5)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import xarray as xr

from ..schema import attrs_of, term_var
from .store import RunStore, StoreError

__all__ = ["open_run"]


def open_run(path: str | Path, *, chunks: dict | str | None = "auto") -> xr.Dataset:
    """The trajectory of a run, lazily, trimmed to the frames written so far: Dask arrays when Dask is
    installed (``chunks="auto"``: multiples of the stored chunks, which split ``time`` and ``agent``;
    ``chunks={}``: the stored chunks), else xarray's lazy arrays, which read only what is selected.

    Dims: ``time`` (one frame per ``save_every`` steps and one at the last step; coordinates
    ``time`` = step * dt and ``step``), ``agent`` (population labels such as ``camp`` as coordinates),
    ``latent``, ``latent_b``, ``gauge``, ... Variables: the family's trajectory variables (Gaussian:
    ``mu_q, sigma_q, mu_p, sigma_p, phi``), ``energy_total`` and ``energy_<term>``, the run's
    observables and ``saved``; each with ``long_name`` and ``units`` (docs/outputs.md). attrs: the
    scenario and model config as JSON, ``vfesim_version``, ``dtype``, ``backend``, ``status``.
    Density-matrix runs: dims ``bra``, ``ket`` instead of the latent ones, ``rho`` a complex Zarr v3
    array (complex128 or complex64, fill NaN), ``outcome`` (int, fill -1) when the run observes;
    ``hamiltonian``, ``temperature``, ``phi`` written once (a ``fit`` run saves ``hamiltonian`` per frame).
    Stores of format ``vfesim-run/1`` open with their energies renamed to this schema.
    The same store opens with ``xr.open_zarr(path, consolidated=False)``, showing the fill values for
    frames not yet written.
    """
    path = Path(path)
    if not RunStore.is_run(path):
        raise StoreError(f"{path}: not a vfesim run store (no zarr.json with format attrs)")
    if chunks == "auto" and importlib.util.find_spec("dask") is None:
        chunks = None  # still lazy (xarray's lazy indexing), just not Dask
    ds = xr.open_zarr(path, consolidated=False, zarr_format=3, chunks=chunks)
    # Small coordinates (step, population labels) in memory: groupby("camp") needs its labels.
    ds = ds.assign_coords({k: ds[k].load() for k in ds.coords if k not in ds.indexes})
    if ds.attrs.get("format") == "vfesim-run/1":
        ds = _from_format_1(ds)
    saved = np.asarray(ds["saved"].values, bool)
    # Frames are written in order, so the written ones are a prefix.
    n = int(np.argmin(saved)) if not saved.all() else saved.size
    return ds.isel(time=slice(0, n))


def _from_format_1(ds: xr.Dataset) -> xr.Dataset:
    """A ``vfesim-run/1`` store in this schema: ``system_free_energy`` -> ``energy_total``,
    ``system_energy_<term>`` -> ``energy_<term>``, with their attributes."""
    names = {}
    for k in ds.data_vars:
        if k == "system_free_energy":
            names[k] = term_var("total")
        elif k.startswith("system_energy_"):
            names[k] = term_var(k.removeprefix("system_energy_"))
    ds = ds.rename(names)
    for k in names.values():
        ds[k].attrs.update(attrs_of(k))
    return ds
