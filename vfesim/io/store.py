"""The run store (SPEC §5): one Zarr v3 directory per run.

Layout of ``RUN.zarr`` (variable names, dims and units: docs/outputs.md)::

    zarr.json                 root group; attrs: format, scenario (JSON), model_config (JSON),
                              agent_family, trajectory_variables (JSON), observables (JSON),
                              vfesim_version, dtype, backend, status
    <trajectory variables>    (time, agent, ...) arrays of the family's moving variables (Gaussian:
                              mu_q, sigma_q, mu_p, sigma_p, phi), preallocated for the whole run
    energy_<term>             (time,) energy terms of each saved frame (energy_total: F)
    <observables>             (time,) or (time, agent, ...) per saved frame (attention_entropy, ...)
    saved                     (time,) bool, True once a frame is written (fill value False)
    time, step                coordinates: physical time (step * dt) and integer step of each frame
    latent, gauge, ...        integer coordinates of the other dims; population labels (camp) on agent
    <other state variables>   written once (Gaussian: obs (agent, obs_dim), when the model has them)
    checkpoints/step-<12 digits>/   full state + ``aux__<name>`` integrator arrays; attrs: step,
                              rng_state, terms, scenario, vfesim_version, backend, frames_saved

Every variable carries CF ``long_name`` and ``units``. Agent-indexed arrays are chunked along ``agent``
(:data:`DEFAULT_AGENT_CHUNK` agents per chunk unless the run says otherwise) as well as along ``time``, so
a large run opens lazily chunk by chunk.

Frame ``f`` holds step ``f * save_every``, and the last step of the run is always saved: when it is
off that grid it gets a frame of its own (the ``step`` coordinate says which step each frame holds;
see :func:`frame_steps`). Trajectory writes start at chunk boundaries of the
``time`` axis: a full chunk is written once; at a checkpoint the current partial chunk is written
from its start and rewritten when it fills. Zarr's local store replaces each chunk file atomically,
so a kill mid-write leaves the old or the new chunk, never a torn one, and nothing is ever appended
(no metadata change while running). Checkpoints are written to ``checkpoints/.tmp-*`` and moved into
place with ``os.replace``; the newest ``keep_checkpoints`` are kept.

Formats: this vfesim writes ``vfesim-run/2``; it reads (opens, inspects, plots, verifies) stores of
``vfesim-run/1`` too, whose energies ``system_free_energy`` / ``system_energy_<term>`` :func:`open_run`
shows under their new names, but resumes only ``vfesim-run/2``.

Integrity (:mod:`.integrity`): every chunk carries a CRC-32C and every chunk is written, so
:meth:`RunStore.verify` finds flipped, truncated and missing chunks and damaged metadata. A resume
verifies before it changes anything: a damaged checkpoint is renamed ``checkpoints/damaged-step-*``
(kept, never pruned) and the previous intact one is used; damaged trajectory chunks stop the resume.
Nothing in a store may be a symbolic link, and every delete stays inside the store's real path.
A run being created lives at the hidden ``.NAME.creating-*`` beside ``NAME`` until its first
checkpoint is written; one left by a killed run is removed by the next run or resume of ``NAME``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

# zarr is imported in the functions that use it: `import vfesim` for energies or dynamics alone does not
# pay its import (about a quarter of a second of every process's start on the GPU hosts).
from .._version import __version__
from ..family import family_named
from ..schema import attrs_of, dim_coords, term_var
from .integrity import Damage, GroupReport, check_array, checksummed_encoding

__all__ = [
    "StoreError",
    "RunStore",
    "Checkpoint",
    "FORMAT",
    "FORMATS",
    "DEFAULT_AGENT_CHUNK",
    "term_var",
    "frame_steps",
]

FORMAT = "vfesim-run/2"
# Formats this vfesim reads (it writes and resumes FORMAT only).
FORMATS = ("vfesim-run/1", FORMAT)
# Agents per Zarr chunk of agent-indexed arrays, unless the run sets it (dask runs: their agent chunks).
DEFAULT_AGENT_CHUNK = 4096
# Trajectory variables of stores written before the attribute existed (all Gaussian).
_LEGACY_TRAJECTORY = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
_CKPT = re.compile(r"^step-(\d{12})$")
_DAMAGED = re.compile(r"^damaged-step-\d{12}(-[0-9a-f]{8})?$")
_LEFTOVER = (".tmp-", ".trash-")
log = logging.getLogger("vfesim")


def _stack(arrays: list):
    """Frames stacked along a new leading time axis, one chunk along time (Dask arrays stay Dask)."""
    if any(map(_is_dask, arrays)):
        import dask.array as da

        return da.stack(arrays).rechunk({0: len(arrays)})
    return np.stack(arrays)


def _one_task_per_chunk(a, zchunks: tuple[int, ...]):
    """Dask frames ``a`` (time first, one chunk along time) rechunked, where needed, so that every Zarr
    chunk (``zchunks``) lies inside one of its chunks: its chunk boundaries on the other axes fall on
    Zarr chunk boundaries (the agent chunks of a chunked run already do: ``store_chunk``)."""
    for cs, z in zip(a.chunks[1:], zchunks[1:], strict=True):
        if any(b % z for b in np.cumsum(cs)[:-1]):
            return a.rechunk((a.shape[0], *zchunks[1:]))
    return a


class StoreError(RuntimeError):
    """The run store cannot be created, read or written; the message names the path."""


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


def _agent_chunked(shape: tuple, dims: tuple, agent_chunk: int | None) -> tuple:
    """Chunk shape of an array of ``shape``: ``agent_chunk`` along a leading ``agent`` dim, else whole."""
    if agent_chunk is None or not dims or dims[0] != "agent":
        return tuple(shape)
    return (min(agent_chunk, shape[0]), *shape[1:])


def _fill(dtype) -> float | int:
    """Fill value of a trajectory array: NaN, or -1 for integers."""
    return np.nan if np.issubdtype(dtype, np.inexact) else -1


def _is_dask(a) -> bool:
    return type(a).__module__.startswith("dask.")


def _zkw() -> dict:
    return {"zarr_format": 3, "consolidated": False}


def _why(e: OSError) -> str:
    """The reason of an OSError without its file name (which may be a hidden temporary path)."""
    return e.strerror or str(e)


def _creating_prefix(path: Path) -> str:
    return f".{path.name}.creating-"


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
    """A run's Zarr store; see the module docstring for the layout.

    shown: the path named in messages (the user's path while the store is still being created at
    its hidden temporary path).
    """

    def __init__(self, path: str | Path, shown: str | Path | None = None):
        self.path = Path(path)
        self.shown = Path(shown) if shown is not None else self.path
        self.ckpt_dir = self.path / "checkpoints"
        self._dims: dict[str, tuple[str, ...]] | None = None
        self._all_dims: dict[str, tuple[str, ...]] = {}

    # --- creation ----------------------------------------------------------------------------
    @staticmethod
    def probe(path: str | Path, overwrite: bool = False) -> None:
        """Fail early, before any computing, if ``path`` cannot hold a new run."""
        path = Path(path)
        if path.exists() or path.is_symlink():
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
            raise StoreError(f"{path}: output location is not writable ({_why(e)})") from e

    @staticmethod
    def is_run(path: str | Path) -> bool:
        try:
            meta = json.loads((Path(path) / "zarr.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(meta, dict) and meta.get("attributes", {}).get("format") in FORMATS

    @staticmethod
    def remove_stale_creating(path: str | Path) -> list[str]:
        """Remove ``.NAME.creating-*`` stores left beside ``path`` by runs killed before their first
        checkpoint; returns their names. Call it holding the store's lock: every creator holds it
        while it creates, so a creating store found then belongs to a process that is gone."""
        path = Path(path).absolute()
        if not path.parent.is_dir():
            return []
        gone = []
        for p in sorted(path.parent.glob(_creating_prefix(path) + "*")):
            if p.is_symlink() or not p.is_dir():
                raise StoreError(f"{p}: not a directory vfesim made; remove it by hand")
            shutil.rmtree(p)
            gone.append(p.name)
            log.warning(
                "%s: a run on this path was killed before its first checkpoint; "
                "removed its unfinished store %s",
                path,
                p.name,
            )
        return gone

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
        agent_chunk: int | None = None,
        records: Mapping[str, tuple[tuple[str, ...], tuple[int, ...], Mapping[str, str]]] | None = None,
        labels: Mapping[str, np.ndarray] | None = None,
    ) -> RunStore:
        """Preallocate the trajectory of the variables ``trajectory`` (metadata only; the other variables
        of ``state`` are written once), the energies ``energy_<term>`` of ``terms``, the per-frame
        ``records`` (name -> (dims and shape after ``time``, attributes); float64, e.g. observables)
        and an empty checkpoints group. ``labels``: name -> (N,) population labels, saved as coordinates
        on ``agent``.

        agent_chunk: agents per Zarr chunk of agent-indexed arrays (default :data:`DEFAULT_AGENT_CHUNK`).
        Runs whose state is chunked along ``agent`` (the dask backend) give a size that divides every
        chunk boundary, so each worker writes whole Zarr chunks of its own agents.

        The store is built at a hidden temporary path beside ``path``; :meth:`publish` moves it into
        place, so a run killed before its first checkpoint leaves no half-made store at ``path``. A
        failure here (disk full, no memory) removes the temporary store and names ``path``.
        """
        import zarr

        cls.probe(path, overwrite)
        final = Path(path)
        tmp = final.absolute().parent / f"{_creating_prefix(final)}{uuid.uuid4().hex[:8]}"
        steps = frame_steps(n_steps, save_every)
        n_frames = steps.size
        agent_chunk = DEFAULT_AGENT_CHUNK if agent_chunk is None else agent_chunk
        records = dict(records or {})
        labels = dict(labels or {})
        sizes = dict(state.sizes)
        for dims, shape, _ in records.values():
            sizes.update(zip(dims, shape, strict=True))
        coords = {
            **dim_coords(sizes),
            **{k: (v.dims, v.values, v.attrs) for k, v in state.coords.items()},
            "time": ("time", steps * dt, attrs_of("time")),
            "step": ("time", steps, attrs_of("step")),
        }
        for name, values in labels.items():
            coords[name] = ("agent", np.asarray(values), attrs_of(name))
        data = {k: state[k].variable for k in state.data_vars if k not in trajectory}
        meta = {"format": FORMAT, "status": "created", "trajectory_variables": json.dumps(list(trajectory))}
        base = xr.Dataset(data, coords=coords, attrs={**meta, **attrs})
        # Time-indexed arrays: metadata only (no chunk is written until a frame is), fill NaN (integer
        # variables, e.g. Born outcomes: -1). Complex variables are Zarr v3 complex arrays.
        arrays = {
            k: (
                (n_frames, *state[k].shape),
                ("time", *state[k].dims),
                state[k].dtype,
                _fill(state[k].dtype),
                state[k].attrs,
            )
            for k in trajectory
        }
        for t in terms:
            arrays[term_var(t)] = ((n_frames,), ("time",), np.float64, np.nan, attrs_of(term_var(t)))
        for name, (dims, shape, a) in records.items():
            arrays[name] = ((n_frames, *shape), ("time", *dims), np.float64, np.nan, a)
        arrays["saved"] = ((n_frames,), ("time",), np.bool_, False, attrs_of("saved"))
        try:
            enc = checksummed_encoding(base.variables)
            base.to_zarr(tmp, mode="w", encoding=enc, write_empty_chunks=True, **_zkw())
            g = zarr.open_group(tmp, mode="r+", zarr_format=3)
            for name, (shape, dims, dtype, fill, a) in arrays.items():
                g.create_array(
                    name,
                    shape=shape,
                    chunks=(time_chunk, *_agent_chunked(shape[1:], dims[1:], agent_chunk)),
                    dtype=dtype,
                    fill_value=fill,
                    compressors=checksummed_encoding([name])[name]["compressors"],
                    dimension_names=dims,
                    attributes={**a, "coordinates": " ".join(["step", *(labels if "agent" in dims else ())])},
                )
            zarr.open_group(tmp / "checkpoints", mode="w", zarr_format=3)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):
                raise StoreError(f"{final}: cannot create the run store ({_why(e)})") from e
            raise
        return cls(tmp, shown=final)

    def publish(self, path: str | Path, overwrite: bool = False) -> RunStore:
        """Move a store made by :meth:`create` to ``path`` atomically. A run store already at
        ``path`` is replaced only with ``overwrite``; anything else there is never moved."""
        path = Path(path)
        try:
            if path.exists() or path.is_symlink():
                if not overwrite or not RunStore.is_run(path):
                    raise StoreError(
                        f"{path}: something appeared there while this run was being created; not replacing it"
                    )
                trash = path.absolute().parent / f".{path.name}.trash-{uuid.uuid4().hex[:8]}"
                os.replace(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(self.path, path)
        except OSError as e:
            raise StoreError(f"{path}: cannot move the new run store into place ({_why(e)})") from e
        return RunStore(path)

    # --- metadata ----------------------------------------------------------------------------
    @property
    def attrs(self) -> dict:
        """Root attrs; a missing or damaged root zarr.json is a StoreError naming the path."""
        f = self.path / "zarr.json"
        if not self.path.exists():
            raise StoreError(f"{self.shown}: not a vfesim run store (it does not exist)")
        try:
            meta = json.loads(f.read_bytes())
        except FileNotFoundError:
            raise StoreError(f"{self.shown}: not a vfesim run store (no zarr.json)") from None
        except (OSError, ValueError) as e:
            raise StoreError(
                f"{self.shown}: zarr.json is damaged ({e}); `vfesim verify {self.shown}` checks the rest"
            ) from None
        attrs = meta.get("attributes") if isinstance(meta, dict) else None
        if not isinstance(attrs, dict) or attrs.get("format") not in FORMATS:
            raise StoreError(f"{self.shown}: not a vfesim run store (zarr.json has no format {FORMAT!r})")
        return attrs

    def attr(self, key: str) -> str:
        """One root attribute; its absence is a StoreError naming it and the path."""
        attrs = self.attrs
        if key not in attrs:
            raise StoreError(
                f"{self.shown}: zarr.json has no attribute {key!r} (not written by vfesim, or damaged)"
            )
        return attrs[key]

    def set_attrs(self, **attrs) -> None:
        """Update root attrs (the root zarr.json is replaced atomically by the local store)."""
        import zarr

        zarr.open_group(self.path, mode="r+", zarr_format=3).attrs.update(attrs)

    def check_entries(self) -> None:
        """Refuse a store that holds symbolic links or foreign entries among its checkpoints: writes
        and deletes through them would land outside the store."""
        real = self.path.resolve()
        for top, dirs, files in os.walk(real):
            for name in (*dirs, *files):
                p = Path(top) / name
                if p.is_symlink():
                    raise StoreError(
                        f"{self.shown}: {p.relative_to(real)} is a symbolic link (to {os.readlink(p)}); "
                        "a run store holds only its own files, refusing to write through it"
                    )
        if self.ckpt_dir.exists() and not self.ckpt_dir.is_dir():
            raise StoreError(f"{self.shown}: checkpoints is not a directory")
        for p in self.ckpt_dir.iterdir() if self.ckpt_dir.is_dir() else []:
            ok = p.name == "zarr.json" or _CKPT.match(p.name) or _DAMAGED.match(p.name)
            if not (ok or p.name.startswith(_LEFTOVER)):
                raise StoreError(
                    f"{self.shown}: checkpoints/{p.name} is not a vfesim checkpoint; "
                    "refusing to write next to it (move it out of the store)"
                )

    def _remove(self, p: Path) -> None:
        """Delete ``p``, which must be inside the store's real path and not a link."""
        real, target = self.path.resolve(), p.resolve()
        if p.is_symlink() or target == real or not target.is_relative_to(real):
            raise StoreError(f"{self.shown}: refusing to delete {p}: it is not inside the store")
        shutil.rmtree(p, ignore_errors=True)

    def trajectory(self) -> dict[str, tuple[str, ...]]:
        """Trajectory variable -> its dims without ``time`` (read once from the store)."""
        import zarr

        if self._dims is None:
            names = self.attrs.get("trajectory_variables")
            names = json.loads(names) if names else _LEGACY_TRAJECTORY
            self._dims = {
                k: tuple(zarr.open_array(self.path / k, mode="r", zarr_format=3).metadata.dimension_names[1:])
                for k in names
            }
        return self._dims

    def n_frames(self) -> int:
        import zarr

        return zarr.open_array(self.path / "saved", mode="r", zarr_format=3).shape[0]

    def time_chunk(self) -> int:
        import zarr

        return zarr.open_array(self.path / "saved", mode="r", zarr_format=3).chunks[0]

    def extend(self, n_steps: int, save_every: int, dt: float) -> None:
        """Make room for the frames of a run to ``n_steps`` (for resume with more or fewer steps):
        every time-indexed array gets the same length, and ``step``/``time`` the new frame steps
        (:func:`frame_steps`). A written frame whose step changes (the old last step, off the save
        grid) is marked unsaved, with every frame after it, before the coordinates change, so the
        store never labels a frame with a step it does not hold; resume rewrites those frames.
        Idempotent: rerun after a kill mid-way, it finishes the job."""
        import zarr

        # Every chunk is written, even one equal to the fill value (verify expects every chunk).
        with zarr.config.set({"array.write_empty_chunks": True}):
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
        """Write frames ``start .. start+len(frames)`` (they may fill time chunks in part)."""
        if not frames:
            return
        n = len(frames)
        data = {}
        for k in frames[0]:
            values = [f[k] if _is_dask(f[k]) else np.asarray(f[k]) for f in frames]
            data[k] = (self.dims_of(k), _stack(values))
        region = {"time": slice(start, start + n)}
        kw = {"region": region, "write_empty_chunks": True, **_zkw()}
        # Dask frames (chunked runs) are one chunk along time (_stack), and _one_task_per_chunk makes
        # every Zarr chunk lie inside one Dask chunk on the other axes: each Zarr chunk is written by one
        # task even where the frames fill a time chunk only in part (the first frame, alone at the first
        # checkpoint), so xarray's alignment check, which assumes several tasks per partial chunk, is off.
        lazy = [k for k, v in data.items() if _is_dask(v[1])]
        for k in lazy:
            dims, a = data[k]
            data[k] = (dims, _one_task_per_chunk(a, self._chunks(k)))
        dask_kw = {"safe_chunks": False} if lazy else {}
        try:
            xr.Dataset(data).to_zarr(self.path, **kw, **dask_kw)
            # Marked saved only after every variable's chunk is in place.
            xr.Dataset({"saved": (("time",), np.ones(n, bool))}).to_zarr(self.path, **kw)
        except OSError as e:
            what = f"writing frames {start}..{start + n - 1}"
            raise StoreError(f"{self.shown}: {what} failed ({_why(e)})") from e

    def dims_of(self, name: str) -> tuple[str, ...]:
        """Dims (``time`` first) of a time-indexed array of the store (read once per array)."""
        import zarr

        if name not in self._all_dims:
            meta = zarr.open_array(self.path / name, mode="r", zarr_format=3).metadata
            self._all_dims[name] = tuple(meta.dimension_names)
        return self._all_dims[name]

    def _chunks(self, name: str) -> tuple[int, ...]:
        """Zarr chunk shape of a time-indexed array."""
        import zarr

        return tuple(zarr.open_array(self.path / name, mode="r", zarr_format=3).chunks)

    def agent_chunk(self) -> int | None:
        """Agents per Zarr chunk of the trajectory (None: the store has no agent-indexed trajectory)."""
        import zarr

        for k, dims in self.trajectory().items():
            if dims and dims[0] == "agent":
                return zarr.open_array(self.path / k, mode="r", zarr_format=3).chunks[1]
        return None

    def read_frames(self, start: int, stop: int, agent_chunks: tuple | None = None) -> list[dict]:
        """Frames ``start .. stop-1`` back from disk (to refill a partial chunk on resume).

        agent_chunks: chunk sizes along ``agent``: the trajectory variables come back as Dask arrays
        read by the scheduler's workers (energy terms as floats, observables as NumPy arrays, as the
        run loop makes them), else as NumPy arrays."""
        if stop <= start:
            return []
        ds = xr.open_zarr(self.path, chunks=None, **_zkw()).isel(time=slice(start, stop))
        saved = ds["saved"].values
        if not bool(saved.all()):
            raise StoreError(f"{self.shown}: frames {start}..{stop - 1} are not all written")
        keys = [k for k in ds.data_vars if "time" in ds[k].dims and k != "saved"]
        if agent_chunks is None:
            ds = ds.load()
            return [{k: ds[k].values[i] for k in keys} for i in range(stop - start)]
        lazy = xr.open_zarr(self.path, chunks={}, **_zkw()).isel(time=slice(start, stop))
        out = []
        for i in range(stop - start):
            f = {}
            for k in keys:
                if k in self.trajectory():
                    f[k] = lazy[k].data[i].rechunk((agent_chunks, *lazy[k].shape[2:]))
                elif ds[k].ndim == 1:
                    f[k] = float(ds[k].values[i])
                else:
                    f[k] = ds[k].values[i]
            out.append(f)
        return out

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
        agent_chunk: int | None = None,
    ) -> Path:
        """Write a checkpoint to a temporary store, ``os.replace`` it into place, prune old ones.

        State and aux arrays may be Dask arrays chunked along agents (the dask backend): the
        scheduler's workers then write them, ``agent_chunk`` agents per Zarr chunk (a size dividing
        every Dask chunk boundary), and only the attributes (step, RNG state, terms) come from here."""
        lazy = any(_is_dask(state[k].data) for k in state.data_vars) or any(map(_is_dask, aux.values()))
        if not lazy:
            state = state.as_numpy()
        data = {k: state[k] for k in state.data_vars}
        for name, a in aux.items():
            a = a if _is_dask(a) else np.asarray(a)
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
            enc = checksummed_encoding(ds.variables)
            if lazy:
                for k, v in ds.variables.items():
                    if _is_dask(v.data) and agent_chunk is not None:
                        enc[k]["chunks"] = (min(agent_chunk, v.shape[0]), *v.shape[1:])
            ds.to_zarr(tmp, mode="w", encoding=enc, write_empty_chunks=True, **_zkw())
            if final.exists():  # only a damaged checkpoint is ever rewritten: keep its bytes
                self.set_aside(step)
            os.replace(tmp, final)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreError(f"{self.shown}: writing the checkpoint at step {step} failed ({_why(e)})") from e
        for old in self.checkpoint_steps()[:-keep]:
            self._discard(self.ckpt_dir / f"step-{old:012d}")
        return final

    def _discard(self, p: Path) -> None:
        # Rename first so a half-deleted checkpoint never looks like a complete one.
        trash = self.ckpt_dir / f".trash-{uuid.uuid4().hex[:8]}"
        os.replace(p, trash)
        self._remove(trash)

    def set_aside(self, step: int) -> Path:
        """Rename the checkpoint at ``step`` to ``damaged-step-…``: kept as it is, never resumed
        from or pruned (``vfesim verify`` still reports it)."""
        src = self.ckpt_dir / f"step-{step:012d}"
        dst = self.ckpt_dir / f"damaged-{src.name}"
        if dst.exists():
            dst = dst.with_name(f"{dst.name}-{uuid.uuid4().hex[:8]}")
        os.replace(src, dst)
        return dst

    def clean(self) -> None:
        """Remove leftovers of killed writes: temporary checkpoints, trash, partial chunk files."""
        if self.ckpt_dir.is_dir():
            for p in self.ckpt_dir.iterdir():
                if p.name.startswith(_LEFTOVER):
                    self._remove(p)
        for p in self.path.rglob("*.partial"):
            if not p.is_symlink() and p.resolve().is_relative_to(self.path.resolve()):
                p.unlink(missing_ok=True)

    def load_checkpoint(self, step: int, agent_chunks: tuple | None = None) -> Checkpoint:
        """The checkpoint at ``step``, in memory; with ``agent_chunks`` (chunk sizes along agents) its
        state and aux arrays are Dask arrays with those chunks, read by the scheduler's workers."""
        p = self.ckpt_dir / f"step-{step:012d}"
        ds = xr.open_zarr(p, chunks=None if agent_chunks is None else {}, **_zkw())
        if agent_chunks is None:
            ds = ds.load()
        else:
            # Every state and aux array has agents first.
            data = {k: (v.dims, v.data.rechunk((agent_chunks, *v.shape[1:]))) for k, v in ds.items()}
            ds = xr.Dataset(data, attrs=ds.attrs)
        names = json.loads(ds.attrs["aux_names"])
        required = family_named(ds.attrs.get("agent_family", "gaussian")).required
        missing = [k for k in (*required, *(f"aux__{n}" for n in names)) if k not in ds]
        if missing:
            raise StoreError(f"{p}: incomplete checkpoint, missing {missing}")
        aux = {n: ds[f"aux__{n}"].data for n in names}
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

    # --- verification ------------------------------------------------------------------------
    def _checkpoint_attrs(self, name: str) -> dict:
        meta = json.loads((self.ckpt_dir / name / "zarr.json").read_bytes())
        attrs = meta["attributes"]
        for key in ("step", "aux_names", "rng_state", "terms", "scenario"):
            if key not in attrs:
                raise ValueError(f"attribute {key!r} missing")
        return attrs

    def verify_checkpoint(self, name: str) -> GroupReport:
        """Every array and chunk of the checkpoint ``checkpoints/<name>`` (``name``: ``step-…``)."""
        node = f"checkpoints/{name}"
        damage, expected = [], set()
        try:
            attrs = self._checkpoint_attrs(name)
            family = family_named(attrs.get("agent_family", "gaussian"))
            expected = {*family.required, *(f"aux__{n}" for n in json.loads(attrs["aux_names"]))}
        except FileNotFoundError:
            damage.append(Damage(node, "zarr.json", "missing"))
        except Exception as e:  # bad JSON, a missing attribute, an unknown family
            damage.append(Damage(node, "zarr.json", f"unreadable metadata ({e})"))
        d = self.ckpt_dir / name
        present = {p.name for p in d.iterdir() if p.is_dir()} if d.is_dir() else set()
        reports = tuple(check_array(self.path, f"{node}/{k}") for k in sorted(expected | present))
        damage += [x for r in reports for x in r.damage]
        return GroupReport(f"checkpoint {name}", reports, tuple(damage))

    def verify_trajectory(self, frames_written: int) -> GroupReport:
        """Every array of the root group (trajectory, coordinates, variables saved once); of the
        time-indexed ones, chunks of frames below ``frames_written`` must exist."""
        damage, names = [], {"saved", "time", "step"}
        try:
            names |= set(self.trajectory())
        except Exception as e:  # a damaged root zarr.json or array metadata: found again below
            log.debug("trajectory variables unknown (%s)", e)
        names |= {p.name for p in self.path.iterdir() if p.is_dir() and not p.name.startswith(".")}
        names.discard("checkpoints")
        reports = tuple(check_array(self.path, k, frames_written) for k in sorted(names))
        damage += [x for r in reports for x in r.damage]
        return GroupReport("trajectory", reports, tuple(damage))

    def intact_checkpoint(self) -> tuple[Checkpoint | None, dict[int, GroupReport]]:
        """The newest checkpoint whose every chunk verifies and that loads, and every damaged one
        (step -> report). Logs a warning per damaged checkpoint; changes nothing."""
        damaged: dict[int, GroupReport] = {}
        found = None
        for step in reversed(self.checkpoint_steps()):
            report = self.verify_checkpoint(f"step-{step:012d}")
            if report.intact and found is None:
                try:
                    found = self.load_checkpoint(step)
                except Exception as e:  # verified chunks, yet it does not load: damage all the same
                    d = Damage(f"checkpoints/step-{step:012d}", "zarr.json", f"does not load ({e})")
                    report = GroupReport(report.name, report.arrays, (d,))
            if not report.intact:
                damaged[step] = report
                log.warning("checkpoint at step %d is damaged: %s", step, report.summary())
        return found, damaged

    def latest_checkpoint(self) -> Checkpoint | None:
        """The newest intact checkpoint (older ones are tried if it is damaged), or None."""
        return self.intact_checkpoint()[0]

    def frames_written(self) -> int:
        """Frames the run wrote, as far as an undamaged record says: the longest prefix of ``saved``
        and the ``frames_saved`` of every readable checkpoint."""
        import zarr

        n = 0
        for p in self.ckpt_dir.iterdir() if self.ckpt_dir.is_dir() else []:
            try:
                n = max(n, int(self._checkpoint_attrs(p.name)["frames_saved"]))
            except Exception:  # not a checkpoint, or a damaged one: verify reports it
                continue
        try:
            saved = np.asarray(zarr.open_array(self.path / "saved", mode="r", zarr_format=3)[:], bool)
            n = max(n, int(np.argmin(saved)) if not saved.all() else saved.size)
        except Exception as e:  # damaged: the trajectory report names it
            log.debug("saved unreadable (%s)", e)
        return n

    def verify(self) -> list[GroupReport]:
        """Check the whole store: root metadata, links, every array and chunk of the trajectory and
        of every checkpoint (set-aside damaged ones included). Changes nothing."""
        root = []
        try:
            _ = self.attrs
        except StoreError as e:
            root.append(Damage("", "zarr.json", str(e).removeprefix(f"{self.shown}: ")))
        try:
            self.check_entries()
        except StoreError as e:
            root.append(Damage("", "entries", str(e).removeprefix(f"{self.shown}: ")))
        out = [GroupReport("store", (), tuple(root))] if root else []
        out.append(self.verify_trajectory(self.frames_written()))
        names = sorted(p.name for p in self.ckpt_dir.iterdir()) if self.ckpt_dir.is_dir() else []
        for name in names:
            if _CKPT.match(name) or _DAMAGED.match(name):
                out.append(self.verify_checkpoint(name))
        return out
