"""The run store (SPEC §5): one Zarr v3 directory per run.

Layout of ``RUN.zarr``::

    zarr.json                 root group; attrs: format, scenario (JSON), model_config (JSON),
                              agent_family, trajectory_variables (JSON), vfesim_version, dtype,
                              backend, status
    <trajectory variables>    (time, agent, ...) arrays of the family's moving variables (Gaussian:
                              mu_q, sigma_q, mu_p, sigma_p, phi), preallocated for the whole run
    system_free_energy,       (time,) energy terms of each saved frame
    system_energy_<term>
    saved                     (time,) bool, True once a frame is written (fill value False)
    time, step                coordinates: physical time (step * dt) and integer step of each frame
    <other state variables>   written once (Gaussian: obs (agent, obs_dim), when the model has them)
    checkpoints/step-<12 digits>/   full state + ``aux__<name>`` integrator arrays; attrs: step,
                              rng_state, terms, scenario, vfesim_version, backend, frames_saved

Frame ``f`` holds step ``f * save_every``, and the last step of the run is always saved: when it is
off that grid it gets a frame of its own (the ``step`` coordinate says which step each frame holds;
see :func:`frame_steps`). Trajectory writes start at chunk boundaries of the
``time`` axis: a full chunk is written once; at a checkpoint the current partial chunk is written
from its start and rewritten when it fills. Zarr's local store replaces each chunk file atomically,
so a kill mid-write leaves the old or the new chunk, never a torn one, and nothing is ever appended
(no metadata change while running). Checkpoints are written to ``checkpoints/.tmp-*`` and moved into
place with ``os.replace``; the newest ``keep_checkpoints`` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr
import zarr

from .._version import __version__
from ..family import family_named

__all__ = ["StoreError", "RunStore", "Checkpoint", "FORMAT", "term_var", "frame_steps"]

FORMAT = "vfesim-run/1"
# Trajectory variables of stores written before the attribute existed (all Gaussian).
_LEGACY_TRAJECTORY = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
_CKPT = re.compile(r"^step-(\d{12})$")
log = logging.getLogger("vfesim")


class StoreError(RuntimeError):
    """The run store cannot be created, read or written; the message names the path."""


def term_var(term: str) -> str:
    """Trajectory variable name of an energy term ("total" is the system free energy)."""
    return "system_free_energy" if term == "total" else f"system_energy_{term}"


def frame_steps(n_steps: int, save_every: int, n_frames: int | None = None) -> np.ndarray:
    """Step held by each trajectory frame: ``0, save_every, 2 save_every, ...`` up to ``n_steps``, and
    ``n_steps`` itself as one more frame when it is off that grid. ``n_frames`` (at least the frames
    needed) pads the end with grid steps (frames a longer earlier run had room for)."""
    steps = np.arange(n_steps // save_every + 1, dtype=np.int64) * save_every
    if n_steps % save_every:
        steps = np.append(steps, np.int64(n_steps))
    if n_frames is not None and n_frames > steps.size:
        pad = np.arange(steps.size, n_frames, dtype=np.int64) * save_every
        steps = np.concatenate([steps, pad])
    return steps


def _zkw() -> dict:
    return {"zarr_format": 3, "consolidated": False}


@dataclass(frozen=True)
class Checkpoint:
    """Everything needed to continue a run bitwise: state, integrator aux, RNG state, step."""

    path: Path
    step: int
    state: xr.Dataset
    aux: dict[str, np.ndarray]
    rng_state: dict | None
    terms: dict[str, float]
    attrs: dict


class RunStore:
    """A run's Zarr store; see the module docstring for the layout."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.ckpt_dir = self.path / "checkpoints"
        self._dims: dict[str, tuple[str, ...]] | None = None

    # --- creation ----------------------------------------------------------------------------
    @staticmethod
    def probe(path: str | Path, overwrite: bool = False) -> None:
        """Fail early, before any computing, if ``path`` cannot hold a new run."""
        path = Path(path)
        if path.exists():
            if not overwrite:
                raise StoreError(f"{path}: already exists (pass overwrite / --overwrite, or resume)")
            if not RunStore.is_run(path):
                raise StoreError(f"{path}: exists and is not a vfesim run; refusing to overwrite")
        parent = path.absolute().parent
        probe = parent / f".{path.name}.probe-{uuid.uuid4().hex}"
        try:
            parent.mkdir(parents=True, exist_ok=True)
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            raise StoreError(f"{path}: output location is not writable ({e.strerror or e})") from e

    @staticmethod
    def is_run(path: str | Path) -> bool:
        try:
            meta = json.loads((Path(path) / "zarr.json").read_text())
        except (OSError, ValueError):
            return False
        return meta.get("attributes", {}).get("format") == FORMAT

    @classmethod
    def create(
        cls,
        path: str | Path,
        state: xr.Dataset,
        terms: list[str],
        *,
        trajectory: tuple[str, ...],
        n_steps: int,
        save_every: int,
        dt: float,
        time_chunk: int,
        attrs: dict,
        overwrite: bool = False,
    ) -> RunStore:
        """Preallocate the trajectory of the variables ``trajectory`` (metadata only; the other variables
        of ``state`` are written once) and an empty checkpoints group.

        The store is built at a hidden temporary path beside ``path``; :meth:`publish` moves it into
        place, so a run killed before its first checkpoint leaves no half-made store behind.
        """
        cls.probe(path, overwrite)
        final = Path(path)
        path = final.absolute().parent / f".{final.name}.creating-{uuid.uuid4().hex[:8]}"
        steps = frame_steps(n_steps, save_every)
        n_frames = steps.size
        coords = {
            "time": ("time", steps * dt, {"units": "model time (step * dt)"}),
            "step": ("time", steps),
        }
        data = {k: (state[k].dims, state[k].values) for k in state.data_vars if k not in trajectory}
        meta = {"format": FORMAT, "status": "created", "trajectory_variables": json.dumps(list(trajectory))}
        base = xr.Dataset(data, coords=coords, attrs={**meta, **attrs})
        # Time-indexed arrays: metadata only (no chunk is written until a frame is), fill NaN.
        arrays = {
            k: ((n_frames, *state[k].shape), ("time", *state[k].dims), state[k].dtype, np.nan)
            for k in trajectory
        }
        for t in terms:
            arrays[term_var(t)] = ((n_frames,), ("time",), np.float64, np.nan)
        arrays["saved"] = ((n_frames,), ("time",), np.bool_, False)
        try:
            base.to_zarr(path, mode="w", **_zkw())
            g = zarr.open_group(path, mode="r+", zarr_format=3)
            for name, (shape, dims, dtype, fill) in arrays.items():
                g.create_array(
                    name,
                    shape=shape,
                    chunks=(time_chunk, *shape[1:]),
                    dtype=dtype,
                    fill_value=fill,
                    dimension_names=dims,
                    attributes={"coordinates": "step"},
                )
            g["saved"].attrs["description"] = "frame written (open_run keeps only these)"
            zarr.open_group(path / "checkpoints", mode="w", zarr_format=3)
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            raise StoreError(f"{final}: cannot create the run store ({e})") from e
        return cls(path)

    def publish(self, path: str | Path) -> RunStore:
        """Move a store made by :meth:`create` to ``path`` (replacing a run there) atomically."""
        path = Path(path)
        try:
            if path.exists():
                trash = path.absolute().parent / f".{path.name}.trash-{uuid.uuid4().hex[:8]}"
                os.replace(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(self.path, path)
        except OSError as e:
            raise StoreError(f"{path}: cannot move the new run store into place ({e})") from e
        return RunStore(path)

    # --- metadata ----------------------------------------------------------------------------
    @property
    def attrs(self) -> dict:
        try:
            return dict(zarr.open_group(self.path, mode="r", zarr_format=3).attrs)
        except (FileNotFoundError, zarr.errors.GroupNotFoundError) as e:
            raise StoreError(f"{self.path}: not a vfesim run store ({e})") from None

    def set_attrs(self, **attrs) -> None:
        """Update root attrs (the root zarr.json is replaced atomically by the local store)."""
        zarr.open_group(self.path, mode="r+", zarr_format=3).attrs.update(attrs)

    def trajectory(self) -> dict[str, tuple[str, ...]]:
        """Trajectory variable -> its dims without ``time`` (read once from the store)."""
        if self._dims is None:
            names = self.attrs.get("trajectory_variables")
            names = json.loads(names) if names else _LEGACY_TRAJECTORY
            self._dims = {
                k: tuple(zarr.open_array(self.path / k, mode="r", zarr_format=3).metadata.dimension_names[1:])
                for k in names
            }
        return self._dims

    def n_frames(self) -> int:
        return zarr.open_array(self.path / "saved", mode="r", zarr_format=3).shape[0]

    def time_chunk(self) -> int:
        return zarr.open_array(self.path / "saved", mode="r", zarr_format=3).chunks[0]

    def extend(self, n_steps: int, save_every: int, dt: float) -> None:
        """Make room for the frames of a run to ``n_steps`` (for resume with more or fewer steps):
        every time-indexed array gets the same length, and ``step``/``time`` the new frame steps
        (:func:`frame_steps`). A written frame whose step changes (the old last step, off the save
        grid) is marked unsaved, with every frame after it, before the coordinates change, so the
        store never labels a frame with a step it does not hold; resume rewrites those frames.
        Idempotent: rerun after a kill mid-way, it finishes the job."""
        g = zarr.open_group(self.path, mode="r+", zarr_format=3)
        arrays = [a for _, a in g.arrays() if (a.metadata.dimension_names or ("",))[0] == "time"]
        n = max(frame_steps(n_steps, save_every).size, *(a.shape[0] for a in arrays))
        steps = frame_steps(n_steps, save_every, n)
        old = np.asarray(g["step"][:])
        changed = np.flatnonzero(old != steps[: old.size])
        if changed.size:
            g["saved"][int(changed[0]) :] = False
        for a in arrays:
            if a.shape[0] != n:
                a.resize((n, *a.shape[1:]))
        if changed.size or old.size != n:
            g["step"][:] = steps
            g["time"][:] = steps * dt

    # --- trajectory --------------------------------------------------------------------------
    def write_frames(self, start: int, frames: list[dict[str, np.ndarray]]) -> None:
        """Write frames ``start .. start+len(frames)`` (``start`` is a chunk boundary)."""
        if not frames:
            return
        n = len(frames)
        dims = self.trajectory()
        data = {k: (("time", *d), np.stack([f[k] for f in frames])) for k, d in dims.items()}
        for k in frames[0]:
            if k not in dims:
                data[k] = (("time",), np.array([f[k] for f in frames], np.float64))
        region = {"time": slice(start, start + n)}
        try:
            xr.Dataset(data).to_zarr(self.path, region=region, **_zkw())
            # Marked saved only after every variable's chunk is in place.
            xr.Dataset({"saved": (("time",), np.ones(n, bool))}).to_zarr(self.path, region=region, **_zkw())
        except OSError as e:
            raise StoreError(f"{self.path}: writing frames {start}..{start + n - 1} failed ({e})") from e

    def read_frames(self, start: int, stop: int) -> list[dict[str, np.ndarray]]:
        """Frames ``start .. stop-1`` back from disk (to refill a partial chunk on resume)."""
        if stop <= start:
            return []
        ds = xr.open_zarr(self.path, chunks=None, **_zkw()).isel(time=slice(start, stop)).load()
        if not bool(ds["saved"].all()):
            raise StoreError(f"{self.path}: frames {start}..{stop - 1} are not all written")
        keys = [k for k in ds.data_vars if "time" in ds[k].dims and k != "saved"]
        return [{k: ds[k].values[i] for k in keys} for i in range(stop - start)]

    # --- checkpoints -------------------------------------------------------------------------
    def checkpoint_steps(self) -> list[int]:
        if not self.ckpt_dir.is_dir():
            return []
        return sorted(int(m[1]) for p in self.ckpt_dir.iterdir() if (m := _CKPT.match(p.name)))

    def write_checkpoint(
        self,
        state: xr.Dataset,
        step: int,
        aux: dict[str, np.ndarray],
        rng_state: dict | None,
        terms: dict[str, float],
        attrs: dict,
        keep: int = 2,
    ) -> Path:
        """Write a checkpoint to a temporary store, ``os.replace`` it into place, prune old ones."""
        state = state.as_numpy()
        data = {k: state[k] for k in state.data_vars}
        for name, a in aux.items():
            a = np.asarray(a)
            data[f"aux__{name}"] = ([f"aux__{name}__{d}" for d in range(a.ndim)], a)
        ds = xr.Dataset(data)
        ds.attrs = {
            **state.attrs,
            "step": int(step),
            "rng_state": json.dumps(rng_state),
            "terms": json.dumps({k: float(v) for k, v in terms.items()}),
            "aux_names": json.dumps(list(aux)),
            "vfesim_version": __version__,
            **attrs,
        }
        final = self.ckpt_dir / f"step-{step:012d}"
        tmp = self.ckpt_dir / f".tmp-{step:012d}-{uuid.uuid4().hex[:8]}"
        try:
            ds.to_zarr(tmp, mode="w", **_zkw())
            if final.exists():  # a rerun after a crash re-creates the same checkpoint
                self._discard(final)
            os.replace(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreError(f"{self.path}: writing the checkpoint at step {step} failed ({e})") from e
        for old in self.checkpoint_steps()[:-keep]:
            self._discard(self.ckpt_dir / f"step-{old:012d}")
        return final

    def _discard(self, p: Path) -> None:
        # Rename first so a half-deleted checkpoint never looks like a complete one.
        trash = self.ckpt_dir / f".trash-{uuid.uuid4().hex[:8]}"
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def clean(self) -> None:
        """Remove leftovers of killed writes: temporary checkpoints, trash, partial chunk files."""
        if self.ckpt_dir.is_dir():
            for p in self.ckpt_dir.iterdir():
                if p.name.startswith((".tmp-", ".trash-")):
                    shutil.rmtree(p, ignore_errors=True)
        for p in self.path.rglob("*.partial"):
            p.unlink(missing_ok=True)

    def load_checkpoint(self, step: int) -> Checkpoint:
        p = self.ckpt_dir / f"step-{step:012d}"
        ds = xr.open_zarr(p, chunks=None, **_zkw()).load()
        names = json.loads(ds.attrs["aux_names"])
        required = family_named(ds.attrs.get("agent_family", "gaussian")).required
        missing = [k for k in (*required, *(f"aux__{n}" for n in names)) if k not in ds]
        if missing:
            raise StoreError(f"{p}: incomplete checkpoint, missing {missing}")
        aux = {n: ds[f"aux__{n}"].values for n in names}
        state = ds.drop_vars([f"aux__{n}" for n in names])
        state = state.drop_dims([d for d in state.dims if d.startswith("aux__")])
        keep = ("agent_family", "model_config", "vfesim_version", "dtype")
        state.attrs = {k: ds.attrs[k] for k in keep if k in ds.attrs}
        return Checkpoint(
            path=p,
            step=int(ds.attrs["step"]),
            state=state,
            aux=aux,
            rng_state=json.loads(ds.attrs["rng_state"]),
            terms=json.loads(ds.attrs["terms"]),
            attrs=dict(ds.attrs),
        )

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint that loads completely (older ones are tried if it does not)."""
        for step in reversed(self.checkpoint_steps()):
            try:
                return self.load_checkpoint(step)
            except Exception as e:  # a damaged checkpoint: say so and fall back to the previous
                log.warning("checkpoint at step %d is unreadable (%s); trying an older one", step, e)
        return None
