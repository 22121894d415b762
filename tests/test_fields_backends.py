"""Field agents on the numba and dask backends against numpy: the weighted pairs batched over grid points
(the Numba CPU kernel against the NumPy reference, which is checked against the per-point layer and the
plain sparse layer), the whole energy and gradient on numba, and agent chunkings on dask (1, 2, 3 and
uneven chunks, in-memory and Dask-backed states)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from conftest import TOL
from vfesim_kernels.pairwise_cpu import pairwise_points

import vfesim
from vfesim.fields import FieldConfig
from vfesim.pairwise import weighted
from vfesim.pairwise.reference import pairwise_sparse
from vfesim.pairwise.weighted import pairwise_points_weighted, pairwise_sparse_weighted
from vfesim.state import StateError


def _layout(cov, order=None):
    """Covered (point, agent) cells of cov (P, n) as rows, point-major: (offsets, agent per row,
    rowmap (P, n)); ``order`` permutes the row numbers of the rowmap (a sender table in another order)."""
    P, n = cov.shape
    cells = np.flatnonzero(cov.ravel())
    rows = np.arange(cells.size) if order is None else order
    rowmap = np.full(P * n, -1, np.int64)
    rowmap[cells] = rows
    offsets = np.concatenate([[0], np.cumsum(cov.sum(axis=1))])
    return offsets, cells % n, rowmap.reshape(P, n)


def _problem(seed=0, P=9, n=7, D=5, k=4, dtype="float64", separate=False):
    """Random features, weights and lists; ``separate``: the senders are another table (some agents
    cover other points as senders, rows in a shuffled order, one row no point names)."""
    rng = np.random.default_rng(seed)
    cov_r = rng.uniform(size=(P, n)) < 0.6
    offsets, lists, rowmap = _layout(cov_r)
    if separate:
        cov_s = rng.uniform(size=(P, n)) < 0.6
        m = int(cov_s.sum())
        _, _, rowmap = _layout(cov_s, order=rng.permutation(m))
        n_s = m + 1
    else:
        n_s = int(offsets[-1])
    n_r = int(offsets[-1])
    index = np.array([[(i + s + 1) % n for s in range(k)] for i in range(n)])
    mask = rng.uniform(size=(n, k)) > 0.2
    f = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    u, v = (rng.uniform(0.1, 1.0, m).astype(dtype) for m in (n_r, n_s))
    return (f(n_r, D), f(n_s, D), f(n_r), u, v, offsets, lists, rowmap, index, mask)


def _assert_outputs(got, ref, dtype="float64"):
    assert got[0] == pytest.approx(ref[0], rel=TOL[dtype]["rtol"] * (1e2 if dtype == "float64" else 1))
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_allclose(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * np.abs(b).max())


# ---- the NumPy reference -------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_reference_is_the_per_point_weighted_layer(aggregator, monkeypatch):
    """Per point, the weighted sparse layer on that point's rows alone; blocks of one point give the same."""
    args = _problem(separate=True)
    A, B, c, u, v, offsets, lists, rowmap, index, mask = args
    gA, gB, gc = np.zeros_like(A), np.zeros_like(B), np.zeros_like(c)
    gu, gv = np.zeros_like(u), np.zeros_like(v)
    E = 0.0
    for p in range(offsets.size - 1):
        r = slice(offsets[p], offsets[p + 1])
        senders = rowmap[p][index[lists[r]]]
        valid = mask[lists[r]] & (senders >= 0)
        out = pairwise_sparse_weighted(
            A[r], B, c[r], np.where(valid, senders, 0), valid, u[r], v, 0.8, aggregator
        )
        E += out[0]
        gA[r], gc[r], gu[r] = out[1], out[3], out[4]
        gB += out[2]
        gv += out[5]
    ref = pairwise_points_weighted(*args, 0.8, aggregator)
    _assert_outputs(ref, (E, gA, gB, gc, gu, gv))
    monkeypatch.setattr(weighted, "BLOCK_ELEMENTS", 1)  # one point per block
    _assert_outputs(pairwise_points_weighted(*args, 0.8, aggregator), ref)


def test_reference_with_unit_weights_on_one_point_is_the_plain_sparse_layer():
    A, B, c, *_ = _problem(P=1, n=6)
    n = A.shape[0]
    index = np.array([[(i + s + 1) % n for s in range(3)] for i in range(n)])
    mask = np.ones_like(index, bool)
    mask[2, 1] = False
    ones = np.ones(n)
    for aggregator in ("expected", "softmin"):
        plain = pairwise_sparse(A, A, c, index, mask, 0.9, aggregator)
        lay = (np.array([0, n]), np.arange(n), np.arange(n)[None])
        got = pairwise_points(A, A, c, ones, ones, *lay, index, mask, 0.9, aggregator)
        _assert_outputs(got[:4], plain)


# ---- the Numba kernel ----------------------------------------------------------------------------------
@pytest.mark.parametrize("serial", [True, False], ids=["serial", "parallel"])
@pytest.mark.parametrize("separate", [False, True], ids=["one-table", "sender-table"])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_points_kernel_matches_the_reference(aggregator, separate, serial):
    args = _problem(seed=1, separate=separate)
    ref = pairwise_points_weighted(*args, 0.7, aggregator)
    _assert_outputs(pairwise_points(*args, 0.7, aggregator, serial=serial), ref)


def test_points_kernel_float32():
    args = _problem(seed=2, dtype="float32", separate=True)
    ref = pairwise_points_weighted(
        *(a.astype(np.float64) if a.dtype == np.float32 else a for a in args), 0.7, "softmin"
    )
    _assert_outputs(pairwise_points(*args, 0.7, "softmin"), ref, "float32")


def test_points_kernel_is_bitwise_reproducible_and_thread_independent():
    args = _problem(seed=3, P=40, n=9, D=6, k=5)
    first = pairwise_points(*args, 0.6, "expected", serial=False)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = pairwise_points(*args, 0.6, "expected", serial=False)
    finally:
        numba.set_num_threads(threads)
    again = pairwise_points(*args, 0.6, "expected", serial=False)
    for out in (one, again):
        assert out[0] == first[0]
        for a, b in zip(out[1:], first[1:], strict=True):
            np.testing.assert_array_equal(a, b)


def test_points_kernel_rejects_bad_layouts_by_name():
    A, B, c, u, v, offsets, lists, rowmap, index, mask = _problem(seed=4)
    call = lambda **kw: pairwise_points(  # noqa: E731
        *(kw.get(k, x) for k, x in zip("A B c u v offsets lists rowmap index mask".split(),
                                        (A, B, c, u, v, offsets, lists, rowmap, index, mask), strict=True)),
        1.0, "expected",
    )  # fmt: skip
    with pytest.raises(ValueError, match="offsets"):
        call(offsets=offsets[:-1])
    with pytest.raises(ValueError, match="lists"):
        call(lists=lists + 100)
    with pytest.raises(ValueError, match="rowmap"):
        call(rowmap=np.where(rowmap >= 0, 0, -1))  # one sender row at every point
    with pytest.raises(ValueError, match="index"):
        call(index=index + 50)
    with pytest.raises(ValueError, match="features"):
        call(u=u[:-1])


# ---- the whole field energy ----------------------------------------------------------------------------
OBS = dict(
    lambda_obs=0.6, W=np.array([[1.0, 0.2, -0.3], [0.1, 0.5, 0.4]]), R=np.array([[0.9, 0.1], [0.1, 0.7]])
)
CONFIGS = {
    "2d-periodic-expected": dict(grid=(8, 7), lambda_phi=0.3),
    "2d-bounded-softmin-obs": dict(grid=(7, 8), boundary="bounded", aggregator="softmin", cell_volume="grid",
                                   spacing=0.5, **OBS),
    "1d-dense": dict(grid=(12,), neighbours="dense", jitter=0.01),
}  # fmt: skip


def _case(name, n=6, seed=2, dtype="float64"):
    cfg = FieldConfig(K=3, lambda_prior=0.6, kappa_beta=0.8, kappa_gamma=1.3, **CONFIGS[name])
    sigma = 1.1 * cfg.spacing  # cut at 3 sigma: supports overlap and leave points uncovered
    st = vfesim.random_state(cfg, n, seed=seed, sigma=sigma, phi_radius=2.5, dtype=dtype)
    assert (st.support.values == 0).any()
    return cfg, st


def _assert_backend_close(got, ref, dtype="float64"):
    (t1, g1), (t0, g0) = got, ref
    rtol = TOL[dtype]["rtol"]
    assert set(t1) == set(t0)
    for k in t0:
        assert t1[k] == pytest.approx(t0[k], rel=rtol, abs=rtol * abs(t0["total"])), k
    assert set(g1.data_vars) == set(g0.data_vars)
    for k in g0.data_vars:
        ref_k = g0[k].values
        np.testing.assert_allclose(
            np.asarray(g1[k].values), ref_k, rtol=rtol, atol=rtol * np.abs(ref_k).max()
        )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_numba_backend_matches_numpy(name):
    cfg, st = _case(name)
    ref = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    assert ref[0]["belief_align"] != 0 and ref[0]["prior_align"] != 0
    _assert_backend_close(vfesim.energy_and_gradient(st, cfg, backend="numba"), ref)


def test_numba_backend_float32_matches_numpy():
    cfg, st = _case("2d-periodic-expected", dtype="float32")
    got = vfesim.energy_and_gradient(st, cfg, backend="numba")
    assert got[1]["mu_q"].dtype == np.float32
    _assert_backend_close(got, vfesim.energy_and_gradient(st, cfg, backend="numpy"), "float32")


def test_numba_pairs_gradient_matches_a_finite_difference():
    """The alignment terms through the numba kernels: a directional central difference in the means,
    the covariances, the frames and the supports at once."""
    cfg, st = _case("2d-periodic-expected")
    cfg = cfg.replace(lambda_self=0.0, lambda_phi=0.0)
    a = {k: st[k].values.copy() for k in st.data_vars}
    nb = vfesim.backends.get("numba")
    f = lambda x: vfesim.fields.energy.energy_and_gradient(x, cfg, nb)  # noqa: E731
    t, g = f(a)
    rng = np.random.default_rng(5)
    d = {k: rng.standard_normal(v.shape) for k, v in a.items()}
    for k in ("sigma_q", "sigma_p"):
        d[k] = 0.1 * (d[k] + np.swapaxes(d[k], -1, -2))
    d["support"] = np.where(a["support"] > 0, 0.1 * d["support"], 0.0)
    eps = 1e-6
    plus = f({k: v + eps * d[k] for k, v in a.items()})[0]["total"]
    minus = f({k: v - eps * d[k] for k, v in a.items()})[0]["total"]
    fd = (plus - minus) / (2 * eps)
    assert float(sum((g[k] * d[k]).sum() for k in a)) == pytest.approx(fd, rel=1e-6)
    assert t["belief_align"] != 0 and t["prior_align"] != 0


# ---- dask ----------------------------------------------------------------------------------------------
CHUNKINGS = [7, 4, 3, (2, 4, 1)]  # 1, 2, 3 and uneven chunks of 7 agents


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=["1", "2", "3", "uneven"])
@pytest.mark.parametrize("name", ["2d-bounded-softmin-obs", "1d-dense"])
def test_dask_chunkings_match_numpy(name, chunks):
    cfg, st = _case(name, n=7, seed=3)
    ref = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    _assert_backend_close(
        vfesim.energy_and_gradient(st, cfg, backend="dask", chunks=chunks, inner="numba"), ref
    )


def test_dask_explicit_lists_and_a_chunked_dataset():
    """Explicit sparse lists; a Dask-backed state gives a gradient chunked like it, equal to numpy's."""
    nb = vfesim.SparseNeighbours.from_lists([[1, 4], [0, 2], [1, 3, 4], [0], [2, 3], [0, 1, 2, 3, 4]])
    cfg = FieldConfig(K=3, lambda_prior=0.5, grid=(6, 5), neighbours=nb, lambda_phi=0.2)
    st = vfesim.random_state(cfg, 6, seed=4, area=12.0)
    ref = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    got = vfesim.energy_and_gradient(st.chunk(agent=(2, 3, 1)), cfg, backend="dask", inner="numba")
    assert got[1]["mu_q"].chunks[0] == (2, 3, 1)
    _assert_backend_close(got, ref)
    arrays = {k: st[k].values for k in st.data_vars}
    t, _ = vfesim.backends.dask_backend.energy_and_gradient_arrays(arrays, cfg, inner="numba")
    assert t["total"] == pytest.approx(ref[0]["total"], rel=1e-12)  # the default chunking


def test_dask_chunk_errors_name_the_global_agent():
    cfg, st = _case("2d-periodic-expected", n=5)
    bad = st.copy(deep=True)
    bad["sigma_q"].values[3, 2, 1] = -np.eye(3)
    if bad["support"].values[3, 2, 1] == 0:
        bad["support"].values[3, 2, 1] = 0.5
    with pytest.raises(StateError, match=r"agent=3"):
        vfesim.energy_and_gradient(bad.chunk(agent=2), cfg, backend="dask", inner="numba")
