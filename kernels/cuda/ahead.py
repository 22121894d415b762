"""Compile kernels ahead of their first launch, several at once, in fresh interpreter processes.

numba compiles a kernel at its first launch, in the launching process and under a process-wide lock, so
a process that finds the disk cache empty compiles its kernels one after the other: 12 s for the
Gaussian K = 3 energy and integrator kernels on an H100 host (benchmarks/results/
gpu_cold_h100_stop27.txt). :func:`compile_ahead` takes the kernels a computation is about to launch
(:class:`Job`: factory, arguments, kernel name, signature), loads what the disk cache already holds, and
compiles the rest in up to ``workers`` processes at once. The workers (fresh ``python`` processes
running :func:`_main`) start first, so their imports and CUDA contexts (1.1-1.8 s on the GPU hosts)
overlap the loading pass and this process's first compile. The jobs form groups, one per kernel function
(its specialisations share an index file in numba's cache, so one process writes them), taken one at a
time from a common queue in the caller's cost order: this process starts on the first group at once, a
worker takes the next group whenever it is ready, writing each to the disk cache; this process then
loads them. Jobs the caller needs only later (``later``: an integrator's updates after a first energy)
stay in the queue for the workers while the call returns; :func:`finish` waits for them. A group that
fails is only logged: its kernels compile at their first launch as before. So is one a worker is still
compiling after ``VFESIM_COMPILE_TIMEOUT`` seconds (:func:`group_limit`): that worker is stopped.

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
import threading
import time
from importlib import import_module
from typing import NamedTuple

from .core import SIMULATOR

__all__ = ["Job", "MAX_WORKERS", "compile_ahead", "finish", "workers", "groups"]

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


# Seconds a worker may spend on one group before it is stopped and the group left to its launches (the
# costliest groups take 2-8 s on the GPU hosts, under eight processes at once).
GROUP_LIMIT_S = 600.0


def group_limit() -> float:
    """Seconds a worker may spend on one group: ``VFESIM_COMPILE_TIMEOUT`` (positive), else
    :data:`GROUP_LIMIT_S`."""
    env = os.environ.get("VFESIM_COMPILE_TIMEOUT", "").strip()
    if not env:
        return GROUP_LIMIT_S
    try:
        limit = float(env)
    except ValueError:
        limit = float("nan")
    if not limit > 0:
        raise ValueError(f"VFESIM_COMPILE_TIMEOUT: must be a positive number of seconds, got {env!r}")
    return limit


def groups(jobs: list) -> list[list]:
    """``jobs`` grouped by kernel function, in the order given (callers list the costliest first): the
    specialisations of one function share an index file in numba's cache, which two processes writing at
    once could corrupt, so one process compiles a group."""
    by_function: dict = {}
    for job in jobs:
        by_function.setdefault((job.module, job.factory, job.kernel), []).append(job)
    return list(by_function.values())


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


def compile_ahead(jobs: list[Job], n_workers: int | None = None, *, later: list[Job] = ()) -> dict:
    """Bind every job's kernel (see the module docstring); returns ``{"loaded", "compiled", "workers",
    "seconds", "failed", "ready", "groups", "load_s", "later"}`` (loaded: found in the disk cache; compiled:
    compiled ahead and bound; workers: processes that compiled, this one included; failed: the kernel
    names of groups that failed, left to their launches; ready: seconds from the start until each worker
    took its first group; groups: (process, kernel, start, end) per group, in seconds from the start,
    process 0 this one; load_s: the final pass binding the compiled kernels here). A no-op under the
    simulator, and where an earlier process compiled the same jobs into this kernel cache (a marker file
    there says so: the launches then load them, only the ones they use).

    ``later``: those of ``jobs`` the caller launches only later (an integrator's updates after a first
    energy): this call returns once the others are bound, while the workers go on with these ("later":
    how many were left compiling; workers take groups in the order given, so a costly later kernel
    starts early); :func:`finish` (or the next call) waits for them, binds them and completes the report
    in place. A process that exits first leaves its workers to end their current
    kernel (it reaches the disk cache) and quit."""
    with _LOCK:  # one call (and one pool) at a time in a process
        finish()
        return _compile_ahead(jobs, n_workers, later)


def _compile_ahead(jobs: list[Job], n_workers: int | None, later) -> dict:
    report = {"loaded": 0, "compiled": 0, "workers": 0, "seconds": 0.0, "failed": [], "ready": []}
    report |= {"groups": [], "load_s": 0.0, "later": 0}
    everything = list(dict.fromkeys(jobs))
    if SIMULATOR or not everything:
        return report
    t0 = time.perf_counter()
    marker = _marker(everything)
    if marker is not None and os.path.exists(marker):
        return report
    n = workers() if n_workers is None else max(1, n_workers)
    n = min(n, len(groups(everything)))
    pool = None
    try:
        # the workers start before the loading pass: their imports and CUDA contexts overlap it
        pool = _Pool(n - 1, t0, group_limit()) if n > 1 else None
        todo = [job for job in everything if not _load(job)]
        report["loaded"] = len(everything) - len(todo)
        todo_groups = groups(todo)
        if pool is None or len(todo_groups) < 2:  # nothing to share: the launches compile what is missing
            if pool is not None:
                pool.stop()
            if not todo:
                _mark(marker, everything)
            return report
        log.info(
            "compiling %d CUDA kernels in up to %d processes (first use; later runs load them from disk)",
            len(todo), n,
        )  # fmt: skip
        now = set(everything) - set(later)
        pool.queue.put(todo_groups, [any(job in now for job in g) for g in todo_groups])
        pool.compile(now_only=True)
        pending = (pool, todo, everything, marker, report)
        _bind(pending, [job for job in todo if job in now])
        if pool.queue.idle():
            _finish(pending)
        else:
            _PENDING.append(pending)
            report["later"] = len(todo) - sum(job in now for job in todo)
    except BaseException:
        if pool is not None:
            pool.stop()
        raise
    return report


# A call's kernels still compiling in its workers (``later``), bound by finish(): at most one entry.
_PENDING: list = []
_LOCK = threading.RLock()


def finish() -> None:
    """Wait for the kernels an earlier :func:`compile_ahead` left compiling (its ``later`` jobs; this
    process compiles any group no worker took), bind them here and complete that call's report. A worker
    still on one group after :func:`group_limit` seconds is stopped and the group left to its launches;
    this process's own compiles have no limit (as a launch's own compile has none)."""
    with _LOCK:
        while _PENDING:
            _finish(_PENDING.pop())


def _finish(pending) -> None:
    pool, todo, everything, marker, report = pending
    try:
        pool.compile(now_only=False)
    finally:
        pool.stop()
    bound = _bind(pending, todo)
    if len(bound) == len(todo):
        _mark(marker, everything)
    else:
        missing = [job.kernel for job in todo if job not in bound and job not in pool.queue.failed]
        if missing:
            log.warning("CUDA kernels %s compiled ahead are not in the cache: compiled at launch", missing)


def _bind(pending, jobs: list[Job]) -> list[Job]:
    """Bind those of ``jobs`` whose groups are done (not failed) and fill the report with the queue's
    state so far; the bound jobs."""
    pool, _, _, _, report = pending
    queue = pool.queue
    t1 = time.perf_counter()
    bound = [job for job in jobs if job not in queue.failed and _load(job)]
    ends = [end for *_, end in queue.log]
    report.update(
        compiled=len(bound), workers=1 + len(queue.ready), failed=[job.kernel for job in queue.failed],
        ready=sorted(queue.ready.values()), groups=list(queue.log), load_s=time.perf_counter() - t1,
    )  # fmt: skip
    report["seconds"] = max(ends, default=0.0) + report["load_s"]
    return bound


class _Queue:
    """The groups to compile, costliest first, some of them "now" groups (those the caller waits for),
    taken one at a time by this process (only "now" groups while the caller waits) and the workers (one
    feeding thread per worker, in order: a costly later group starts early, so it ends early too); the
    groups in flight; the jobs of failed groups; when each worker took its first group (by process id);
    and (process, kernel, start, end) per group."""

    def __init__(self, t0: float):
        self._todo: list[tuple[list[Job], bool]] = []
        self._sealed, self._busy, self._now, self._t0 = False, 0, 0, t0
        self._cond = threading.Condition()
        self.failed: list[Job] = []
        self.ready: dict[int, float] = {}
        self.log: list[tuple] = []
        self.stopped = False

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def put(self, todo: list[list[Job]], now: list[bool]) -> None:
        """The groups and which are "now" groups; no more come after."""
        with self._cond:
            self._todo = list(zip(todo, now, strict=True))
            self._now, self._sealed = sum(now), True
            self._cond.notify_all()

    def take(self, now_only: bool = False) -> tuple[list[Job], bool] | None:
        """The next group (``now_only``: the next "now" group), in flight until :meth:`done`, once there
        are groups; None when none is left."""
        with self._cond:
            self._cond.wait_for(lambda: self._todo or self._sealed or self.stopped)
            i = next((i for i, (_, now) in enumerate(self._todo) if now or not now_only), None)
            if self.stopped or i is None:
                return None
            self._busy += 1
            return self._todo.pop(i)

    def done(
        self, item: tuple[list[Job], bool], start: float, who: int, failure: str | None = None, announce=True
    ) -> None:
        group, now = item
        with self._cond:
            self._busy -= 1
            self._now -= now
            self.log.append((who, group[0].kernel, round(start, 3), round(self.now(), 3)))
            if failure is not None:
                self.failed += group
            self._cond.notify_all()
        if failure is not None and announce:
            _failed(group, failure)

    def back(self, item: tuple[list[Job], bool]) -> None:
        """Return a group taken but never sent (its worker had died): the next taker gets it."""
        with self._cond:
            self._busy -= 1
            self._todo.insert(0, item)
            self._cond.notify_all()

    def started(self, pid: int) -> None:
        with self._cond:
            self.ready[pid] = self.now()

    def idle(self) -> bool:
        with self._cond:
            return not self._todo and self._busy == 0

    def wait(self, now_only: bool) -> bool:
        """Until the "now" groups (or all groups) are compiled or failed (True), or a group this process
        may take is back in the queue (False: its worker died before it was sent)."""

        def finished() -> bool:
            return self._now == 0 if now_only else not self._todo and self._busy == 0

        def takeable() -> bool:
            return any(now or not now_only for _, now in self._todo)

        with self._cond:
            self._cond.wait_for(lambda: finished() or takeable() or self.stopped)
            return finished() or self.stopped

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()


class _Pool:
    """``n`` worker processes fed from one :class:`_Queue` (each by its own thread), and this process's
    share: :meth:`compile` takes groups here until none (or no "now" group) is left, then waits for the
    workers' groups of that kind. A worker takes a group once it is ready to compile (imports done, CUDA
    context open), this process whenever it is free, so the costliest group starts here at once and the
    workers' start-up hides behind it. :meth:`stop` ends the workers (those not yet ready when the work is
    done, and all when this process is interrupted)."""

    def __init__(self, n: int, t0: float, limit: float = GROUP_LIMIT_S):
        self.queue, self.procs, self.feeders = _Queue(t0), [], []
        for _ in range(n):
            err = tempfile.TemporaryFile("w+b")  # a file, not a pipe: a chatty worker never blocks
            cmd = [sys.executable, "-c", _WORKER]
            pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1)
            try:
                proc = subprocess.Popen(cmd, **pipes)
            except OSError as e:  # no interpreter to start (an embedded Python): the others share its work
                err.close()
                log.warning("no worker process to compile CUDA kernels ahead (%s)", e)
                break
            self.procs.append((proc, err))
            feeder = threading.Thread(
                target=_feed, args=(self.queue, proc, err, len(self.procs), limit), daemon=True
            )
            feeder.start()
            self.feeders.append(feeder)

    def compile(self, now_only: bool) -> None:
        queue = self.queue
        while True:
            item = queue.take(now_only)
            if item is None:
                if queue.wait(now_only):
                    return
                continue
            start = queue.now()
            try:
                _compile(item[0])
            except Exception as e:  # noqa: BLE001 - like a worker's failure: left to the launches
                queue.done(item, start, 0, f"{type(e).__name__}: {e}")
            else:
                queue.done(item, start, 0)

    def stop(self) -> None:
        self.queue.stop()
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for feeder in self.feeders:  # each returns at its worker's end of file
            feeder.join()
        for proc, err in self.procs:
            for f in (proc.stdin, proc.stdout, err):
                with contextlib.suppress(OSError):
                    f.close()
        self.procs = []


def _feed(queue: _Queue, proc: subprocess.Popen, err, who: int, limit: float = GROUP_LIMIT_S) -> None:
    """One worker's thread: once the worker says it is ready, hand it groups one at a time until the
    queue is empty. A group it fails on, was compiling when it died, or is still compiling after
    ``limit`` seconds (then it is stopped) is reported (left to launches); one it could not even be sent
    goes back to the queue. Every group taken is given back to the queue
    exactly once (:meth:`_Queue.done` or :meth:`_Queue.back`), whatever happens here."""

    def why() -> str:
        if proc.poll() is None:  # alive but talking nonsense: stop it
            proc.kill()
        proc.wait()
        err.seek(0)
        text = err.read().decode(errors="replace").strip()[-2000:]
        return f"exit {proc.returncode}: {text}"

    try:
        if proc.stdout.readline().strip() != "ready":
            if not queue.stopped:  # it died starting: the others share its work
                _failed([], why())
            return
        while (item := queue.take()) is not None:
            if proc.pid not in queue.ready:
                queue.started(proc.pid)
            start = queue.now()
            try:
                proc.stdin.write(json.dumps([list(job) for job in item[0]]) + "\n")
                proc.stdin.flush()
            except (OSError, ValueError):  # it died before this group: another process takes it
                return queue.back(item)
            failure, announce, reply = "the feeding thread failed", True, ""
            expired = threading.Event()

            def expire(expired=expired):  # a group past its time: the worker is stopped
                expired.set()
                proc.kill()

            timer = threading.Timer(limit, expire)
            timer.daemon = True
            try:  # done() exactly once, whatever fails here (an unexpected failure: left to the launches)
                timer.start()
                with contextlib.suppress(OSError, ValueError):  # a closed pipe or bad bytes: it is gone
                    reply = proc.stdout.readline()
                timer.cancel()
                if reply:
                    failure = None if reply.strip() == "ok" else reply.strip()
                elif queue.stopped:  # this process stopped it: quietly
                    failure, announce = "stopped", False
                elif expired.is_set():
                    proc.wait()
                    failure = f"still compiling after {limit:g} s (VFESIM_COMPILE_TIMEOUT): stopped"
                else:  # it died in this group
                    failure = why()
            finally:
                timer.cancel()
                queue.done(item, start, who, failure, announce=announce)
            if not reply:
                return
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the worker exits
        proc.wait()
    except Exception as e:  # noqa: BLE001 - never lose the queue's accounting to a feeding thread
        log.warning("a thread feeding a compile-ahead worker failed (%s: %s)", type(e).__name__, e)


def _failed(part: list[Job], why: str) -> None:
    names = [job.kernel for job in part]
    if names:
        log.warning("compiling CUDA kernels %s ahead failed; they compile at first launch (%s)", names, why)
    else:
        log.warning("a worker process compiling CUDA kernels ahead stopped (%s)", why)


def _main(argv: list[str]) -> int:
    """Worker: open the CUDA context, say "ready", then compile each group of jobs read from stdin (one
    JSON list of Job fields per line) into the disk cache, answering "ok" or the error on one line. Only
    these answers reach stdout: anything else written there (by numba, the driver) goes to stderr."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    with contextlib.suppress(Exception):  # no device: the compiles fail and say why
        _compute_capability()
    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        try:
            _compile([Job(m, f, tuple(a), k, s) for m, f, a, k, s in json.loads(line)])
        except Exception as e:  # noqa: BLE001 - reported to the caller, which leaves it to the launches
            answer = " ".join(f"{type(e).__name__}: {e}".split())  # one line
        else:
            answer = "ok"
        print(answer, file=answers, flush=True)
    return 0
