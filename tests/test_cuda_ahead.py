"""Compiling kernels ahead in parallel processes (vfesim_kernels.cuda.ahead), on the CPU: the jobs go to
real worker processes whose dispatchers are stand-ins that record what they compile (a ``wait_<name>``
stand-in, the first group and so this process's, waits until some process has tried ``<name>``: a
worker took that group); and every job of the Gaussian plans names a kernel whose signature fits it.
On a GPU, tests/test_cuda_gpu.py checks that a first run then loads every kernel it launches."""

import inspect
import logging
import os
import sys
import time

import pytest

kc = pytest.importorskip("vfesim_kernels.cuda", reason="needs numba-cuda (the cudasim extra)")
from vfesim_kernels.cuda import ahead  # noqa: E402

STUB = """
import os
import time
from pathlib import Path

class Cache:
    def __init__(self, name):
        self.name = name
    def load_overload(self, argtypes, ctx):
        return "kernel" if (Path(os.environ["AHEAD_OUT"]) / self.name).exists() else None

class Stub:
    def __init__(self, name):
        self.name, self.overloads, self._cache, self.targetctx = name, {}, Cache(name), None
        self._cache_hits = __import__("collections").Counter()
    def add_overload(self, kernel, argtypes):
        self.overloads[argtypes] = kernel
    def compile(self, argtypes):
        out = Path(os.environ["AHEAD_OUT"])
        (out / f"tried_{self.name}").write_text(str(os.getpid()))
        if self.name.startswith("wait_"):
            deadline = time.monotonic() + 120
            while not (out / f"tried_{self.name[5:]}").exists():
                assert time.monotonic() < deadline, "no worker took a group"
                time.sleep(0.01)
        if self.name == "hold":
            while not (out / "go").exists():
                time.sleep(0.01)
        if self.name == "broken":
            raise RuntimeError("this kernel does not compile")
        if self.name == "crash":  # a native crash, with bytes on stderr that are not UTF-8
            os.write(2, b"fatal \\xff\\xfe native crash\\n")
            os._exit(3)
        print("chatter on stdout", flush=True)
        os.write(1, b"more chatter\\n")
        (Path(os.environ["AHEAD_OUT"]) / self.name).write_text(f"{os.getpid()} {argtypes}")
        self.overloads[argtypes] = "kernel"

_MADE = {}

def factory(*names):
    return {n: _MADE.setdefault(n, Stub(n)) for n in names}
"""


@pytest.fixture
def stub(tmp_path, monkeypatch):
    (tmp_path / "ahead_stub.py").write_text(STUB)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    path = [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))  # the workers import it too
    monkeypatch.setenv("AHEAD_OUT", str(out))
    monkeypatch.setattr(ahead, "SIMULATOR", False)
    monkeypatch.setattr(ahead, "_cache_folder", lambda: None)  # no marker in the real kernel cache
    yield out
    (out / "go").write_text("")
    ahead.finish()
    sys.modules.pop("ahead_stub", None)


KERNELS = ("a", "b", "c", "d", "broken", "crash", "hold", "wait_b", "wait_broken", "wait_crash", "wait_hold")


@pytest.fixture
def cache(stub, tmp_path, monkeypatch):
    """A kernel cache folder for markers, on a device of compute capability 9.0."""
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setattr(ahead, "_cache_folder", lambda: str(folder))
    monkeypatch.setattr(ahead, "_compute_capability", lambda: (9, 0))
    return folder


def _jobs(names, factory_args=KERNELS):
    return [ahead.Job("ahead_stub", "factory", factory_args, n, "void(float64[::1], int64)") for n in names]


def test_missing_kernels_compile_in_worker_processes_and_load_here(stub):
    jobs = _jobs(["wait_b", "b", "c", "d"])
    report = ahead.compile_ahead(jobs, n_workers=3)
    assert report["compiled"] == 4 and report["loaded"] == 0 and report["failed"] == []
    assert 2 <= report["workers"] <= 3 and len(report["ready"]) == report["workers"] - 1
    pids = {n: (stub / n).read_text().split()[0] for n in ["wait_b", "b", "c", "d"]}
    assert pids["wait_b"] == str(os.getpid()) != pids["b"]  # this process took the first group
    who = {kernel: process for process, kernel, start, end in report["groups"] if 0 <= start <= end}
    assert sorted(who) == ["b", "c", "d", "wait_b"] and who["wait_b"] == 0 and who["b"] > 0
    for job in jobs:  # every kernel bound in this process
        assert job.argtypes() in job.dispatcher().overloads
    again = ahead.compile_ahead(jobs, n_workers=3)
    assert again["compiled"] == 0 and again["loaded"] == 4  # nothing left to compile


def test_later_kernels_compile_in_the_workers_after_the_call_returns(stub, cache):
    jobs = _jobs(["hold", "wait_hold", "c"])
    later = [jobs[0], jobs[2]]
    # a worker takes "hold" (first in line, but later: not this process), which waits for "go"; this
    # process's kernel waits until a worker has started on "hold"
    report = ahead.compile_ahead(jobs, n_workers=3, later=later)
    assert report["later"] == 2 and report["compiled"] == 1 and report["seconds"] > 0  # the "now" kernel
    assert jobs[1].argtypes() in jobs[1].dispatcher().overloads
    hold = later[0]
    assert hold.argtypes() not in hold.dispatcher().overloads and not (stub / "hold").exists()
    assert not list(cache.glob("ahead-*"))  # not marked while kernels are missing
    (stub / "go").write_text("")
    ahead.finish()
    assert report["compiled"] == 3 and report["failed"] == [] and len(report["groups"]) == 3
    assert all(job.argtypes() in job.dispatcher().overloads for job in later)
    assert (stub / "hold").read_text().split()[0] != str(os.getpid())
    assert len(list(cache.glob("ahead-*"))) == 1
    assert ahead.compile_ahead(jobs, n_workers=3, later=later)["compiled"] == 0  # marked: nothing to do


def test_a_group_failing_in_a_worker_is_reported_and_left_to_its_launch(stub, caplog):
    jobs = _jobs(["wait_broken", "broken", "c"])
    with caplog.at_level(logging.WARNING, logger="vfesim"):
        report = ahead.compile_ahead(jobs, n_workers=3)
    assert report["failed"] == ["broken"] and report["compiled"] == 2
    assert (stub / "tried_broken").read_text() != str(os.getpid())
    assert "this kernel does not compile" in caplog.text and "'broken'" in caplog.text
    assert (stub / "c").exists()
    broken = jobs[1]
    assert broken.argtypes() not in broken.dispatcher().overloads


def test_a_worker_dying_mid_group_is_reported_and_the_others_go_on(stub, caplog):
    jobs = _jobs(["wait_crash", "crash", "b", "c", "d"])
    with caplog.at_level(logging.WARNING, logger="vfesim"):
        report = ahead.compile_ahead(jobs, n_workers=3)
    assert report["failed"] == ["crash"] and report["compiled"] == 4
    assert "exit 3: fatal" in caplog.text and "native crash" in caplog.text and "'crash'" in caplog.text
    assert all((stub / n).exists() for n in "bcd")


def test_workers_not_ready_when_the_work_is_done_are_stopped(stub, tmp_path, monkeypatch):
    # the workers' interpreters start slowly (a sitecustomize on their PYTHONPATH); this process's compiles
    # are instant: it does everything and returns without waiting for them
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(60)\n")
    t0 = time.monotonic()
    report = ahead.compile_ahead(_jobs(["a", "b", "c"]), n_workers=3)
    assert time.monotonic() - t0 < 30
    assert report["compiled"] == 3 and report["workers"] == 1 and report["ready"] == []
    assert {(stub / n).read_text().split()[0] for n in "abc"} == {str(os.getpid())}


def test_cached_kernels_are_loaded_not_compiled(stub):
    (stub / "a").write_text("cached")
    report = ahead.compile_ahead(_jobs(["a", "b"]), n_workers=4)
    assert report["loaded"] == 1 and report["compiled"] == 0  # one left: its launch compiles it
    assert not (stub / "b").exists()


def test_one_worker_compiles_nothing_ahead(stub, monkeypatch):
    monkeypatch.setenv("VFESIM_COMPILE_WORKERS", "1")
    report = ahead.compile_ahead(_jobs(["a", "b", "c"]))
    assert report["compiled"] == 0 and not any(stub.iterdir())


def test_workers_setting(monkeypatch):
    monkeypatch.setenv("VFESIM_COMPILE_WORKERS", "3")
    assert ahead.workers() == 3
    monkeypatch.setenv("VFESIM_COMPILE_WORKERS", "0")
    assert ahead.workers() == 1
    monkeypatch.setenv("VFESIM_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="VFESIM_COMPILE_WORKERS"):
        ahead.workers()
    monkeypatch.delenv("VFESIM_COMPILE_WORKERS")
    assert 1 <= ahead.workers() <= ahead.MAX_WORKERS


def test_workers_follow_a_container_cpu_quota(tmp_path, monkeypatch):
    monkeypatch.delenv("VFESIM_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr(ahead.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(ahead, "CPU_MAX", str(cpu_max))
    for text, expected in [("250000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", 8), ("junk", 8)]:
        cpu_max.write_text(text)
        assert ahead.workers() == expected, text
    cpu_max.unlink()  # no cgroup v2 file: the affinity, capped
    assert ahead.workers() == ahead.MAX_WORKERS


def test_groups_keep_a_kernel_functions_specialisations_together_in_the_given_order():
    a32, b, c, a64, d = (
        ahead.Job("m", "f", (), k, f"void({t}[::1])")
        for k, t in [("a", "float32"), ("b", "float32"), ("c", "float32"), ("a", "float64"), ("d", "int64")]
    )
    # "a" in float32 and float64 share numba's index file: one process compiles both
    assert ahead.groups([a32, b, c, a64, d]) == [[a32, a64], [b], [c], [d]]
    assert ahead.groups([]) == []


def test_a_failing_group_of_this_process_is_logged_not_raised(stub, caplog):
    jobs = _jobs(["broken", "a", "c"])
    with caplog.at_level(logging.WARNING, logger="vfesim"):
        report = ahead.compile_ahead(jobs, n_workers=2)  # this process takes the first group
    assert report["failed"] == ["broken"] and report["compiled"] == 2
    assert "RuntimeError: this kernel does not compile" in caplog.text
    assert (stub / "tried_broken").read_text() == str(os.getpid())


def test_workers_run_with_warnings_as_errors(stub, monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    report = ahead.compile_ahead(_jobs(["wait_b", "b", "c"]), n_workers=3)
    assert report["failed"] == [] and report["compiled"] == 3 and report["workers"] >= 2


def test_no_op_under_the_simulator(monkeypatch):
    monkeypatch.setattr(ahead, "SIMULATOR", True)
    assert ahead.compile_ahead(_jobs(["a"]))["compiled"] == 0


@pytest.mark.parametrize("K", [3, 5, 9, 21])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("dense", [True, False])
def test_gaussian_plan_names_real_kernels_with_fitting_signatures(K, dtype, dense):
    from vfesim.backends import cuda_backend as cb

    jobs = cb.gaussian_jobs(K, dtype, "softmin", dense)
    assert len(set(jobs)) == len(jobs)
    names = {j.kernel for j in jobs}
    assert {"state", "kick_drift", "gradient_flow", "partial_sum", "partial_max_abs"} <= names
    assert ("stats" in names) == (dense and cb._mode(K, __import__("numpy").dtype(dtype)) == "kernels")
    assert ("rows" in names) == (not dense or K >= cb.LARGE_K)
    for job in jobs:
        disp = job.dispatcher()
        params = inspect.signature(disp.py_func).parameters
        assert len(job.argtypes()) == len(params), job


def test_a_completed_set_is_marked_and_skipped_by_the_next_process(stub, cache, monkeypatch):
    jobs = _jobs(["a", "b", "c"])
    assert ahead.compile_ahead(jobs, n_workers=2)["compiled"] == 3
    (marker,) = cache.glob("ahead-*")
    assert "ahead_stub.factory" in marker.read_text() and "[b]" in marker.read_text()
    for n in "abc":
        (stub / n).unlink()  # a marked set is not even loaded again
    assert ahead.compile_ahead(jobs, n_workers=2) == ahead.compile_ahead([], n_workers=2)
    monkeypatch.setattr(ahead, "_compute_capability", lambda: (8, 0))  # another GPU: its own set
    assert ahead.compile_ahead(jobs, n_workers=2)["loaded"] == 3  # (bound in this process already)
    assert len(list(cache.glob("ahead-*"))) == 2
    failing = _jobs(["d", "broken"])
    assert ahead.compile_ahead(failing, n_workers=2)["failed"] == ["broken"]
    assert len(list(cache.glob("ahead-*"))) == 2  # a set with a failure is not marked


def test_a_worker_that_cannot_start_is_logged_and_this_process_does_its_work(stub, monkeypatch, caplog):
    monkeypatch.setattr(ahead.sys, "executable", str(stub / "no-such-python"))
    with caplog.at_level(logging.WARNING, logger="vfesim"):
        report = ahead.compile_ahead(_jobs(["a", "b"]), n_workers=2)
    assert report["failed"] == [] and report["compiled"] == 2 and "no worker process" in caplog.text


@pytest.mark.parametrize("d", [2, 4, 5, 6])
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
@pytest.mark.parametrize("dense", [True, False])
def test_density_matrix_plan_names_real_kernels_with_fitting_signatures(d, dtype, dense):
    from vfesim_kernels.cuda.eigh import COOP_MIN_D

    from vfesim.backends import cuda_backend as cb

    jobs = cb.quantum_jobs(d, dtype, "expected", dense)
    names = {j.kernel for j in jobs}
    assert {"energy_features", "energy_backward", "partial_sum"} <= names
    # from COOP_MIN_D the forward's eigen-decompositions are one cooperative eigh launch
    split = {"energy_mats", "eigh", "energy_finish"}
    assert (split <= names, "energy_prep" in names) == ((True, False) if d >= COOP_MIN_D else (False, True))
    assert ("stats" in names) == (dense and d * d <= cb.STREAM_MAX_D)
    for job in jobs:
        params = inspect.signature(job.dispatcher().py_func).parameters
        assert len(job.argtypes()) == len(params), job


def test_an_energy_leaves_the_update_kernels_compiling_until_an_integrator_steps(monkeypatch):
    import numpy as np

    from vfesim import ModelConfig
    from vfesim.backends import cuda_backend as cb

    calls, finished = [], []

    def compile_ahead(jobs, later=()):
        assert set(later) <= set(jobs)
        calls.append(([j.kernel for j in jobs if j not in later], [j.kernel for j in later]))
        return {"compiled": 0, "later": len(later), "seconds": 1.0, "workers": 4, "loaded": 0}

    monkeypatch.setattr(cb, "SIMULATOR", False)
    monkeypatch.setattr(cb, "_PREPARED", set())
    monkeypatch.setattr(cb.kc.ahead, "compile_ahead", compile_ahead)
    monkeypatch.setattr(cb.kc.ahead, "finish", lambda: finished.append(True))
    updates = {"kick_drift", "gradient_flow", "adam", "theta_to_sigma"}
    arrays = {"mu_q": np.zeros((4, 3), np.float32)}
    cb.prepare(arrays, ModelConfig(K=3))  # a first energy: the update kernels later
    ((now, later),) = calls
    assert set(later) == updates and "adjoint" in now and not updates & set(now)
    cb.prepare(arrays, ModelConfig(K=3))  # another energy: nothing to wait for
    assert len(calls) == 1 and finished == []
    cb.prepare(arrays, ModelConfig(K=3), stepping=True)  # an integrator: waits for them
    assert len(calls) == 1 and finished == [True]
    cb.prepare({"mu_q": np.zeros((4, 5), np.float64)}, ModelConfig(K=5), stepping=True)
    now, later = calls[-1]  # an integrator first: everything at once
    assert later == [] and updates <= set(now)


def test_a_group_past_the_time_limit_stops_its_worker_and_is_left_to_its_launch(stub, caplog, monkeypatch):
    # a worker takes "hold", which never ends ("go" comes only at teardown); this process's kernel waits
    # until a worker has started on it
    import threading

    monkeypatch.setenv("VFESIM_COMPILE_TIMEOUT", "1.5")
    jobs = _jobs(["wait_hold", "hold", "c"])
    release = threading.Timer(40, (stub / "go").write_text, args=("",))  # without a limit: ends anyway
    release.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vfesim"):
        report = ahead.compile_ahead(jobs, n_workers=3)
    release.cancel()
    assert time.monotonic() - t0 < 30
    assert report["failed"] == ["hold"] and report["compiled"] == 2
    assert "still compiling after 1.5 s (VFESIM_COMPILE_TIMEOUT)" in caplog.text and "'hold'" in caplog.text
    hold = jobs[1]
    assert hold.argtypes() not in hold.dispatcher().overloads and not (stub / "hold").exists()


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan"])
def test_time_limit_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv("VFESIM_COMPILE_TIMEOUT", value)
    with pytest.raises(ValueError, match="VFESIM_COMPILE_TIMEOUT: must be a positive number"):
        ahead.group_limit()
    monkeypatch.setenv("VFESIM_COMPILE_TIMEOUT", "90")
    assert ahead.group_limit() == 90.0
    monkeypatch.delenv("VFESIM_COMPILE_TIMEOUT")
    assert ahead.group_limit() == ahead.GROUP_LIMIT_S
