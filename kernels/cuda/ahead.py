"""Compile kernels ahead of their first launch, several at once, in fresh interpreter processes.

numba compiles a kernel at its first launch, in the launching process and under a process-wide lock, so
a process that finds the disk cache empty compiles its kernels one after the other: 12 s for the
Gaussian K = 3 energy and integrator kernels on an H100 host (benchmarks/results/
gpu_cold_h100_stop27.txt). :func:`compile_ahead` takes the kernels a computation is about to launch
(:class:`Job`: factory, arguments, kernel name, signature), loads what the disk cache already holds, and
compiles the rest in up to ``workers`` processes at once: a worker (a fresh ``python`` running
:func:`_main`) compiles its share and writes it to the disk cache, this process compiles one share
itself, then loads the others. The specialisations of one kernel function stay in one share: they share
an index file in numba's cache. A share that fails is only logged: its kernels compile at their first
launch as before.

A marker file in the kernel cache (``ahead-<hash>``: the jobs, the device's compute capability, the
numba-cuda and Python versions) records a completed set, so a later process skips even the loading pass
(its launches load what they use). Workers: ``VFESIM_COMPILE_WORKERS`` as given (0 or 1: compile at
first launch, in this process), else one per available core (the CPU affinity and a container's cgroup
CPU quota), at most :data:`MAX_WORKERS`. Each worker opens its own CUDA context (a few hundred MB of
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
import tempfile
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


# cgroup v2's CPU quota of this process's container ("max 100000" or "<quota> <period>")
CPU_MAX = "/sys/fs/cgroup/cpu.max"


def workers() -> int:
    """Processes :func:`compile_ahead` may use (this one included): ``VFESIM_COMPILE_WORKERS`` or the
    available cores (the CPU affinity, and a container's CPU quota where cgroup v2 sets one), at most
    MAX_WORKERS."""
    env = os.environ.get("VFESIM_COMPILE_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"VFESIM_COMPILE_WORKERS: must be an integer, got {env!r}") from None
        return max(1, n)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return max(1, min(cores, MAX_WORKERS))


def shares(jobs: list, n: int) -> list[list]:
    """``jobs`` in at most n non-empty shares: the jobs of one kernel function together (its
    specialisations share one index file in numba's cache, which two processes writing at once could
    corrupt), the groups dealt round-robin in the order given (callers list the costliest first)."""
    groups: dict = {}
    for job in jobs:
        groups.setdefault((job.module, job.factory, job.kernel), []).append(job)
    groups_list = list(groups.values())
    n = max(1, min(n, len(groups_list)))
    return [[job for g in groups_list[i::n] for job in g] for i in range(n)]


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


def _cache_folder() -> str | None:
    """Where numba writes compiled kernels (vfesim_kernels points it at its source-keyed folder)."""
    from numba.core import config

    return getattr(config, "CACHE_DIR", None) or os.environ.get("NUMBA_CACHE_DIR") or None


def _marker(jobs: list[Job]) -> str | None:
    """A file in the kernel cache whose existence says these jobs were compiled into it, for this
    device's compute capability, this numba-cuda and this Python (None: no cache folder, or no device)."""
    folder = _cache_folder()
    if not folder:
        return None
    try:
        cc = _compute_capability()
    except Exception:  # noqa: BLE001 - no device: nothing to mark
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        numba_cuda = version("numba-cuda")
    except PackageNotFoundError:
        numba_cuda = "bundled"
    key = [list(cc), numba_cuda, list(sys.version_info[:2]), sorted(json.dumps(list(job)) for job in jobs)]
    return os.path.join(folder, f"ahead-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:20]}")


def _mark(marker: str | None, jobs: list[Job]) -> None:
    if marker is None:
        return
    with contextlib.suppress(OSError):  # a read-only cache: the next process checks again
        lines = (f"{job.module}.{job.factory}{job.args}[{job.kernel}] {job.signature}\n" for job in jobs)
        with open(marker, "w") as f:
            f.write("".join(lines))


# The worker's command: a fresh interpreter running _main (``python -c``, not ``-m``: runpy warns about a
# module its package already imported, an error under PYTHONWARNINGS=error).
_WORKER = "import sys; from vfesim_kernels.cuda.ahead import _main; sys.exit(_main(sys.argv[1:]))"


def compile_ahead(jobs: list[Job], n_workers: int | None = None) -> dict:
    """Bind every job's kernel (see the module docstring); returns ``{"loaded", "compiled", "workers",
    "seconds", "failed"}`` (loaded: found in the disk cache; compiled: compiled ahead and bound; failed:
    the kernel names of shares that failed, left to their launches). A no-op under the simulator, and
    where an earlier process compiled the same jobs into this kernel cache (a marker file there says so:
    the launches then load them, only the ones they use)."""
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
        return report
    n = workers() if n_workers is None else max(1, n_workers)
    parts = shares(todo, n)
    if len(parts) < 2:  # nothing to share: the launches compile what is missing
        return report
    log.info(
        "compiling %d CUDA kernels in %d processes (first use; later runs load them from the disk cache)",
        len(todo), len(parts),
    )  # fmt: skip
    failed = _run_shares(parts)
    bound = [job for job in todo if job not in failed and _load(job)]
    report.update(
        compiled=len(bound), workers=len(parts), seconds=time.perf_counter() - t0,
        failed=[job.kernel for job in failed],
    )  # fmt: skip
    if len(bound) == len(todo):
        _mark(marker, jobs)
    else:
        missing = [job.kernel for job in todo if job not in bound and job not in failed]
        if missing:
            log.warning("CUDA kernels %s compiled ahead are not in the cache: compiled at launch", missing)
    return report


def _run_shares(parts: list[list[Job]]) -> list[Job]:
    """Compile ``parts[0]`` here and the others in worker processes at once; the jobs of failed shares
    (each failure logged). Workers still running when this process is interrupted are stopped."""
    failed: list[Job] = []
    procs = []
    try:
        for part in parts[1:]:
            err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty worker never blocks
            cmd = [sys.executable, "-c", _WORKER, json.dumps([list(job) for job in part])]
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            except OSError as e:  # no interpreter to start (an embedded Python): left to the launches
                err.close()
                failed += part
                _failed(part, f"no worker process: {e}")
                continue
            procs.append((part, proc, err))
        try:
            _compile(parts[0])
        except Exception as e:  # noqa: BLE001 - like a worker's failure: left to the launches
            failed += parts[0]
            _failed(parts[0], f"{type(e).__name__}: {e}")
        for part, proc, err in procs:
            if proc.wait() != 0:
                failed += part
                err.seek(0)
                _failed(part, f"exit {proc.returncode}: {err.read().strip()[-2000:]}")
    finally:
        for _, proc, err in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
    return failed


def _failed(part: list[Job], why: str) -> None:
    names = [job.kernel for job in part]
    log.warning("compiling CUDA kernels %s ahead failed; they compile at first launch (%s)", names, why)


def _main(argv: list[str]) -> int:
    """Worker: compile the jobs given as JSON (a list of Job fields) into the disk cache."""
    _compile([Job(m, f, tuple(a), k, s) for m, f, a, k, s in json.loads(argv[0])])
    return 0
