"""The run loop (SPEC §5): init -> step -> save frames / checkpoint, and resume from a checkpoint.

``simulate(scenario, out=...)`` and ``resume(out)`` return a :class:`Run` (path, scenario, final step,
final state and energy terms); ``Run.open()`` gives the trajectory as a lazy xarray Dataset.

Backend "cuda": the integrator keeps state and integrator arrays on the device for the whole run; the
host sees energy terms (floats) per step, and copies of the state only at save and checkpoint steps.
A resumed run loads its checkpoint back onto the device. ``Run.state`` is on the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from ._version import __version__
from .arrays import host_array
from .config import ModelConfig
from .family import family_of
from .io.lock import store_lock
from .io.reader import open_run
from .io.store import FORMAT, RunStore, StoreError, frame_steps
from .observables import Observables
from .progress import Progress, log
from .scenario import Scenario, ScenarioError, find_scenario, load_scenario, read_toml
from .schema import ENERGY_PREFIX, term_var

__all__ = ["Run", "simulate", "resume", "RunError", "Terminated", "frame_bytes"]

TARGET_CHUNK_BYTES = 16 * 2**20
# A run holds one time chunk of frames in memory, and zstd compresses one chunk in one call.
MAX_CHUNK_BYTES = 2**31 - 1


class RunError(RuntimeError):
    """A run cannot be started or resumed (incompatible store, version or config)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM during ``simulate``/``resume``: raised like Ctrl-C, so the run stops the same way."""


class _Signals:
    """SIGINT and SIGTERM during a run. While the run steps (``deferring``), the first signal asks it to
    stop after the step in progress, checkpoint that step and exit; a second signal, or one outside the
    steps (setup, resume checks, the final checkpoint write), interrupts at once: the store then
    resumes from its last complete checkpoint (checkpoints are written aside and renamed)."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: KeyboardInterrupt | None = None

    def handler(self, signum, frame) -> None:
        exc = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        if self.deferring and self.pending is None:
            self.pending = exc
            log.warning(
                "%s: stopping after the current step to checkpoint it (again to stop at once)",
                "SIGTERM" if signum == signal.SIGTERM else "interrupt",
            )
            return
        raise exc


@contextlib.contextmanager
def _run_signals():
    """Route SIGINT and SIGTERM through a :class:`_Signals` for the block. Only in the main thread, and
    only for signals whose handler is Python's default (SIGTERM: raised as :class:`Terminated`)."""
    sig = _Signals()
    if threading.current_thread() is not threading.main_thread():
        yield sig
        return
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    mine = [s for s, d in defaults.items() if signal.getsignal(s) is d]
    for s in mine:
        signal.signal(s, sig.handler)
    try:
        yield sig
    finally:
        for s in mine:
            signal.signal(s, defaults[s])


def _reported(e: BaseException) -> BaseException:
    """Mark ``e`` as already reported to the log (the CLI then adds nothing)."""
    e.vfesim_reported = True
    return e


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished (or stopped) run: where it is, what it ran, and where it ended."""

    path: Path
    scenario: Scenario
    step: int
    state: xr.Dataset
    terms: dict[str, float]

    def open(self) -> xr.Dataset:
        """The trajectory: ``vfesim.open_run(self.path)``."""
        return open_run(self.path)


def _host_state(state: xr.Dataset) -> xr.Dataset:
    """``state`` with NumPy data (device runs keep it on the device until the end)."""
    if all(isinstance(state[k].data, np.ndarray) for k in state.data_vars):
        return state
    return state.as_numpy()


def _is_dask(a: Any) -> bool:
    return type(a).__module__.startswith("dask.")


def _frame(carry, names, obs: Observables) -> dict[str, Any]:
    """A trajectory frame: the state's trajectory variables (host arrays; Dask arrays of a chunked run
    stay on the workers), the energy terms and the observables."""
    f = {k: (a if _is_dask(a) else host_array(a)) for k in names for a in (carry.state[k].data,)}
    f.update({term_var(k): float(v) for k, v in carry.terms.items()})
    f.update(obs.evaluate(carry.state))
    return f


def _observables(scn: Scenario, state: xr.Dataset, python) -> tuple[Observables, list[str]]:
    """The observables of a run: the scenario's built-ins (:meth:`Scenario.observables`) and the Python
    ones given to simulate/resume (a name in both is an error); and the names of the Python ones."""
    if python is None:
        python = {}
    elif isinstance(python, Mapping):
        python = dict(python)
    elif isinstance(python, (list, tuple)):
        python = {k: k for k in python}
    else:
        raise TypeError(
            "observables: expected a mapping name -> function (or built-in name) or a list of built-in "
            f"names, got {type(python).__name__}"
        )
    builtin = scn.observables()
    both = sorted(set(builtin) & set(python))
    if both:
        raise ScenarioError("output.observables", f"{both} also given as observables= (name them once)")
    spec = {**{k: k for k in builtin}, **python}
    return Observables(spec, scn.model, state.sizes["agent"], list(state.data_vars)), sorted(python)


def frame_bytes(state: xr.Dataset, names) -> int:
    return sum(state[k].nbytes for k in names)


def _make_integrator(scn: Scenario, backend: str, state: xr.Dataset):
    """The scenario's integrator; on the dask backend with the run's chunking fixed (``run.chunks``,
    else the default chunking of the population, a function of N and the feature length only, so a
    resumed run chunks as the original did)."""
    from .integrators import make_integrator

    ig = scn.integrator
    if backend == "dask":
        from .backends import get
        from .backends.dask_backend import auto_chunk

        n = state.sizes["agent"]
        chunks = scn.run.get("chunks") or auto_chunk(
            scn.model, n, {k: state[k].data for k in state.data_vars}
        )
        backend = dataclasses.replace(get(backend), chunks=chunks)
    spec = scn.spec
    if spec is not None:  # a family with its own steppers (vfesim.family.RunSpec)
        try:
            return spec.make_integrator(scn.model, ig, backend=backend, seed=scn.run["seed"])
        except (TypeError, ValueError) as e:
            raise ScenarioError("integrator", str(e)) from None
    try:
        return make_integrator(
            ig["method"],
            scn.model,
            ig["dt"],
            backend=backend,
            friction=ig["friction"],
            seed=scn.run["seed"],
            **ig["options"],
        )
    except (TypeError, ValueError) as e:
        raise ScenarioError("integrator", str(e)) from None


def _with_overrides(scn: Scenario, steps: int | None, backend: str | None, out) -> Scenario:
    run = {}
    if steps is not None:
        run["n_steps"] = steps
    if backend is not None:
        run["backend"] = backend
    if run:
        scn = scn.replace("run", **run)
    if out is not None:
        scn = scn.replace("output", path=str(out))
    return scn


def simulate(
    scenario_or_config: Scenario | ModelConfig | Any | str | Path | dict,
    out: str | Path | None = None,
    *,
    steps: int | None = None,
    backend: str | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
    observables: dict | None = None,
    **sections: dict,
) -> Run:
    """Run a scenario to ``run.n_steps`` (or ``steps``), writing trajectory and checkpoints to ``out``.

    scenario_or_config: a :class:`Scenario`, a TOML path, a nested dict, or a ModelConfig or
    QuantumConfig (then give ``population={...}, integrator={...}, run={...}`` as keyword sections).
    Keyword sections also override a scenario's. ``progress``: None -> a tqdm bar on a terminal or in
    Jupyter, else log lines when logging shows INFO; False -> silent.
    observables: name -> function of the state Dataset (scalar or one value per agent), a built-in name
    or a :class:`vfesim.Observable`; saved per frame next to the scenario's ``output.observables``
    (:mod:`vfesim.observables`). A run with Python observables resumes only from Python, given them again.
    Returns a :class:`Run`; ``Run.open()`` is the lazy trajectory Dataset.
    """
    name, source = "scenario", None
    if isinstance(scenario_or_config, ModelConfig):
        model = scenario_or_config.to_dict(neighbour_lists=False)
        if model.pop("dtype") is not None:
            sections.setdefault("run", {}).setdefault("dtype", scenario_or_config.dtype)
        if not isinstance(model.pop("neighbours"), str):
            raise ScenarioError("model.neighbours", "sparse neighbours: use population.neighbours")
        d = {"model": {k: v for k, v in model.items() if v is not None}}
    elif (spec := _run_spec(scenario_or_config)) is not None:  # e.g. a QuantumConfig
        cfg = scenario_or_config
        if cfg.dtype is not None:
            sections.setdefault("run", {}).setdefault("dtype", cfg.dtype)
        if not cfg.dense:
            raise ScenarioError(f"{spec.section}.neighbours", "sparse neighbours: use population.neighbours")
        d = {spec.section: spec.config_dict(cfg)}
    elif isinstance(scenario_or_config, Scenario):
        d, name = scenario_or_config.to_dict(), scenario_or_config.name
    elif isinstance(scenario_or_config, dict):
        d = {k: dict(v) if isinstance(v, dict) else v for k, v in scenario_or_config.items()}
    else:
        d, name = read_toml(scenario_or_config), Path(scenario_or_config).stem
        source = find_scenario(scenario_or_config)
    for sec, changes in sections.items():
        if not isinstance(changes, dict):
            raise ScenarioError(sec, f"keyword section must be a dict, got {changes!r}")
        d[sec] = {**d.get(sec, {}), **changes}
    scn = Scenario.from_dict(d, name=name, source=source)
    scn = _with_overrides(scn, steps, backend, out)
    path = scn.output["path"]
    if path is None:
        raise ScenarioError("output.path", "give out=... (or --out, or [output] path)")
    RunStore.probe(path, overwrite)  # before the lock: a bad path makes no lock file
    with store_lock(path), _run_signals() as sig:
        RunStore.remove_stale_creating(path)
        RunStore.probe(path, overwrite)  # again: another run may have finished there meanwhile
        return _simulate(scn, Path(path), overwrite, progress, sig, observables)


def _run_spec(obj: Any):
    """The RunSpec of a family config (None for anything else, Gaussian ModelConfigs included)."""
    try:
        return family_of(obj).runs
    except TypeError:
        return None


def _check_time_chunk(chunk: int, frame: int) -> None:
    """A chunk of frames must fit in memory (the run buffers one) and in one zstd call."""
    if chunk * frame > MAX_CHUNK_BYTES:
        raise ScenarioError(
            "output.time_chunk",
            f"{chunk} frames of {frame} bytes are {chunk * frame / 2**30:.3g} GiB per Zarr chunk, "
            f"more than the 2 GiB a chunk may hold (a run keeps one chunk of frames in memory); "
            f"use at most {max(1, MAX_CHUNK_BYTES // frame)}",
        )


def _simulate(
    scn: Scenario, path: Path, overwrite: bool, progress: bool | None, sig: _Signals, python_obs
) -> Run:
    backend_name = _resolve_backend(scn.run["backend"])
    state0 = scn.initial_state()
    obs, python_names = _observables(scn, state0, python_obs)
    first = obs.evaluate(state0)
    integ = _make_integrator(scn, backend_name, state0)
    carry = integ.init(state0)  # a DynamicsError here propagates: nothing was written yet
    run = scn.run
    n_frames = frame_steps(run["n_steps"], run["save_every"]).size
    fpc = max(1, run["checkpoint_every"] // run["save_every"])
    # The variables saved per frame: the stepper's own (a family's RunSpec stepper), else the family's.
    trajectory = getattr(integ, "trajectory", None) or family_of(scn.model).trajectory
    chunking = _chunking(integ, state0)
    # A dask run buffers a time chunk of frames per agent chunk on the workers: size by its agent chunk.
    share = chunking["agent_chunk"] / state0.sizes["agent"] if chunking else 1.0
    fbytes = max(1, int((frame_bytes(state0, trajectory) + sum(v.nbytes for v in first.values())) * share))
    by_size = max(1, TARGET_CHUNK_BYTES // fbytes)
    chunk = scn.output["time_chunk"] or min(fpc, by_size, n_frames)
    if scn.output["time_chunk"]:
        _check_time_chunk(chunk, fbytes)
    attrs = {
        "scenario": scn.to_json(),
        # Sparse lists by their shape: the scenario (population.neighbours) rebuilds them.
        "model_config": scn.model.to_json(neighbour_lists=False),
        "agent_family": family_of(scn.model).name,
        "vfesim_version": __version__,
        "dtype": run["dtype"],
        "backend": backend_name,
        "integrator": carry_name(integ),
        # Observables given to simulate() (not by the scenario): a resume must be given them again.
        "observables": json.dumps({"names": obs.names, "python": python_names}),
    }
    if chunking:
        attrs["chunking"] = json.dumps(chunking)
    store = RunStore.create(
        path,
        state0,
        list(carry.terms),
        trajectory=trajectory,
        n_steps=run["n_steps"],
        save_every=run["save_every"],
        dt=scn.integrator["dt"],
        time_chunk=chunk,
        attrs=attrs,
        overwrite=overwrite,
        agent_chunk=chunking["agent_chunk"] if chunking else None,
        records={k: (obs.dims(k, v), v.shape, obs.var_attrs[k]) for k, v in first.items()},
        labels=scn.labels(),
    )
    log.info("run %s: %d agents, %d steps -> %s", scn.name, state0.sizes["agent"], run["n_steps"], path)
    buf = [_frame(carry, trajectory, obs)]
    try:
        _checkpoint(store, scn, carry, buf, 0, backend_name)
        store = store.publish(path, overwrite)
    except BaseException as e:
        shutil.rmtree(store.path, ignore_errors=True)  # the hidden store this call made, only
        if isinstance(e, KeyboardInterrupt):
            log.error("interrupted before the first checkpoint: no run store was made at %s", path)
            _reported(e)
        raise
    return _advance(store, scn, integ, carry, buf, 0, backend_name, progress, sig, obs)


def _resolve_backend(name: str) -> str:
    from .backends import resolve

    try:
        return resolve(name)
    except (ValueError, RuntimeError) as e:
        raise ScenarioError("run.backend", str(e).removeprefix("backend: ")) from None


def _chunking(integ, state: xr.Dataset) -> dict | None:
    """Chunking of a dask run (store attr ``chunking``): agent chunk sizes, the Zarr agent chunk (the
    largest size dividing every chunk boundary: each worker writes whole Zarr chunks), inner kernels
    and the scheduler. None for other backends."""
    layout = getattr(integ, "layout", None)
    if layout is None:
        return None
    from .backends.dask_backend import describe_scheduler, store_chunk

    if layout.bounds is None:
        layout.fix(state)
    return {
        "chunks": list(layout.sizes),
        "agent_chunk": store_chunk(layout.bounds),
        "inner": layout.inner,
        "scheduler": describe_scheduler(),
    }


def carry_name(integ) -> str:
    return getattr(integ, "name", type(integ).__name__)


def _checkpoint(store: RunStore, scn: Scenario, carry, buf, buf_start, backend: str) -> None:
    store.write_frames(buf_start, buf)
    store.write_checkpoint(
        carry.state,
        carry.step,
        {k: (v if _is_dask(v) else host_array(v)) for k, v in carry.aux.items()},
        carry.rng_state,
        carry.terms,
        {
            "scenario": scn.to_json(),
            "backend": backend,
            "frames_saved": buf_start + len(buf),
        },
        keep=scn.output["keep_checkpoints"],
        agent_chunk=store.agent_chunk()
        if _is_dask(carry.state[next(iter(carry.state.data_vars))].data)
        else None,
    )


def _reload(store: RunStore, integ, carry, buf: list, buf_start: int):
    """A chunked run after a checkpoint: the carry restored from the checkpoint just written, and the
    buffered frames read back from the trajectory, all as Dask arrays read by the workers. This cuts the
    task lineage there (the scheduler forgets the steps before; a lost worker's chunks are recomputed
    from the checkpoint), and a resumed run restores from the same checkpoint the same way: bitwise.
    The state is not validated again: it is the one the run's guard just passed (finite values; on the
    host path also SPD and the conditioning estimate), read back through the store's checksums. A resume
    validates it in full, and refuses a state beyond the dtype's conditioning limit that a run on GPU
    workers, whose guard checks finiteness, carried on with."""
    sizes = integ.layout.sizes
    ckpt = store.load_checkpoint(carry.step, sizes)
    carry = integ.restore(ckpt.state, ckpt.step, ckpt.aux, ckpt.rng_state, validate=False)
    return carry, store.read_frames(buf_start, buf_start + len(buf), sizes)


def _advance(store, scn, integ, carry, buf, buf_start, backend, progress, sig: _Signals, obs) -> Run:
    from .integrators.base import DynamicsError

    run = scn.run
    n_steps, every, ck = run["n_steps"], run["save_every"], run["checkpoint_every"]
    chunk = store.time_chunk()
    names = tuple(store.trajectory())
    if len(buf) == chunk:  # a full chunk already written by the caller's checkpoint
        buf_start, buf = buf_start + chunk, []
    bar = Progress(n_steps, carry.step, enabled=progress)
    chunked = getattr(integ, "layout", None) is not None
    store.set_attrs(status="running")
    try:
        sig.deferring = True  # a signal from here on stops the run at the end of a step, checkpointed
        while carry.step < n_steps:
            carry = integ.step(carry)
            checkpointed = carry.step % ck == 0 or carry.step == n_steps
            if carry.step % every == 0 or carry.step == n_steps:  # the last step is always saved
                buf.append(_frame(carry, names, obs))
                if len(buf) == chunk:
                    store.write_frames(buf_start, buf)
                    buf_start, buf = buf_start + chunk, []
            if checkpointed:
                _checkpoint(store, scn, carry, buf, buf_start, backend)
                if chunked and carry.step < n_steps:
                    carry, buf = _reload(store, integ, carry, buf, buf_start)
            bar.update(carry.step, carry.terms.get("total"))
            if sig.pending is not None and carry.step < n_steps:
                sig.deferring = False  # a second signal interrupts this checkpoint write at once
                if not checkpointed:
                    _checkpoint(store, scn, carry, buf, buf_start, backend)
                raise sig.pending
        sig.deferring = False
    except DynamicsError as e:
        sig.deferring = False
        bar.close()
        last = store.checkpoint_steps()
        msg = f"stopped: {e} (last good checkpoint: step {last[-1] if last else 'none'})"
        log.error(msg)
        _mark(store, f"failed: {e}")
        raise
    except KeyboardInterrupt as e:
        sig.deferring = False
        bar.close()
        _mark(store, "interrupted")
        last = store.checkpoint_steps()
        log.error(
            "%s at step %d; the last checkpoint is at step %s: "
            "`vfesim resume %s --steps %d` continues the run",
            "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted",
            carry.step,
            last[-1] if last else "none",
            store.path,
            n_steps,
        )
        _reported(e)
        raise
    except Exception as e:
        sig.deferring = False
        bar.close()
        _mark(store, f"failed: {type(e).__name__}: {e}")
        if _worker_lost(e):
            last = store.checkpoint_steps()
            log.error(
                "stopped at step %d: a Dask worker died and the scheduler gave up on its task (%s); the "
                "last checkpoint is at step %s: `vfesim resume %s --steps %d` continues the run",
                carry.step + 1,
                e,
                last[-1] if last else "none",
                store.path,
                n_steps,
            )
            raise RunError(
                f"step {carry.step + 1}: a Dask worker died ({type(e).__name__}: {e}); the last checkpoint "
                f"is at step {last[-1] if last else 'none'}: `vfesim resume {store.path}` continues the run"
            ) from e
        raise
    bar.close()
    store.set_attrs(status="complete")
    log.info("done: step %d, F = %.10g", carry.step, carry.terms.get("total", float("nan")))
    return Run(store.path, scn, carry.step, _host_state(carry.state), dict(carry.terms))


def _worker_lost(e: BaseException) -> bool:
    """Whether ``e`` says the scheduler lost a worker with a task it will not retry (KilledWorker)."""
    try:
        from distributed import KilledWorker
    except ImportError:
        return False
    return isinstance(e, KilledWorker)


def _mark(store: RunStore, status: str) -> None:
    """Record the run status; a store that cannot take it (disk full) must not hide the cause."""
    try:
        store.set_attrs(status=status)
    except OSError as e:
        log.warning("could not record status %r in %s (%s)", status, store.path, e)


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


IGNORED_ON_RESUME = {"run.n_steps", "run.backend", "output.path"}


def resume(
    path: str | Path,
    *,
    steps: int | None = None,
    backend: str | None = None,
    scenario: Scenario | str | Path | dict | None = None,
    progress: bool | None = None,
    allow_version_change: bool = False,
    observables: dict | None = None,
) -> Run:
    """Continue a run from its newest complete checkpoint to ``steps`` total steps (default: the
    run's ``n_steps``). Bitwise identical to an uninterrupted run on the same backend and device.

    scenario: if given, it must equal the stored one (except run.n_steps, run.backend, output.path).
    A store written by another vfesim version is refused unless ``allow_version_change``; one of another
    store format (``vfesim-run/1``) is refused. ``observables``: the Python observables the run was
    started with (a run records the same observables to its end).

    Before anything in the store changes, every chunk of every checkpoint and of the trajectory is
    verified. A damaged checkpoint is named (array and chunk), kept as ``damaged-step-…`` and the
    previous intact one is used; no intact checkpoint, or a damaged trajectory, is a RunError.
    The store is locked against other vfesim processes for the whole call.
    """
    path = Path(path)
    leftovers = list(path.absolute().parent.glob(f".{path.name}.creating-*"))
    if not path.exists() and not path.is_symlink() and not leftovers:
        raise StoreError(f"{path}: not a vfesim run store (it does not exist)")
    with store_lock(path), _run_signals() as sig:
        if RunStore.remove_stale_creating(path) and not path.exists():
            raise StoreError(
                f"{path}: no run store here: the run on this path was killed before its first "
                "checkpoint (its unfinished store was removed); start it again with `vfesim run`"
            )
        return _resume(
            RunStore(path), steps, backend, scenario, progress, allow_version_change, sig, observables
        )


def _resume(
    store: RunStore, steps, backend, scenario, progress, allow_version_change, sig: _Signals, python_obs
) -> Run:
    path = store.path
    version = store.attr("vfesim_version")  # a missing or damaged zarr.json is named here
    if store.attr("format") != FORMAT:
        raise RunError(
            f"{path}: store format {store.attr('format')} (written by vfesim {version}); this vfesim "
            f"resumes {FORMAT} stores only. Resume it with the vfesim that wrote it, or run the scenario "
            "again (`vfesim inspect`, `vfesim plot` and open_run still read it)"
        )
    store.check_entries()
    if version != __version__:
        msg = (
            f"{path} was written by vfesim {version}, this is {__version__}; "
            "a resumed run may differ from an uninterrupted one"
        )
        if not allow_version_change:
            raise RunError(msg + " (pass allow_version_change=True / --allow-version-change)")
        log.warning(msg)
    # Verify and load everything before changing anything in the store.
    ckpt, damaged = store.intact_checkpoint()
    if ckpt is None:
        where = "; ".join(f"step {s}: {r.summary(1)}" for s, r in sorted(damaged.items()))
        raise RunError(
            f"{path}: no intact checkpoint to resume from ({where or 'there are none'}); "
            f"the store is left as it is (`vfesim verify {path}` lists the damage)"
        )
    traj = store.verify_trajectory(int(ckpt.attrs.get("frames_saved", 0)))
    if not traj.intact:
        raise RunError(
            f"{path}: the trajectory is damaged: {traj.summary()}; refusing to resume, the frames "
            f"cannot be recomputed from the kept checkpoints. The store is left as it is "
            f"(`vfesim verify {path}` lists the damage)"
        )
    unchecked = traj.unchecksummed  # checkpoints were written by the same vfesim as the trajectory
    if unchecked:
        log.warning(
            "%s was written without chunk checksums (an older vfesim): its chunks decode, but a "
            "flipped bit cannot be detected (%d arrays, e.g. %s)",
            path,
            len(unchecked),
            unchecked[0],
        )
    scn = Scenario.from_json(ckpt.attrs["scenario"])
    if scenario is not None:
        other = load_scenario(scenario)
        diff = [k for k in _diff(scn.to_dict(), other.to_dict()) if k not in IGNORED_ON_RESUME]
        if diff:
            raise RunError(f"{path}: the scenario differs from the stored one in {diff}; refusing")
        scn = _with_overrides(scn, other.run["n_steps"], None, None)
    scn = _with_overrides(scn, steps, backend, str(path))
    backend_name = _resolve_backend(scn.run["backend"])
    if backend_name != ckpt.attrs["backend"]:
        log.warning(
            "resuming with backend %r, the run used %r: the result will not be bitwise identical",
            backend_name,
            ckpt.attrs["backend"],
        )
    run = scn.run
    if run["n_steps"] < ckpt.step:
        raise ScenarioError("run.n_steps", f"must be >= the checkpoint step {ckpt.step}")
    integ = _make_integrator(scn, backend_name, ckpt.state)
    layout = getattr(integ, "layout", None)
    if layout is not None:  # a chunked run: the workers read the checkpoint
        layout.fix(ckpt.state)
        ckpt = store.load_checkpoint(ckpt.step, layout.sizes)
    carry = integ.restore(ckpt.state, ckpt.step, ckpt.aux, ckpt.rng_state)
    obs = _resumed_observables(store, scn, ckpt.state, python_obs)
    # From here on the store changes.
    for step in sorted(damaged):
        aside = store.set_aside(step)
        log.warning("kept the damaged checkpoint of step %d as %s (not used, not pruned)", step, aside.name)
    if damaged:
        log.warning("resuming from the checkpoint at step %d, the newest intact one", ckpt.step)
    store.clean()
    store.extend(run["n_steps"], run["save_every"], scn.integrator["dt"])
    store.set_attrs(scenario=scn.to_json())
    chunking = _chunking(integ, ckpt.state)
    if chunking:
        store.set_attrs(chunking=json.dumps(chunking))
    # The first frame after the checkpoint's step. An old last step off the save grid had a frame of
    # its own at this index; the new run's frame replaces it (extend marked it unsaved).
    next_frame = ckpt.step // run["save_every"] + 1
    chunk = store.time_chunk()
    buf_start = next_frame // chunk * chunk
    buf = store.read_frames(buf_start, next_frame, None if layout is None else layout.sizes)
    if ckpt.step == run["n_steps"]:
        log.info("%s is complete at step %d (give --steps / steps= to extend it)", path, ckpt.step)
    else:
        log.info("resuming %s at step %d of %d", path, ckpt.step, run["n_steps"])
    return _advance(store, scn, integ, carry, buf, buf_start, backend_name, progress, sig, obs)


def _resumed_observables(store: RunStore, scn: Scenario, state: xr.Dataset, python) -> Observables:
    """The observables of a resumed run: the stored scenario's built-ins and ``python`` (the functions
    the run was started with); they must name what the store records."""
    recorded = json.loads(store.attr("observables"))
    missing = [k for k in recorded["python"] if k not in (python or {})]
    if missing:
        raise RunError(
            f"{store.path}: the run records Python observables {missing}: resume it from Python with "
            "`from vfesim.simulate import resume; resume(path, observables={...})`, giving the same functions"
        )
    obs, _ = _observables(scn, state, python)
    if obs.names != recorded["names"]:
        raise RunError(f"{store.path}: the run records observables {recorded['names']}, not {obs.names}")
    return obs


def run_info(path: str | Path) -> dict:
    """What ``vfesim inspect`` shows: config, status, steps done, energies, checkpoints."""
    store = RunStore(path)
    attrs = store.attrs
    scn = json.loads(store.attr("scenario"))
    steps = store.checkpoint_steps()
    ds = open_run(path)
    last = (
        {
            k: float(ds[k].values[-1])
            for k in sorted(ds.data_vars, key=lambda k: (k != term_var("total"), k))
            if k.startswith(ENERGY_PREFIX)
        }
        if (ds.sizes["time"])
        else {}
    )
    return {
        "path": str(path),
        "name": scn["name"],
        "family": attrs.get("agent_family"),
        "scenario": scn["scenario"],
        "status": attrs.get("status"),
        "vfesim_version": store.attr("vfesim_version"),
        "backend": attrs.get("backend"),
        "chunking": json.loads(attrs["chunking"]) if attrs.get("chunking") else None,
        "dtype": attrs.get("dtype"),
        "n_agents": ds.sizes["agent"],
        "n_steps": scn["scenario"]["run"]["n_steps"],
        "frames_saved": int(ds.sizes["time"]),
        "last_saved_step": int(ds["step"].values[-1]) if ds.sizes["time"] else None,
        "checkpoints": steps,
        "last_energies": last,
        "observables": json.loads(attrs["observables"])["names"] if attrs.get("observables") else [],
        "format": attrs.get("format"),
    }
