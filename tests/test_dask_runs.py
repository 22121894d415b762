"""Runs on the dask backend (issue 11): state chunked on the workers between steps, frames and checkpoints
written by the workers in agent-aligned Zarr chunks, bitwise resume, agreement with the numba backend,
and a worker killed mid-run (Dask retries and the run is unchanged; or the run stops with its last
checkpoint intact and resumes)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import signal

import dask.array as da
import numpy as np
import pytest
import zarr

import vfesim
from vfesim.backends import get
from vfesim.cli import main
from vfesim.integrators.chunked import set_task_hook
from vfesim.io import open_run
from vfesim.io.store import RunStore
from vfesim.simulate import RunError, resume, run_info, simulate

distributed = pytest.importorskip("distributed")

N = 13
CHUNK = 5  # chunks of 5, 5, 3


def _scenario(method: str = "verlet", **options) -> dict:
    return {
        "model": {"K": 3, "kappa_beta": 2.0, "lambda_prior": 0.3},
        "population": {"n_agents": N, "seed": 3, "neighbours": "ring", "half_width": 2},
        "integrator": {
            "method": method,
            "dt": 0.05,
            "friction": 0.1 if method != "gradient_flow" else 0.0,
            "options": options,
        },  # fmt: skip
        "run": {"n_steps": 4, "save_every": 2, "checkpoint_every": 2, "backend": "dask", "chunks": CHUNK},
    }


def _same_runs(a, b) -> None:
    ra, rb = open_run(a).load(), open_run(b).load()
    assert ra["step"].values.tolist() == rb["step"].values.tolist() == [0, 2, 4]
    for k in ra.data_vars:
        np.testing.assert_array_equal(ra[k].values, rb[k].values, err_msg=k)


def _intact(path) -> None:
    reports = RunStore(path).verify()
    assert all(r.intact for r in reports), [r.summary() for r in reports if not r.intact]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted verlet run on the threaded scheduler."""
    path = tmp_path_factory.mktemp("ref") / "ref.zarr"
    simulate(_scenario(), out=path, progress=False)
    return path


def test_store_is_chunked_like_the_state_and_verifies(reference):
    for name in ("mu_q", "sigma_q", "phi"):
        assert zarr.open_array(reference / name, mode="r").chunks[1] == CHUNK, name
    ckpt = reference / "checkpoints" / "step-000000000004"
    for name in ("mu_q", "aux__theta_sigma_q", "aux__p_phi"):
        assert zarr.open_array(ckpt / name, mode="r").chunks[0] == CHUNK, name
    _intact(reference)
    assert main(["verify", str(reference), "-q"]) == 0
    info = run_info(reference)
    assert info["backend"] == "dask"
    assert info["chunking"]["chunks"] == [5, 5, 3] and info["chunking"]["agent_chunk"] == CHUNK
    assert info["chunking"]["scheduler"] == "threads" and info["chunking"]["inner"] == "numba"


def test_inspect_shows_backend_and_chunking(reference, capsys):
    assert main(["inspect", str(reference)]) == 0
    out = capsys.readouterr().out
    assert "backend      dask, float" in out
    assert "chunking     3 chunks of 5 agents, the last 3 (Zarr: 5 agents per chunk), inner numba" in out


def test_api_resume_is_bitwise(reference, tmp_path):
    simulate(_scenario(), out=tmp_path / "r.zarr", steps=1, progress=False)  # stops off the save grid
    resume(tmp_path / "r.zarr", steps=4, progress=False)
    _same_runs(reference, tmp_path / "r.zarr")
    _intact(tmp_path / "r.zarr")


def test_frames_between_checkpoints_fill_time_chunks_in_part(tmp_path):
    """Every step saved, two frames per checkpoint: the time chunk holds two frames, and the first
    checkpoint writes frame 0 alone, later ones frames (1, 2) across two time chunks; each Zarr chunk is
    still written by one task. The run equals the numba run frame by frame and verifies."""
    sc = _scenario("gradient_flow")
    sc["run"].update(n_steps=3, save_every=1, checkpoint_every=2)
    simulate(sc, out=tmp_path / "d.zarr", progress=False)
    sc["run"]["backend"] = "numba"
    del sc["run"]["chunks"]
    simulate(sc, out=tmp_path / "n.zarr", progress=False)
    d, n = open_run(tmp_path / "d.zarr").load(), open_run(tmp_path / "n.zarr").load()
    assert zarr.open_array(tmp_path / "d.zarr" / "mu_q", mode="r").chunks[0] == 2
    assert d["step"].values.tolist() == [0, 1, 2, 3] and d["saved"].values.all()
    for k in ("mu_q", "sigma_q", "phi", "energy_total"):
        np.testing.assert_allclose(d[k].values, n[k].values, rtol=1e-12, atol=1e-13, err_msg=k)
    _intact(tmp_path / "d.zarr")


@pytest.mark.parametrize(("method", "options"), [("pefrl", {}), ("gradient_flow", {"rule": "adam"})])
def test_run_dynamics_chunked_matches_numba(method, options):
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5, aggregator="softmin")
    state = vfesim.random_state(cfg, N, seed=4)
    fr = 0.2 if method != "gradient_flow" else 0.0
    kw = {"method": method, "dt": 0.02, "n_steps": 3, "friction": fr, **options}
    ref, h_ref = vfesim.run_dynamics(state, cfg, backend="numba", **kw)
    backend = dataclasses.replace(get("dask"), chunks=(4, 7, 2))
    out, h = vfesim.run_dynamics(state.chunk(agent=6), cfg, backend=backend, **kw)
    assert all(isinstance(out[k].data, da.Array) for k in out.data_vars)  # chunked in, chunked out
    assert out["mu_q"].chunks[0] == (4, 7, 2)
    for k in ref.data_vars:
        np.testing.assert_allclose(out[k].values, ref[k].values, rtol=1e-12, atol=1e-13, err_msg=k)
    for k in h_ref.data_vars:
        np.testing.assert_allclose(h[k].values, h_ref[k].values, rtol=1e-12, err_msg=k)


def test_riemannian_leapfrog_is_refused_on_dask():
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 6, seed=1)
    with pytest.raises(ValueError, match="'riemannian_leapfrog' runs on the 'numpy' and 'numba'"):
        vfesim.run_dynamics(state, cfg, method="riemannian_leapfrog", dt=0.01, n_steps=1, backend="dask")


# ---- a LocalCluster of two worker processes, one killed mid-run -----------------------------------------
# Seconds to wait for both workers. On a loaded 2-core CI machine (stop 38), three tests after the
# killed-worker ones each waited 30 s in vain for the nanny's replacement (it imports the package again);
# those tests now have a cluster of their own (killing_client), and every wait is longer.
WORKER_WAIT_S = 180


def _kill_once(marker: str, at_step: int, step: int, r0: int) -> None:
    """Task hook: the first task of chunk 0 at ``at_step`` kills its worker process (once: ``marker``)."""
    if step != at_step or r0 != 0:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _local_cluster():
    cluster = distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=":0",
        silence_logs=logging.CRITICAL,
    )
    client = distributed.Client(cluster, set_as_default=False)
    yield client
    client.close()
    cluster.close()


@pytest.fixture(scope="module")
def client():
    """Two worker processes for the tests that keep them alive."""
    yield from _local_cluster()


@pytest.fixture(scope="module")
def killing_client():
    """Two worker processes of their own for the tests that kill one (the others then need not wait for
    the nanny's replacement)."""
    yield from _local_cluster()


def _arm(client, tmp_path, at_step: int) -> str:
    """Every worker (both must be up: a worker without the hook could take chunk 0) kills itself in
    chunk 0's first task of ``at_step``, once."""
    client.wait_for_workers(2, timeout=WORKER_WAIT_S)
    marker = str(tmp_path / "killed")
    client.run(set_task_hook, functools.partial(_kill_once, marker, at_step))
    return marker


def _disarm(client) -> None:
    client.run(set_task_hook, None)


def test_killed_worker_is_recovered_and_the_run_unchanged(killing_client, reference, tmp_path, caplog):
    client = killing_client
    marker = _arm(client, tmp_path, at_step=3)
    pids = set(client.run(os.getpid).values())
    try:
        with client.as_current(), caplog.at_level(logging.INFO, logger="vfesim"):
            simulate(_scenario(), out=tmp_path / "r.zarr", progress=False)
    finally:
        _disarm(client)
    assert os.path.exists(marker)  # a worker died in the step-3 task
    client.wait_for_workers(2, timeout=WORKER_WAIT_S)
    assert set(client.run(os.getpid).values()) != pids  # and was replaced
    assert "dashboard" in caplog.text
    _same_runs(reference, tmp_path / "r.zarr")  # the same as on the threaded scheduler, bit for bit
    _intact(tmp_path / "r.zarr")
    info = json.loads(RunStore(tmp_path / "r.zarr").attrs["chunking"])
    assert info["scheduler"].startswith("distributed")


def test_killed_worker_without_retries_stops_with_the_last_checkpoint(killing_client, reference, tmp_path):
    client = killing_client

    def allowed_failures(n, dask_scheduler=None):
        old, dask_scheduler.allowed_failures = dask_scheduler.allowed_failures, n
        return old

    old = client.run_on_scheduler(allowed_failures, 0)
    _arm(client, tmp_path, at_step=3)
    path = tmp_path / "r.zarr"
    stopped = r"step 3: a Dask worker died .* step 2: `vfesim resume"
    try:
        with client.as_current(), pytest.raises(RunError, match=stopped):
            simulate(_scenario(), out=path, progress=False)
    finally:
        client.run_on_scheduler(allowed_failures, old)
        _disarm(client)
    assert RunStore(path).checkpoint_steps() == [0, 2]  # keep_checkpoints = 2
    _intact(path)
    with client.as_current():
        resume(path, progress=False)
    _same_runs(reference, path)


def test_frames_are_rechunked_only_where_zarr_chunks_would_straddle_tasks():
    """Before a partial-chunk write: every Zarr chunk inside one Dask chunk (else rechunked)."""
    from vfesim.io.store import _one_task_per_chunk

    aligned = da.zeros((2, 10, 3), chunks=(2, 5, 3))
    assert _one_task_per_chunk(aligned, (2, 5, 3)) is aligned
    coarse = da.zeros((2, 10, 3), chunks=(2, 10, 3))  # one task holds both Zarr chunks: fine as well
    assert _one_task_per_chunk(coarse, (2, 5, 3)) is coarse
    straddling = da.zeros((2, 10, 3), chunks=(2, (3, 7), 3))
    assert _one_task_per_chunk(straddling, (2, 5, 3)).chunks == ((2,), (5, 5), (3,))


def test_quantum_run_on_worker_processes_equals_the_threaded_run(client, tmp_path):
    """A density-matrix run (Gauss–Seidel chain over chunks, Born outcomes, a mirror step) on two worker
    processes: tasks and caches pickled, the same bits as on the threaded scheduler."""
    d = {
        "quantum": {"d": 2, "lambda_self": 0.3, "lambda_belief": 1.0, "lambda_obs": 0.2},
        "population": {"n_agents": 7, "seed": 3, "neighbours": "causal", "window": 2},
        "integrator": {
            "method": "channels",
            "dt": 0.1,
            "coupling": "C1",
            "coupling_strength": 0.3,
            "order": "gauss_seidel",
            "observe": "born",
            "mirror_steps": 1,
        },  # fmt: skip
        "run": {"n_steps": 3, "save_every": 1, "checkpoint_every": 2, "backend": "dask", "chunks": 3},
    }
    simulate(d, out=tmp_path / "t.zarr", progress=False)
    with client.as_current():
        simulate(d, out=tmp_path / "p.zarr", progress=False)
    a, b = open_run(tmp_path / "t.zarr").load(), open_run(tmp_path / "p.zarr").load()
    assert json.loads(RunStore(tmp_path / "p.zarr").attrs["chunking"])["scheduler"].startswith("distributed")
    for k in a.data_vars:
        np.testing.assert_array_equal(a[k].values, b[k].values, err_msg=k)
    _intact(tmp_path / "p.zarr")


def test_checkpoint_reload_does_not_validate_again(tmp_path, monkeypatch):
    """After a checkpoint a chunked run restores from it (cutting the task lineage) without validating
    the state again: only the initial state is validated, per chunk (gradient flow: in its first
    evaluation; Verlet: in the init tasks, errors only, and in the first evaluation), however many
    checkpoints follow."""
    from vfesim.backends import dask_backend
    from vfesim.integrators import chunked

    calls = []
    for module in (dask_backend, chunked):
        original = module.validate_state
        monkeypatch.setattr(
            module, "validate_state", lambda *a, _f=original, **k: (calls.append(1), _f(*a, **k))[1]
        )
    for method, per_chunk in (("gradient_flow", 1), ("verlet", 2)):
        calls.clear()
        simulate(_scenario(method), out=tmp_path / f"{method}.zarr", progress=False)  # checkpoints at 2, 4
        assert len(calls) == 3 * per_chunk, method  # chunks of 5, 5, 3


@pytest.mark.parametrize("method", ["gradient_flow", "verlet"])
def test_warnings_of_chunk_tasks_reach_the_caller_with_global_agents(method):
    """A warning recorded in a chunk task (an ill-conditioned covariance of agent 6, in the second chunk)
    is re-emitted on the client naming the global agent, once, also from a persisted evaluation."""
    from vfesim.state import ConditioningWarning

    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5)
    state = vfesim.random_state(cfg, 8, seed=0)
    Q, _ = np.linalg.qr(np.random.default_rng(4).standard_normal((3, 3)))
    S = (Q * np.logspace(0, -9, 3)) @ Q.T
    state["sigma_q"].values[6] = 0.5 * (S + S.T)
    backend = dataclasses.replace(get("dask"), chunks=4)
    with pytest.warns(ConditioningWarning) as rec:
        vfesim.run_dynamics(state, cfg, method, 1e-4, 1, backend=backend)
    texts = [str(w.message) for w in rec if issubclass(w.category, ConditioningWarning)]
    assert texts and all("sigma_q[agent=6]" in t for t in texts), texts


def _bytes_moved(client, scenario: dict, path) -> int:
    """Bytes the workers received from each other while ``scenario`` ran on ``client``."""
    client.wait_for_workers(2, timeout=WORKER_WAIT_S)
    client.run(lambda dask_worker: dask_worker.transfer_incoming_log.clear())
    with client.as_current():
        simulate(scenario, out=path, progress=False)
    logs = client.run(lambda dask_worker: [e["total"] for e in dask_worker.transfer_incoming_log])
    return sum(sum(v) for v in logs.values())


def test_chunk_tasks_stay_with_their_chunk(client, tmp_path):
    """Every task of a chunk runs on the worker that holds the chunk (dask_backend.chunk_workers): a
    sparse gradient-flow run moves, per step, only the rows other chunks read and their gB shares
    between the workers, not states, features or pair results (which were several times the state per
    step when the scheduler placed the tasks by their largest input)."""
    n, steps = 4000, 4
    scenario = {
        "model": {"K": 3, "aggregator": "softmin", "lambda_prior": 0.5},
        "population": {"n_agents": n, "seed": 0, "neighbours": "ring", "half_width": 4},
        "integrator": {"method": "gradient_flow", "dt": 0.01},
        "run": {"n_steps": steps, "save_every": 100, "backend": "dask", "chunks": n // 8},
    }
    moved = _bytes_moved(client, scenario, tmp_path / "run.zarr")
    state_bytes = n * (3 + 9 + 3 + 9 + 3) * 8
    # At most the state once (its first placement) and, per step, a little (the boundary rows and
    # shares of 8 chunks, a few kB); the scheduler's own placement moved about 3 states per step here.
    assert moved < state_bytes + steps * 0.1 * state_bytes, (moved, state_bytes)


def test_chunk_workers_follow_the_data_within_a_balanced_share(client):
    """Chunks the workers hold run where they are, up to an even share per worker; the others are dealt
    in contiguous runs (no client: no placement)."""
    from vfesim.backends.dask_backend import blocks, chunk_workers

    assert chunk_workers((0, 2, 4, 5)) == [None] * 3
    client.wait_for_workers(2, timeout=WORKER_WAIT_S)
    w0, w1 = sorted(client.scheduler_info()["workers"])
    with client.as_current():
        assert chunk_workers((0, 3, 6, 9, 12)) == [w0, w0, w1, w1]
        assert chunk_workers((0, 5, 10, 15, 16)) == [w0, w0, w1, w1]  # by agents: 10 and 6
        x = client.persist(da.zeros((6, 2), chunks=(1, 2)), workers=[w1])  # all six chunks on w1
        distributed.wait(x)
        got = chunk_workers(tuple(range(7)), blocks({"x": x}))
    assert got == [w1, w1, w1, w0, w0, w0]  # w1 keeps its share (3), the rest moves
    with client.as_current():  # a run's placement: only the chunks of a departed worker move
        gone = "tcp://gone:1"
        assert chunk_workers((0, 1, 2, 3, 4), keep=[w1, gone, w1, gone]) == [w1, w0, w1, w0]
        assert chunk_workers((0, 1, 2, 3, 4), keep=[w1, w1, w1, w0]) == [w1, w1, w1, w0]  # kept as it is
        assert chunk_workers((0, 3, 6), keep=[gone, gone]) == [w0, w1]  # no worker left: dealt again
        # a worker that joined (w0 holds nothing): it takes the last chunks of the most loaded one
        assert chunk_workers((0, 1, 2, 3, 4), keep=[w1, w1, w1, w1]) == [w1, w1, w0, w0]
        assert chunk_workers((0, 2, 4, 5, 9), keep=[w1, w1, w1, w1]) == [w1, w1, w1, w0]  # by agents
        assert chunk_workers((0, 1, 2), keep=[w1, w1]) == [w1, w0]
        assert chunk_workers((0, 5), keep=[w1]) == [w1]  # fewer chunks than workers: nothing to move
        # a first placement is kept as it is while no worker joins or leaves (the dealing may leave a
        # worker without a chunk: a small last chunk; the balancing gives it one at once)
        for b in [(0, 3, 6, 9, 12), (0, 5, 10, 15, 16), (0, 8, 9), (0, 1, 1, 4), (0, 100, 200, 300, 302)]:
            first = chunk_workers(b)
            assert chunk_workers(b, keep=first) == first, b
        assert chunk_workers((0, 8, 9)) == [w0, w1]


def test_fill_empty_gives_an_empty_worker_chunks_once():
    """The balancing behind chunk_workers: a worker without agents takes the last non-empty chunks of the
    most loaded workers until all are within the largest chunk; a placement without one is left alone."""
    from vfesim.backends.dask_backend import _fill_empty

    def fill(out, sizes, workers):
        load = {w: sum(n for n, o in zip(sizes, out, strict=True) if o == w) for w in workers}
        return _fill_empty(list(out), sizes, load)

    # four workers dealt contiguous runs, the small last chunk beside the third: the fourth takes it
    assert fill("abcc", [100, 100, 100, 2], "abcd") == list("abcd")
    assert fill("aaaa", [1, 1, 1, 1], "ab") == list("aabb")  # a joined worker, last chunks first
    assert fill("aaaa", [3, 3, 0, 0], "ab") == list("abaa")  # empty chunks are not moved
    assert fill("abb", [2, 5, 1], "abc") == list("abc")
    assert fill("aab", [5, 5, 1], "ab") == list("aab")  # unbalanced, but nobody empty: kept
    assert fill("aa", [4, 4], "abc") == list("ab")  # more workers than chunks: c stays empty


def test_a_worker_that_joins_a_run_takes_chunks():
    """A run started on one worker: a second worker that joins between steps takes half the chunks at the
    next step (the last ones), and the steps give the same states as on one worker."""
    from distributed import get_task_stream

    from vfesim.integrators import make_integrator

    cfg = vfesim.ModelConfig(K=3, neighbours=vfesim.SparseNeighbours.ring(64, 2))
    state = vfesim.random_state(cfg, 64, seed=1).chunk(agent=16)
    want, _ = vfesim.run_dynamics(state.compute(), cfg, method="gradient_flow", dt=0.01, n_steps=2)
    cluster = distributed.LocalCluster(
        n_workers=1, threads_per_worker=1, dashboard_address=":0", silence_logs=logging.CRITICAL
    )
    with cluster, distributed.Client(cluster, set_as_default=False) as client, client.as_current():
        integ = make_integrator("gradient_flow", cfg, 0.01, backend="dask")
        carry = integ.step(integ.init(state))
        (w0,) = client.scheduler_info()["workers"]
        cluster.scale(2)
        client.wait_for_workers(2, timeout=60)
        with get_task_stream(client) as ts:
            carry = integ.step(carry)
        (w1,) = set(client.scheduler_info()["workers"]) - {w0}
        assert integ.layout.placed == [w0, w0, w1, w1]
        # (the restrictions are loose: Dask's work stealing may still move one of these tasks)
        assert w1 in {t["worker"] for t in ts.data if "flow_task" in str(t["key"])}
        got = carry.state.compute()
    for k in ("mu_q", "sigma_q", "phi"):
        np.testing.assert_allclose(got[k].values, want[k].values, rtol=1e-12, atol=1e-14, err_msg=k)


def test_density_matrix_chunk_tasks_stay_with_their_chunk(client, tmp_path):
    """The same for a density-matrix run (channels, then a mirror step): the channel, frame, cache and
    mirror tasks of a chunk run on its worker (before: about ten times the state moved in 4 steps)."""
    n, steps = 2000, 4
    scenario = {
        "quantum": {"d": 3, "lambda_self": 0.3, "lambda_belief": 1.0},
        "population": {"n_agents": n, "seed": 3, "neighbours": "ring", "half_width": 2},
        "integrator": {
            "method": "channels",
            "dt": 0.1,
            "coupling": "C1",
            "coupling_strength": 0.3,
            "mirror_steps": 1,
        },
        "run": {"n_steps": steps, "save_every": 100, "backend": "dask", "chunks": n // 8},
    }
    moved = _bytes_moved(client, scenario, tmp_path / "run.zarr")
    state_bytes = n * (2 * 3 * 3 * 16 + 8 + 3 * 8)  # rho, hamiltonian, temperature, phi
    assert moved < 3 * state_bytes, (moved, state_bytes)  # about 2.2 states now (first placement, frames)
