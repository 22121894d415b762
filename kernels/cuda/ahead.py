"""Compile kernels ahead of their first launch, several at once, in fresh interpreter processes.

numba compiles a kernel at its first launch, in the launching process and under a process-wide lock, so
a process that finds the disk cache empty compiles its kernels one after the other: 12 s for the
Gaussian K = 3 energy and integrator kernels on an H100 host (stop 27). :func:`compile_ahead` takes the
kernels a computation is about to launch (:class:`Job`: factory, arguments, kernel name, signature),
loads what the disk cache already holds, and compiles the rest in up to ``workers`` processes at once:
``python -m vfesim_kernels.cuda.ahead JOBS`` compiles its share and writes it to the disk cache, this
process compiles one share itself, then loads the others. A share that fails is only logged: its
kernels compile at their first launch as before.

A marker file in the kernel cache (``ahead-<hash>``: the jobs and the device's compute capability)
records a completed set, so a later process skips even the loading pass (its launches load what they
use). Workers: ``VFESIM_COMPILE_WORKERS`` (0 or 1: compile at first launch, in this process), else one per
available core, at most :data:`MAX_WORKERS`. Each worker opens its own CUDA context (a few hundred MB of
device memory, released when it exits). Fresh interpreters, not ``multiprocessing``: they do not import
the caller's ``__main__``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from importlib import import_module
from typing import NamedTuple

from .core import SIMULATOR

__all__ = ["Job", "MAX_WORKERS", "compile_ahead", "workers", "shares"]

log = logging.getLogger("vfesim")

MAX_WORKERS = 8


class Job(NamedTuple):
    """One kernel specialisation: ``getattr(import_module(module), factory)(*args)[kernel]`` compiled for
    the numba signature string ``signature`` (the argument types its launches pass)."""

    module: str
    factory: str
    args: tuple
    kernel: str
    signature: str

    def dispatcher(self):
        return getattr(import_module(self.module), self.factory)(*self.args)[self.kernel]

    def argtypes(self) -> tuple:
        from numba.core import sigutils

        return tuple(sigutils.normalize_signature(self.signature)[0])


def workers() -> int:
    """Processes :func:`compile_ahead` may use (this one included): ``VFESIM_COMPILE_WORKERS`` or the
    available cores, at most MAX_WORKERS."""
    env = os.environ.get("VFESIM_COMPILE_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"VFESIM_COMPILE_WORKERS: must be an integer, got {env!r}") from None
        return max(1, n)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_WORKERS))


def shares(jobs: list, n: int) -> list[list]:
    """``jobs`` dealt round-robin into at most n non-empty shares (callers list the costliest first)."""
    n = max(1, min(n, len(jobs)))
    return [jobs[i::n] for i in range(n)]


def _load(job: Job) -> bool:
    """Bind ``job``'s kernel from memory or the disk cache without compiling; False when neither has it
    (or numba's cache interface is not the one this was written against: then compile as usual)."""
    disp, argtypes = job.dispatcher(), job.argtypes()
    if argtypes in disp.overloads:
        return True
    try:
        kernel = disp._cache.load_overload(argtypes, disp.targetctx)
    except Exception:  # noqa: BLE001 - an unreadable entry: numba recompiles it at launch
        return False
    if kernel is None:
        return False
    disp.add_overload(kernel, argtypes)
    if hasattr(disp, "_cache_hits"):  # counted like a launch's load (compile_report)
        disp._cache_hits[argtypes] += 1
    return True


def _compile(jobs) -> None:
    for job in jobs:
        job.dispatcher().compile(job.argtypes())


def _compute_capability() -> tuple:
    from .core import cuda

    return tuple(cuda.get_current_device().compute_capability)


def _marker(jobs: list[Job]) -> str | None:
    """A file in the kernel cache whose existence says these jobs were compiled into it for this
    device's compute capability (None: no cache folder, or no device to ask)."""
    folder = os.environ.get("NUMBA_CACHE_DIR")
    if not folder:
        return None
    try:
        cc = _compute_capability()
    except Exception:  # noqa: BLE001 - no device: nothing to mark
        return None
    key = json.dumps([list(cc), sorted(json.dumps(list(job)) for job in jobs)]).encode()
    return os.path.join(folder, f"ahead-{hashlib.sha256(key).hexdigest()[:20]}")


def _mark(marker: str | None, jobs: list[Job]) -> None:
    if marker is None:
        return
    with contextlib.suppress(OSError):  # a read-only cache: the next process checks again
        lines = (f"{job.module}.{job.factory}{job.args}[{job.kernel}] {job.signature}\n" for job in jobs)
        with open(marker, "w") as f:
            f.write("".join(lines))


def compile_ahead(jobs: list[Job], n_workers: int | None = None) -> dict:
    """Bind every job's kernel (see the module docstring); returns ``{"loaded", "compiled", "workers",
    "seconds", "failed"}`` (compiled: jobs the disk cache lacked). A no-op under the simulator, and where
    an earlier process compiled the same jobs into this kernel cache (a marker file there says so: the
    launches then load them, only the ones they use)."""
    report = {"loaded": 0, "compiled": 0, "workers": 0, "seconds": 0.0, "failed": []}
    if SIMULATOR or not jobs:
        return report
    t0 = time.perf_counter()
    marker = _marker(jobs)
    if marker is not None and os.path.exists(marker):
        return report
    todo = [job for job in jobs if not _load(job)]
    report["loaded"] = len(jobs) - len(todo)
    if not todo:
        _mark(marker, jobs)
    n = workers() if n_workers is None else max(1, n_workers)
    if len(todo) < 2 or n < 2:  # nothing to share: the launches compile what is missing
        return report
    parts = shares(todo, n)
    log.info(
        "compiling %d CUDA kernels in %d processes (first use; later runs load them from the disk cache)",
        len(todo), len(parts),
    )  # fmt: skip
    procs = []
    for part in parts[1:]:
        cmd = [sys.executable, "-m", __name__, json.dumps([list(job) for job in part])]
        procs.append((part, subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True)))  # fmt: skip
    _compile(parts[0])
    failed: list[Job] = []
    for part, proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            failed += part
            names = [job.kernel for job in part]
            report["failed"] += names
            log.warning(
                "compiling CUDA kernels %s ahead failed (exit %d); they compile at first launch: %s",
                names, proc.returncode, (err or "").strip()[-2000:],
            )  # fmt: skip
    for job in todo:
        if job not in failed:
            _load(job)
    report.update(compiled=len(todo), workers=len(parts), seconds=time.perf_counter() - t0)
    if not failed:
        _mark(marker, jobs)
    return report


def _main(argv: list[str]) -> int:
    """Worker: compile the jobs given as JSON (a list of Job fields) into the disk cache."""
    _compile([Job(m, f, tuple(a), k, s) for m, f, a, k, s in json.loads(argv[0])])
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
