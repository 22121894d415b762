"""The dask backend (SPEC §4): chunk independence, agreement with the numpy backend for both agent
families, dense and sparse neighbours and both aggregators, chunked Datasets in and out, a LocalCluster
with two worker processes, and errors naming the bad option, variable and agent."""

from __future__ import annotations

import logging
import tomllib

import dask
import dask.array as da
import numpy as np
import pytest
from conftest import make_obs_config
from dask.core import flatten
from vfesim_kernels.pairwise_cpu import (
    DOT_MIN_D,
    pairwise_dense,
    pairwise_dense_receivers,
    pairwise_dense_rows,
    pairwise_dense_senders,
)

import vfesim
from vfesim.backends.dask_backend import chunk_bounds, default_chunk
from vfesim.cli import main
from vfesim.io import open_run
from vfesim.quantum import QuantumConfig
from vfesim.scenario import Scenario, ScenarioError

distributed = pytest.importorskip("distributed")

RTOL = 1e-13  # chunkings change only the grouping of float64 sums
N = 37
CHUNKINGS = [N, 19, 13, (5, 29, 3)]  # 1, 2, 3 and uneven chunks


def _config(family: str, neighbours: str, aggregator: str):
    nb = "dense" if neighbours == "dense" else vfesim.SparseNeighbours.ring(N, 2)
    if family == "gaussian":
        return vfesim.ModelConfig(K=3, lambda_prior=0.6, kappa_beta=0.8, aggregator=aggregator, neighbours=nb)
    return QuantumConfig(d=2, lambda_prior=0.6, kappa_beta=0.8, aggregator=aggregator, neighbours=nb)


def _assert_close(a, b, rtol=RTOL):
    """Terms within rtol of the total; every gradient within rtol of its largest entry."""
    (ta, ga), (tb, gb) = a, b
    assert set(ta) == set(tb) and set(ga.data_vars) == set(gb.data_vars)
    for k in tb:
        assert abs(ta[k] - tb[k]) <= rtol * abs(tb["total"]), k
    for k in gb.data_vars:
        assert ga[k].dims == gb[k].dims and ga[k].dtype == gb[k].dtype, k
        x, y = np.asarray(ga[k].values), np.asarray(gb[k].values)
        assert np.abs(x - y).max() <= rtol * np.abs(y).max(), k


CASES = [
    (f, n, a) for f in ("gaussian", "quantum") for n in ("dense", "ring") for a in ("softmin", "expected")
]


@pytest.mark.parametrize(("family", "neighbours", "aggregator"), CASES)
def test_chunk_independence_and_numpy_parity(family, neighbours, aggregator):
    cfg = _config(family, neighbours, aggregator)
    state = vfesim.random_state(cfg, N, seed=5)
    ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    first = None
    for chunks in CHUNKINGS:
        out = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=chunks)
        assert all(isinstance(v.data, np.ndarray) for v in out[1].data_vars.values())
        _assert_close(out, ref)
        if first is not None:
            _assert_close(out, first)
        first = first or out


def test_same_chunking_is_bitwise_reproducible():
    cfg = make_obs_config(K=3, lambda_prior=0.5, aggregator="expected")
    state = vfesim.random_state(cfg, N, seed=2)
    t1, g1 = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(9, 20, 8))
    t2, g2 = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(9, 20, 8))
    assert t1 == t2
    for k in g1.data_vars:
        np.testing.assert_array_equal(g1[k].values, g2[k].values)


def test_sparse_plan_reads_only_the_boundary_rows_of_neighbouring_chunks():
    """A ring's receiver chunk reads its own chunk whole and only the rows its lists name of the chunks
    beside it; its local rows still point at the listed senders."""
    from vfesim.backends.dask_backend import _sparse_plan

    nb = vfesim.SparseNeighbours.ring(64, 2)
    cfg = vfesim.ModelConfig(K=3, neighbours=nb)
    bounds = (0, 16, 32, 48, 64)
    for c, (owners, takes, local, msk) in enumerate(_sparse_plan(cfg, bounds)):
        assert owners == sorted({(c - 1) % 4, c, (c + 1) % 4})
        rows = {}
        for s, t in zip(owners, takes, strict=True):
            if s == c:
                assert t is None
                rows[s] = np.arange(bounds[s], bounds[s + 1])
            else:  # two boundary rows of a neighbouring chunk
                want = [14, 15] if s == (c - 1) % 4 else [0, 1]
                np.testing.assert_array_equal(t, want)
                rows[s] = bounds[s] + t
        senders = np.concatenate([rows[s] for s in owners])
        np.testing.assert_array_equal(senders[local][msk], nb.index[bounds[c] : bounds[c + 1]][msk])
        assert local.dtype == np.int32


def test_sparse_plan_reads_whole_chunks_when_lists_name_many_chunks(monkeypatch):
    """Lists naming more than TAKE_CHUNKS other chunks (no locality) read whole chunks: no row subsets
    (each would be one more task per evaluation), and the rows still point at the listed senders."""
    from vfesim.backends import dask_backend

    nb = vfesim.SparseNeighbours.ring(64, 2)
    cfg = vfesim.ModelConfig(K=3, neighbours=nb)
    bounds = (0, 16, 32, 48, 64)
    monkeypatch.setattr(dask_backend, "TAKE_CHUNKS", 1)  # a ring's chunks name two others
    for c, (owners, takes, local, msk) in enumerate(dask_backend._sparse_plan(cfg, bounds)):
        assert takes == [None] * len(owners)
        senders = np.concatenate([np.arange(bounds[s], bounds[s + 1]) for s in owners])
        np.testing.assert_array_equal(senders[local][msk], nb.index[bounds[c] : bounds[c + 1]][msk])
    state = vfesim.random_state(cfg, 64, seed=3)
    ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    _assert_close(vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=16), ref)


def test_gathered_features_give_the_same_bits_as_direct_inputs(monkeypatch):
    """Dense pair tasks take every chunk's features directly (few chunks) or one gathered copy (more than
    DIRECT_CHUNKS chunks): the same rows in the same order, so the same bits."""
    from vfesim.backends import dask_backend

    cfg = make_obs_config(K=3, lambda_prior=0.5, aggregator="softmin")
    state = vfesim.random_state(cfg, N, seed=2)
    monkeypatch.setattr(dask_backend, "_distributed", lambda: True)  # direct inputs, as on a cluster
    t1, g1 = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(9, 20, 8))
    monkeypatch.setattr(dask_backend, "DIRECT_CHUNKS", 1)
    t2, g2 = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(9, 20, 8))
    assert t1 == t2
    for k in g1.data_vars:
        np.testing.assert_array_equal(g1[k].values, g2[k].values)


def test_numba_tasks_run_the_serial_agent_kernels(monkeypatch):
    """inner="numba" tasks run the Gaussian per-agent stages in the serial builds of the fused kernels
    (Numba's parallel builds must not start from the scheduler's threads), and only those."""
    from vfesim_kernels import agent_cpu

    asked = []
    real = agent_cpu._kernel
    monkeypatch.setattr(
        agent_cpu,
        "_kernel",
        lambda name, n, k, serial=False: asked.append((name, serial)) or real(name, n, k, serial),
    )
    cfg = make_obs_config(K=3, lambda_prior=0.5)
    state = vfesim.random_state(cfg, N, seed=2)
    asked.clear()
    with dask.config.set(scheduler="threads"):
        vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(9, 20, 8), validate=False)
    names = {name for name, _ in asked}
    assert {"frames", "means", "features", "vjp", "phi", "self_kl"} <= names
    assert all(serial for _, serial in asked)


def test_numba_tasks_run_the_quantum_kernels_in_their_own_thread(monkeypatch):
    """inner="numba" tasks run the density-matrix per-agent kernels in the calling scheduler thread
    (``SERIAL_OPS["quantum"]``), never on the kernels' own thread pool, with the numpy backend's
    results."""
    from vfesim_kernels import quantum_cpu

    ran, pooled = [], []
    for name, kernel in list(quantum_cpu.KERNELS.items()):
        monkeypatch.setitem(
            quantum_cpu.KERNELS, name, lambda *a, _k=kernel, _n=name: (ran.append(_n), _k(*a))[1]
        )
    pool = quantum_cpu._run
    monkeypatch.setattr(quantum_cpu, "_run", lambda *a: (pooled.append(1), pool(*a))[1])
    cfg = vfesim.QuantumConfig(d=3, lambda_belief=1.0, lambda_prior=0.4)
    state = vfesim.random_state(cfg, 12, seed=2)
    ref_terms, ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    with dask.config.set(scheduler="threads"):
        terms, grads = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(5, 7), validate=False)
    assert {"energy_prep", "energy_features", "energy_backward"} <= set(ran) and not pooled
    assert abs(terms["total"] - ref_terms["total"]) <= 1e-12 * abs(ref_terms["total"])
    for k in ref.data_vars:
        np.testing.assert_allclose(grads[k].values, ref[k].values, rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("family", ["gaussian", "quantum"])
def test_chunked_dataset_gives_chunked_gradients(family):
    cfg = _config(family, "ring", "softmin")
    state = vfesim.random_state(cfg, N, seed=7)
    chunked = state.chunk(agent=(10, 20, 7))
    terms, grads = vfesim.energy_and_gradient(chunked, cfg, backend="dask")
    for k in grads.data_vars:
        assert isinstance(grads[k].data, da.Array), k
        assert grads[k].chunks[0] == (10, 20, 7), k
    _assert_close((terms, grads), vfesim.energy_and_gradient(state, cfg, backend="numpy"))


def test_float32_chunked():
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5, aggregator="softmin")
    state = vfesim.random_state(cfg, N, seed=3, dtype="float32")
    out = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=12)
    assert out[1]["sigma_q"].dtype == np.float32
    _assert_close(out, vfesim.energy_and_gradient(state, cfg, backend="numpy"), rtol=1e-5)


@pytest.mark.parametrize("D", [10, 40])  # the tiled and the BLAS paths
def test_receiver_ranges_sum_to_the_full_kernel(D):
    rng = np.random.default_rng(0)
    n = 70
    A, B, c = rng.normal(size=(n, D)), rng.normal(size=(n, D)), rng.normal(size=n)
    E, gA, gB, gc = pairwise_dense(A, B, c, 1.3, "expected")
    bounds = (0, 3, 40, 70)
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    parts = [pairwise_dense_rows(A[a:b], c[a:b], B, a, 1.3, "expected") for a, b in spans]
    assert abs(sum(p[0].sum() for p in parts) - E) <= 1e-13 * abs(E)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), gA, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(np.concatenate([p[2] for p in parts]), gc, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(sum(p[3] for p in parts), gB, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("D", [10, 40])  # the tiled and the BLAS paths
def test_two_passes_over_ranges_equal_the_full_kernel(D, aggregator):
    """Pass 1 (receiver ranges: energies, gA, gc, row statistics) and pass 2 (sender ranges: gB from
    every receiver's statistics) over a chunking add up to pairwise_dense; pass 1's rows are bitwise
    those of pairwise_dense_rows (the same kernels). Ranges of one agent test the excluded diagonal
    at both ends."""
    rng = np.random.default_rng(1)
    n = 70
    A, B, c = rng.normal(size=(n, D)), rng.normal(size=(n, D)), rng.normal(size=n)
    E, gA, gB, gc = pairwise_dense(A, B, c, 1.3, aggregator)
    spans = list(zip((0, 1, 3, 40, 69), (1, 3, 40, 69, 70), strict=True))
    p1 = [pairwise_dense_receivers(A[a:b], c[a:b], B, a, 1.3, aggregator) for a, b in spans]
    for (a, b), p in zip(spans, p1, strict=True):
        erow, gA_r, gc_r, _ = pairwise_dense_rows(A[a:b], c[a:b], B, a, 1.3, aggregator)
        for x, y in [(p[0], erow), (p[1], gA_r), (p[2], gc_r)]:
            np.testing.assert_array_equal(x, y)
    assert abs(sum(p[0].sum() for p in p1) - E) <= 1e-13 * abs(E)
    np.testing.assert_allclose(np.concatenate([p[1] for p in p1]), gA, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(np.concatenate([p[2] for p in p1]), gc, rtol=1e-13, atol=1e-14)
    m, inv_s, abar = (np.concatenate([p[k] for p in p1]) for k in (3, 4, 5))
    parts = [pairwise_dense_senders(A, c, m, inv_s, abar, B[a:b], a, 1.3, aggregator) for a, b in spans]
    assert all(p.dtype == np.float64 for p in parts)
    np.testing.assert_allclose(np.concatenate(parts), gB, rtol=1e-13, atol=1e-14)
    # Other sender ranges: the same gB rows, bitwise on the tiled path (each pair's weight and each
    # receiver tile's sum do not depend on the range); on the BLAS path the gemm tiles follow the range.
    again = pairwise_dense_senders(A, c, m, inv_s, abar, B[3:69], 3, 1.3, aggregator)
    if D < DOT_MIN_D:
        np.testing.assert_array_equal(again, np.concatenate(parts[2:4]))
    np.testing.assert_allclose(again, gB[3:69], rtol=1e-13, atol=1e-14)
    with pytest.raises(ValueError, match="s0=60"):
        pairwise_dense_senders(A, c, m, inv_s, abar, B[:20], 60, 1.3, aggregator)
    with pytest.raises(ValueError, match="row statistics"):
        pairwise_dense_senders(A, c, m[:5], inv_s, abar, B[:20], 0, 1.3, aggregator)
    with pytest.raises(ValueError, match="r0=60"):
        pairwise_dense_receivers(A[:20], c[:20], B, 60, 1.3, aggregator)


def test_two_passes_float32_sum_in_float64():
    """float32 features: gA, gc in float32 as pairwise_dense_rows gives them, gB in float64 close to
    pairwise_dense's float32 gB (rounding of the dtype only)."""
    rng = np.random.default_rng(2)
    n, D = 50, 10
    A, B, c = (rng.normal(size=s).astype(np.float32) for s in ((n, D), (n, D), n))
    _, gA, gB, gc = pairwise_dense(A, B, c, 0.9, "expected")
    p1 = pairwise_dense_receivers(A, c, B, 0, 0.9, "expected")
    assert p1[1].dtype == p1[2].dtype == p1[3].dtype == np.float32
    gB2 = pairwise_dense_senders(A, c, *p1[3:], B, 0, 0.9, "expected")
    assert gB2.dtype == np.float64
    np.testing.assert_allclose(gB2, gB, rtol=1e-5, atol=1e-6 * np.abs(gB).max())
    np.testing.assert_allclose(p1[1], gA, rtol=1e-5, atol=1e-6 * np.abs(gA).max())


def test_chunk_bounds_and_default_chunk():
    assert chunk_bounds(10, 4) == (0, 4, 8, 10)
    assert chunk_bounds(10, (3, 7)) == (0, 3, 10)
    assert default_chunk(10, 9, 10) == 10
    assert 1 <= default_chunk(1 << 20, (1 << 20) - 1, 10) < 1 << 20


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"chunks": 0}, "chunks: agents per chunk must be >= 1"),
        ({"chunks": (10, 10)}, r"chunks: chunk sizes \(10, 10\) sum to 20, not the 37 agents"),
        ({"chunks": "auto"}, "chunks: expected agents per chunk"),
        ({"inner": "gpu"}, "inner: unknown 'gpu'"),
    ],
)
def test_bad_options_are_named(options, match):
    cfg = _config("gaussian", "dense", "softmin")
    state = vfesim.random_state(cfg, N, seed=1)
    with pytest.raises(ValueError, match=match):
        vfesim.energy_and_gradient(state, cfg, backend="dask", **options)


def test_dask_options_rejected_by_other_backends():
    cfg = _config("gaussian", "dense", "softmin")
    state = vfesim.random_state(cfg, 8, seed=1)
    with pytest.raises(TypeError, match=r"option\(s\) \['chunks'\] are not options of backend 'numpy'"):
        vfesim.energy_and_gradient(state, cfg, backend="numpy", chunks=4)


@pytest.mark.parametrize("lazy", [False, True])
def test_bad_state_names_variable_and_global_agent(lazy):
    cfg = _config("gaussian", "ring", "softmin")
    state = vfesim.random_state(cfg, N, seed=1)
    sigma = state["sigma_q"].values.copy()
    sigma[23] = -np.eye(3)
    state = state.assign(sigma_q=(state["sigma_q"].dims, sigma))
    if lazy:
        state = state.chunk(agent=10)  # agent 23 is row 3 of the third chunk
    with pytest.raises(vfesim.StateError, match=r"sigma_q\[agent=23\]: is not positive definite"):
        vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=None if lazy else 10)


SCENARIO = """
[model]
K = 3
kappa_beta = 2.0
lambda_prior = 0.3
[population]
n_agents = 11
seed = 3
neighbours = "ring"
half_width = 2
[integrator]
method = "verlet"
dt = 0.05
friction = 0.1
[run]
n_steps = 6
save_every = 2
checkpoint_every = 2
backend = "dask"
chunks = 4
"""


def test_cli_run_and_resume_on_dask_are_bitwise(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text(SCENARIO)
    assert main(["run", str(toml), "--out", str(tmp_path / "ref.zarr"), "-q"]) == 0
    assert main(["run", str(toml), "--out", str(tmp_path / "r.zarr"), "--steps", "2", "-q"]) == 0
    assert main(["resume", str(tmp_path / "r.zarr"), "--steps", "6", "-q"]) == 0
    ref, res = open_run(tmp_path / "ref.zarr").load(), open_run(tmp_path / "r.zarr").load()
    assert ref["step"].values.tolist() == res["step"].values.tolist() == [0, 2, 4, 6]
    for k in ref.data_vars:
        np.testing.assert_array_equal(res[k].values, ref[k].values, err_msg=k)


def test_run_dynamics_on_dask_matches_numpy():
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5, aggregator="softmin")
    state = vfesim.random_state(cfg, 20, seed=4)
    ref, _ = vfesim.run_dynamics(state, cfg, method="verlet", dt=0.02, n_steps=3, backend="numpy")
    out, _ = vfesim.run_dynamics(state, cfg, method="verlet", dt=0.02, n_steps=3, backend="dask")
    for k in ref.data_vars:
        np.testing.assert_allclose(out[k].values, ref[k].values, rtol=1e-12, atol=1e-13, err_msg=k)


def test_run_chunks_needs_the_dask_backend():
    bad = SCENARIO.replace('backend = "dask"', 'backend = "numpy"')
    with pytest.raises(ScenarioError, match="run.chunks"):
        Scenario.from_dict(tomllib.loads(bad))


# LocalCluster tests last: the threaded tests above have compiled (and cached) the kernels by then.
@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR
    )
    client = distributed.Client(cluster, set_as_default=False)
    yield client
    client.close()
    cluster.close()


@pytest.mark.parametrize(
    ("family", "neighbours", "aggregator", "lazy"),
    [("gaussian", "dense", "softmin", False), ("quantum", "ring", "expected", True)],
)
def test_local_cluster_two_processes(client, family, neighbours, aggregator, lazy):
    cfg = _config(family, neighbours, aggregator)
    state = vfesim.random_state(cfg, N, seed=11)
    ref = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(10, 20, 7))
    with client.as_current():
        if lazy:
            out = vfesim.energy_and_gradient(state.chunk(agent=(10, 20, 7)), cfg, backend="dask")
            # persisted on the workers: the gradient's chunks are the cluster's futures
            keys = {k for v in out[1].data_vars.values() for k in flatten(v.data.__dask_keys__())}
            assert keys <= set(client.who_has())
        else:
            out = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(10, 20, 7))
        _assert_close(out, ref, rtol=0.0)  # the same tasks in another process: bitwise equal
        _assert_close(out, vfesim.energy_and_gradient(state, cfg, backend="numpy"))


def test_in_memory_chunks_are_scattered_over_the_workers(client, monkeypatch):
    """An in-memory state's chunks go to the workers before the graph (spread, not all on one worker:
    each to its dealt worker, dask_backend.chunk_workers); the result is the threaded scheduler's."""
    cfg = _config("gaussian", "dense", "softmin")
    state = vfesim.random_state(cfg, N, seed=12)
    ref = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(20, 17))
    scattered = []
    real = client.scatter

    def spy(data, **kw):
        futures = real(data, **kw)
        scattered.append(client.who_has(futures))  # key -> the workers holding it
        return futures

    monkeypatch.setattr(client, "scatter", spy)
    with client.as_current():
        out = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(20, 17))
    held = [w for ws in scattered for w_s in ws.values() for w in w_s]
    assert sorted(held) == sorted(client.nthreads())  # one chunk on each worker
    _assert_close(out, ref, rtol=0.0)


def test_cuda_tasks_take_turns_on_the_device():
    """Tasks with inner "cuda" hold the process's device lock (numba-cuda's first kernel load is not
    thread safe); inner "numba" tasks run freely."""
    import threading

    from vfesim.backends.dask_backend import DEVICE_LOCK, device_task

    def free_elsewhere() -> bool:
        got = []

        def probe():
            got.append(DEVICE_LOCK.acquire(blocking=False))
            if got[0]:
                DEVICE_LOCK.release()

        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return got[0]

    seen = []

    @device_task
    def task(x, inner="numba"):
        seen.append(free_elsewhere())
        return x

    assert [task(1), task(2, inner="cuda"), task(3, "cuda"), task(4, "numba")] == [1, 2, 3, 4]
    assert seen == [True, False, False, True]


def test_task_warnings_keep_each_threads_record():
    """Two tasks in threads of one process: A silences warnings, B records them; A leaves while B is
    inside. Unserialised, A's exit would restore the process's warning state under B (B's warning lost,
    as a chunk's ConditioningWarning once was); task_warnings makes B wait for A."""
    import threading
    import time
    import warnings

    from vfesim.backends.dask_backend import task_warnings

    a_in, b_trying, a_out = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def a():
        with task_warnings(record=False):
            a_in.set()
            b_trying.wait(5)
            time.sleep(0.1)  # unserialised, B is inside by now
        a_out.set()

    def b():
        a_in.wait(5)
        b_trying.set()
        with task_warnings(record=True) as caught:
            a_out.wait(5)
            warnings.warn("from b", UserWarning, stacklevel=2)
        got["b"] = [str(w.message) for w in caught]

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got["b"] == ["from b"]
