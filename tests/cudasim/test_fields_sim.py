"""Field agents on the cuda backend under the Numba CUDA simulator (NumPy host arrays, tiny grids): the
weighted pairs batched over grid points (make_points_kernels) against the NumPy reference, and the whole
field energy and gradient against the numpy backend (SPEC §4: 1e-10 relative in float64)."""

import numpy as np
import pytest
from conftest import TOL
from vfesim_kernels import cuda as kc

import vfesim
from vfesim.backends import cuda_backend as cb
from vfesim.fields import FieldConfig
from vfesim.pairwise.weighted import pairwise_points_weighted

pytestmark = pytest.mark.cudasim


def _problem(seed, dtype="float64", P=4, n=5, D=4, k=3):
    """Receiver rows at random covered cells, a separate sender table (shuffled rows, one row that no
    point names), lists with masked entries: some receivers have no pair at all."""
    rng = np.random.default_rng(seed)
    cov = rng.uniform(size=(P, n)) < 0.6
    cells = np.flatnonzero(cov.ravel())
    offsets = np.concatenate([[0], np.cumsum(cov.sum(axis=1))])
    lists = cells % n
    cov_s = rng.uniform(size=(P, n)) < 0.7
    cells_s = np.flatnonzero(cov_s.ravel())
    rowmap = np.full(P * n, -1, np.int64)
    rowmap[cells_s] = rng.permutation(cells_s.size)
    index = np.array([[(i + s + 1) % n for s in range(k)] for i in range(n)])
    mask = rng.uniform(size=(n, k)) > 0.25
    mr, ms = cells.size, cells_s.size + 1
    f = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    u, v = (rng.uniform(0.1, 1.0, m).astype(dtype) for m in (mr, ms))
    return (f(mr, D), f(ms, D), f(mr), u, v, offsets, lists, rowmap.reshape(P, n), index, mask)


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_points_kernels_match_the_reference(dtype, aggregator):
    args = _problem(1, dtype)
    ref = pairwise_points_weighted(
        *(a.astype(np.float64) if a.dtype.kind == "f" else a for a in args), 0.7, aggregator
    )
    got = cb._pairwise_points(*args, 0.7, aggregator)
    t = TOL[dtype]
    assert got[0] == pytest.approx(ref[0], rel=t["rtol"] * 10)
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert a.dtype == np.dtype(dtype) and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=t["rtol"], atol=t["atol"] * np.abs(b).max())
    assert np.count_nonzero(got[1].any(axis=1)) < got[1].shape[0]  # a receiver without pairs: zeros


def _assert_parity(cfg, st):
    t_n, g_n = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    t_c, g_c = vfesim.energy_and_gradient(st, cfg, backend="cuda")
    assert t_n["belief_align"] != 0
    rtol = TOL["float64"]["rtol"]
    for k in t_n:
        assert t_c[k] == pytest.approx(t_n[k], rel=rtol, abs=rtol * abs(t_n["total"])), k
    for k in g_n.data_vars:
        ref = g_n[k].values
        np.testing.assert_allclose(g_c[k].values, ref, rtol=rtol, atol=rtol * np.abs(ref).max(), err_msg=k)


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_field_energy_parity(aggregator):
    rng = np.random.default_rng(2)
    obs = dict(lambda_obs=0.5, W=rng.standard_normal((2, 3)), R=np.array([[0.9, 0.1], [0.1, 0.7]]))
    cfg = FieldConfig(K=3, grid=(4, 3), aggregator=aggregator, lambda_prior=0.6, lambda_phi=0.3, **obs)
    st = vfesim.random_state(cfg, 4, seed=1, sigma=0.8, phi_radius=2.5)
    assert (st.support.values == 0).any()
    _assert_parity(cfg, st)


def test_field_energy_parity_explicit_lists_bounded_1d():
    nb = vfesim.SparseNeighbours.from_lists([[1, 2], [0], [], [0, 1, 2]])
    cfg = FieldConfig(K=3, grid=(6,), boundary="bounded", neighbours=nb, lambda_prior=0.4, cell_volume="grid")
    _assert_parity(cfg, vfesim.random_state(cfg, 4, seed=3, sigma=1.0))


def test_simulator_is_active():
    assert kc.SIMULATOR and cb.SIMULATOR


def test_dask_chunks_with_cuda_pairs():
    """The dask backend's field graph with inner="cuda": each receiver chunk's pairs in the simulated
    kernels (tasks in this thread: the simulator runs one launch at a time)."""
    dask = pytest.importorskip("dask")
    cfg = FieldConfig(K=3, grid=(4, 3), aggregator="softmin", lambda_prior=0.6)
    st = vfesim.random_state(cfg, 5, seed=4, sigma=0.8)
    t_n, g_n = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    with dask.config.set(scheduler="synchronous"):
        t_d, g_d = vfesim.energy_and_gradient(st, cfg, backend="dask", chunks=(2, 3), inner="cuda")
    rtol = TOL["float64"]["rtol"]
    assert t_n["belief_align"] != 0
    for k in t_n:
        assert t_d[k] == pytest.approx(t_n[k], rel=rtol, abs=rtol * abs(t_n["total"])), k
    for k in g_n.data_vars:
        ref = g_n[k].values
        np.testing.assert_allclose(g_d[k].values, ref, rtol=rtol, atol=rtol * np.abs(ref).max(), err_msg=k)


@pytest.mark.parametrize("method", ["gradient_flow", "verlet"])
def test_field_run_on_cuda_equals_numpy(tmp_path, method):
    """A field run with backend "cuda" (energy, gradient and integrator updates through the CUDA kernels,
    the grid flattened into the update batch) follows the numpy run: every frame to 1e-10."""
    from vfesim.io import open_run

    d = {
        "field": {"K": 3, "grid": [4, 3], "lambda_prior": 0.5, "kappa_beta": 2.0, "lambda_phi": 0.3},
        "population": {"n_agents": 3, "seed": 3, "support": "disc", "radius": 1.5, "placement": "lattice"},
        "integrator": {"method": method, "dt": 0.02},
        "run": {"n_steps": 2, "save_every": 1, "checkpoint_every": 2, "seed": 5},
    }
    runs = {}
    for b in ("numpy", "cuda"):
        d["run"]["backend"] = b
        vfesim.simulate(d, out=tmp_path / f"{b}.zarr", progress=False)
        runs[b] = open_run(tmp_path / f"{b}.zarr").load()
    assert runs["cuda"].attrs["backend"] == "cuda"
    for k in ("mu_q", "sigma_q", "phi", "energy_total"):
        np.testing.assert_allclose(runs["cuda"][k].values, runs["numpy"][k].values, rtol=1e-10, atol=1e-12)
