"""The dask backend with inner="cuda" on a real GPU: each task's features, pair results and gB rows stay on
the worker's GPU (CuPy) between tasks, the sparse plan cuts boundary rows out of device features, and a
two-process cluster moves device results between workers. Against the numpy backend (1e-10 relative,
float64 / complex128). The same graph runs on NumPy under the CUDA simulator (tests/cudasim). Skipped
without a CUDA GPU."""

import logging
import os

import numpy as np
import pytest

import vfesim
from vfesim.backends import cuda_available
from vfesim.quantum import QuantumConfig

dask = pytest.importorskip("dask")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not cuda_available(), reason="needs a CUDA GPU"
    ),
]

N = 300
CHUNKS = (97, 150, 53)  # ring half width 2: two boundary rows of each neighbouring chunk are cut out
RTOL = 1e-10


def _config(family: str, neighbours: str):
    nb = "dense" if neighbours == "dense" else vfesim.SparseNeighbours.ring(N, 2)
    if family == "gaussian":
        return vfesim.ModelConfig(K=3, lambda_prior=0.6, kappa_beta=0.8, neighbours=nb)
    return QuantumConfig(d=3, lambda_prior=0.6, kappa_beta=0.8, aggregator="expected", neighbours=nb)


def _assert_close(out, ref):
    (t, g), (t_ref, g_ref) = out, ref
    for k in t_ref:
        assert abs(t[k] - t_ref[k]) <= RTOL * abs(t_ref["total"]), k
    for k in g_ref.data_vars:
        x, y = np.asarray(g[k].values), g_ref[k].values
        assert x.dtype == y.dtype, k
        assert np.abs(x - y).max() <= RTOL * np.abs(y).max(), k


@pytest.mark.parametrize("scheduler", ["threads", "synchronous"])
@pytest.mark.parametrize(
    ("family", "neighbours"),
    [("gaussian", "dense"), ("gaussian", "ring"), ("quantum", "dense"), ("quantum", "ring")],
)
def test_cuda_chunks_match_numpy(family, neighbours, scheduler):
    cfg = _config(family, neighbours)
    state = vfesim.random_state(cfg, N, seed=4)
    ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    with dask.config.set(scheduler=scheduler):
        out = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=CHUNKS, inner="cuda")
        _assert_close(out, ref)
        lazy = vfesim.energy_and_gradient(state.chunk(agent=CHUNKS), cfg, backend="dask", inner="cuda")
    _assert_close(lazy, ref)


def test_two_worker_processes_move_device_results():
    distributed = pytest.importorskip("distributed")
    cfg = _config("gaussian", "ring")
    state = vfesim.random_state(cfg, N, seed=4)
    ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            silence_logs=logging.ERROR,
        ) as cluster,
        distributed.Client(cluster) as client,
        client.as_current(),
    ):
        lazy = client.persist(state.chunk(agent=CHUNKS))
        _assert_close(vfesim.energy_and_gradient(lazy, cfg, backend="dask", inner="cuda"), ref)


def test_gradient_flow_run_matches_numpy(tmp_path):
    scn = {
        "model": {"K": 3, "lambda_prior": 0.5, "kappa_beta": 2.0},
        "population": {"n_agents": N, "seed": 1, "neighbours": "ring", "half_width": 2},
        "integrator": {"method": "gradient_flow", "dt": 0.01},
        "run": {"n_steps": 4, "save_every": 2, "checkpoint_every": 2},
    }
    ref = vfesim.simulate(scn, out=tmp_path / "ref.zarr", backend="numpy", progress=False).open()
    scn["run"] |= {"backend": "dask", "chunks": 100}  # two boundary rows cut out of each neighbour
    got = vfesim.simulate(scn, out=tmp_path / "dask.zarr", progress=False).open()
    assert got.attrs["backend"] == "dask" and '"inner": "cuda"' in got.attrs["chunking"]
    for k in ref.data_vars:
        x, y = got[k].values, ref[k].values
        if y.dtype == bool:
            np.testing.assert_array_equal(x, y, err_msg=k)
        else:
            assert np.abs(x - y).max() <= 1e-9 * max(np.abs(y).max(), 1.0), k


@pytest.mark.parametrize("coupling", ["C1", "C2"])
def test_quantum_channels_run_matches_numpy(tmp_path, coupling):
    """A density-matrix run on dask, inner "cuda": each chunk's Jacobi channel step in the cuda backend's
    kernels on the GPU, the window's senders from the neighbouring chunks."""
    scn = {
        "quantum": {"d": 3, "lambda_self": 0.3, "lambda_belief": 1.0},
        "population": {"n_agents": N, "seed": 2, "neighbours": "ring", "half_width": 2},
        "integrator": {
            "method": "channels",
            "dt": 0.1,
            "coupling": coupling,
            "coupling_strength": 0.3,
            "dephasing_rate": 0.2,
        },
        "run": {"n_steps": 3, "save_every": 1},
    }
    ref = vfesim.simulate(scn, out=tmp_path / "ref.zarr", backend="numpy", progress=False).open()
    scn["run"] |= {"backend": "dask", "chunks": 100}
    got = vfesim.simulate(scn, out=tmp_path / "dask.zarr", progress=False).open()
    assert got.attrs["backend"] == "dask" and '"inner": "cuda"' in got.attrs["chunking"]
    x, y = got["rho"].values, ref["rho"].values
    assert np.abs(x - y).max() <= 1e-10 * np.abs(y).max()
