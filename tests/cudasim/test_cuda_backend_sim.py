"""The cuda backend's whole code path under the Numba CUDA simulator (NumPy host arrays, tiny N).

Parity with the numpy backend (SPEC §4: 1e-10 relative in float64, 1e-4 in float32), both aggregators,
dense and sparse neighbours, every term switched on and off, several tiles and sender slices, a
directional finite difference, determinism and buffer reuse.
"""

import numpy as np
import pytest
from conftest import FD_RTOL, TOL, make_obs_config
from vfesim_kernels import cuda as kc

import vfesim
from vfesim.backends import cuda_backend as cb
from vfesim.backends import numpy_backend as nb
from vfesim.pairwise import gemm

pytestmark = pytest.mark.cudasim


def test_simulator_is_active():
    assert kc.SIMULATOR and cb.SIMULATOR
    assert cb.array_module() is np


def _arrays(cfg, n, dtype="float64", seed=0, **kw):
    st = vfesim.random_state(cfg, n_agents=n, seed=seed, dtype=dtype, **kw)
    return {k: st[k].values.copy() for k in st.data_vars}


def _assert_parity(cfg, arrays):
    """cuda backend (simulated) against the numpy backend on the same inputs."""
    dt = arrays["mu_q"].dtype
    t_c, g_c = cb.energy_and_gradient(cb.to_device(arrays), cfg)
    t_n, g_n = nb.energy_and_gradient(arrays, cfg)
    rtol = TOL[dt.name]["rtol"]
    assert set(t_c) == set(t_n)
    for k in t_n:
        np.testing.assert_allclose(t_c[k], t_n[k], rtol=rtol, atol=rtol * abs(t_n["total"]), err_msg=k)
    assert set(g_c) == set(arrays)
    for k in g_n:
        assert g_c[k].dtype == dt and g_c[k].shape == arrays[k].shape
        scale = float(np.abs(g_n[k]).max())
        np.testing.assert_allclose(g_c[k], g_n[k], rtol=rtol, atol=rtol * scale, err_msg=k)
    return t_c, g_c


BASE = dict(lambda_prior=0.6, kappa_beta=0.7, kappa_gamma=1.3)


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dense_parity(aggregator, dtype):
    # float32 (SIMT kernels), N = 11 with 4 threads x 2 owners per block: a partial owner block, two sender
    # slices, a partial tile. float64 (tensor-core kernels, one warp of 16 owners per block here), N = 37:
    # three owner blocks, two sender slices, partial tiles.
    cfg = vfesim.ModelConfig(K=3, aggregator=aggregator, **BASE)
    N = 37 if dtype == "float64" else 11
    nt, per_block = kc.dense_layout(kc.feature_dim(3), dtype)
    assert kc.dense_splits(N, N, 0, per_block, nt)[0] == 2
    _assert_parity(cfg, _arrays(cfg, N, dtype))


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sparse_parity(aggregator, dtype):
    # Ragged lists with an empty row (contributes 0) and a sender nobody lists.
    lists = [[1, 2], [], [0, 4], [0, 1, 4], [3], [0, 2, 3]]
    cfg = vfesim.ModelConfig(
        K=3, aggregator=aggregator, neighbours=vfesim.SparseNeighbours.from_lists(lists), **BASE
    )
    _assert_parity(cfg, _arrays(cfg, 6, dtype))


def test_sparse_ring_parity():
    cfg = vfesim.ModelConfig(K=3, neighbours=vfesim.SparseNeighbours.ring(9, 2), **BASE)
    _assert_parity(cfg, _arrays(cfg, 9))


@pytest.mark.parametrize(
    "kw",
    [
        dict(K=5),
        dict(irreps=[0, 1]),  # block-diagonal generators, even K
        dict(irreps=[1, 2]),
    ],
    ids=["K5", "irreps01", "irreps12"],
)
def test_other_irreps(kw):
    cfg = vfesim.ModelConfig(**kw, **BASE)
    _assert_parity(cfg, _arrays(cfg, 5))


def test_large_angles_many_squarings():
    # |phi| near pi: several squarings of the scaled Taylor series.
    cfg = vfesim.ModelConfig(K=5, **BASE)
    _assert_parity(cfg, _arrays(cfg, 5, phi_radius=3.1))


@pytest.mark.parametrize(
    "kw",
    [
        dict(lambda_belief=0.0),  # prior term alone: launches cover term 1 only
        dict(lambda_prior=0.0),
        dict(lambda_belief=0.0, lambda_prior=0.0),
        dict(lambda_self=0.0),
        dict(jitter=0.05),
    ],
    ids=["prior_only", "belief_only", "no_alignment", "no_self", "jitter"],
)
def test_terms_switched(kw):
    cfg = vfesim.ModelConfig(K=3, **(BASE | kw))
    _assert_parity(cfg, _arrays(cfg, 6))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_observation_term(dtype):
    cfg = make_obs_config(K=3, obs_dim=2, lambda_prior=0.5, lambda_obs=0.7)
    _assert_parity(cfg, _arrays(cfg, 5, dtype))


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_populations(n):
    # N = 1: no neighbours, alignment energies are 0.
    cfg = vfesim.ModelConfig(K=3, **BASE)
    t, _ = _assert_parity(cfg, _arrays(cfg, n))
    if n == 1:
        assert t["belief_align"] == 0.0 and t["prior_align"] == 0.0


def test_directional_finite_difference():
    """<grad, d> against a central difference of the simulated energy along a random direction."""
    cfg = vfesim.ModelConfig(K=3, aggregator="expected", **BASE)
    x = _arrays(cfg, 5, seed=3)
    rng = np.random.default_rng(7)
    d = {k: rng.standard_normal(v.shape) for k, v in x.items()}
    for k in ("sigma_q", "sigma_p"):
        d[k] = 0.5 * (d[k] + np.swapaxes(d[k], -1, -2))
    _, g = cb.energy_and_gradient(x, cfg)
    eps = 1e-5
    e = [cb.energy_and_gradient({k: x[k] + s * eps * d[k] for k in x}, cfg)[0]["total"] for s in (1, -1)]
    fd = (e[0] - e[1]) / (2 * eps)
    an = sum(float((g[k] * d[k]).sum()) for k in x)
    assert abs(fd - an) <= FD_RTOL * abs(an)


def test_deterministic_and_buffers_reused():
    cfg = vfesim.ModelConfig(K=3, **BASE)
    a = _arrays(cfg, 7, seed=1)
    b = _arrays(cfg, 7, seed=2)
    t1, g1 = cb.energy_and_gradient(a, cfg)
    _assert_parity(cfg, b)  # same workspace, other data: no stale buffers
    t2, g2 = cb.energy_and_gradient(a, cfg)
    assert t1 == t2
    for k in g1:
        assert np.array_equal(g1[k], g2[k]), k
    # Returned gradients are copies, not views of the reused buffers.
    g1["mu_q"][...] = np.nan
    _, g3 = cb.energy_and_gradient(a, cfg)
    assert np.array_equal(g3["mu_q"], g2["mu_q"])


def test_rejects_bad_arrays():
    cfg = vfesim.ModelConfig(K=3)
    a = _arrays(cfg, 4)
    with pytest.raises(TypeError, match="sigma_q"):
        cb.energy_and_gradient(a | {"sigma_q": a["sigma_q"].astype(np.float32)}, cfg)
    with pytest.raises(ValueError, match="K=3"):
        cb.energy_and_gradient(_arrays(vfesim.ModelConfig(K=5), 4), cfg)


def test_to_device_and_back_are_numpy_under_simulator():
    a = {"x": np.arange(3.0)}
    assert cb.to_host(cb.to_device(a))["x"] is not None
    assert isinstance(cb.to_device(a)["x"], np.ndarray)


# Every pair of values of (neighbours, aggregator, dtype) meets in one of these four cases (a covering
# array: half the full product, each case a slow simulator run).
LARGE_K_CASES = [
    ("dense", "expected", "float64"),
    ("dense", "softmin", "float32"),
    ("sparse", "expected", "float32"),
    ("sparse", "softmin", "float64"),
]


@pytest.mark.parametrize("mode", ["block", "batched"])
@pytest.mark.parametrize("neighbours, aggregator, dtype", LARGE_K_CASES)
def test_large_k_path(monkeypatch, mode, neighbours, aggregator, dtype):
    """The K >= LARGE_K paths, forced at small K: block-per-agent kernels (8 threads for 9 elements:
    strided element loops) or, where their shared matrices do not fit, batched array code; GEMM pairs."""
    sparse = neighbours == "sparse"
    monkeypatch.setattr(cb, "LARGE_K", 3)
    monkeypatch.setattr(gemm, "GEMM_BLOCK_BYTES", 24 * 8)  # several receiver blocks at N = 9
    if mode == "batched":
        monkeypatch.setattr(kc.gaussian, "BLOCK_SHARED_BYTES", 0)
    assert cb._mode(3, np.dtype(dtype)) == mode
    nbrs = vfesim.SparseNeighbours.from_lists([[1, 2], [], [0, 4], [0, 1, 4], [3], [0, 2, 3], [5], [8], [6]])
    cfg = vfesim.ModelConfig(
        K=3, aggregator=aggregator, neighbours=nbrs if sparse else "dense", jitter=0.01, **BASE
    )
    _assert_parity(cfg, _arrays(cfg, 9, dtype, phi_radius=3.0))


@pytest.mark.parametrize("mode", ["block", "batched"])
def test_large_k_path_observation(monkeypatch, mode):
    monkeypatch.setattr(cb, "LARGE_K", 3)
    if mode == "batched":
        monkeypatch.setattr(kc.gaussian, "BLOCK_SHARED_BYTES", 0)
    cfg = make_obs_config(K=3, obs_dim=2, lambda_prior=0.5, lambda_obs=0.7)
    _assert_parity(cfg, _arrays(cfg, 5))


@pytest.mark.parametrize(
    "kw",
    [
        dict(K=5, phi_radius=3.1),  # several squarings; 25 elements over 8 threads
        dict(irreps=[0, 1], jitter=0.05),  # block-diagonal generators, even K
        dict(lambda_belief=0.0),  # prior term alone (f0 = 1)
        dict(lambda_prior=0.0, lambda_self=0.0),
    ],
    ids=["K5", "irreps01_jitter", "prior_only", "belief_only_no_self"],
)
def test_block_kernels_terms_and_shapes(monkeypatch, kw):
    """Block-per-agent kernels with the term switches and other shapes (dense GEMM pairs)."""
    monkeypatch.setattr(cb, "LARGE_K", 3)
    kw = BASE | kw
    radius = kw.pop("phi_radius", None)
    cfg = vfesim.ModelConfig(**(kw if "irreps" in kw or "K" in kw else {"K": 3} | kw))
    assert cb._mode(cfg.K, np.dtype("float64")) == "block"
    _assert_parity(cfg, _arrays(cfg, 5, **({"phi_radius": radius} if radius else {})))


def test_block_kernels_deterministic(monkeypatch):
    monkeypatch.setattr(cb, "LARGE_K", 3)
    cfg = vfesim.ModelConfig(K=3, **BASE)
    a = _arrays(cfg, 6, seed=5)
    t1, g1 = cb.energy_and_gradient(a, cfg)
    t2, g2 = cb.energy_and_gradient(a, cfg)
    assert t1 == t2
    for k in g1:
        assert np.array_equal(g1[k], g2[k]), k


@pytest.mark.parametrize("K, blocks", [(3, None), (10, None), (10, 3)])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_state_check_kernel_classifies_like_numpy(monkeypatch, dtype, K, blocks):
    """The device state check (kernels/cuda/checks.py; a thread per agent at K = 3, a block per agent at
    K = 10, also with blocks striding over several agents) gives each matrix the verdict of the
    host checks, a condition-number upper bound, and the state's peaks, first failing agents and largest
    bounds."""
    from vfesim_kernels.cuda import checks

    if blocks:
        monkeypatch.setattr(checks, "CHECK_BLOCKS", blocks)

    n = 8
    rng = np.random.default_rng(0)
    L = rng.standard_normal((2, n, K, K))
    S = (L @ L.transpose(0, 1, 3, 2) + 0.1 * np.eye(K)).astype(dtype)
    S1, S2 = S[0].copy(), S[1].copy()
    S1[1, 0, 2] = np.nan  # non-finite
    S1[2, 0, 1] += 1e-2  # not symmetric
    S1[3] = np.diag(np.r_[1.0, -1e-3, np.full(K - 2, 2.0)])  # indefinite
    S1[4] = np.diag(np.r_[1.0, 0.0, np.full(K - 2, 2.0)])  # singular: the Cholesky pivot is 0
    S1[5, 1, 0] = S1[5, 0, 1] = 0.0  # a symmetric edit: stays SPD or not, whatever NumPy says
    tol = 64 * np.finfo(dtype).eps
    S1[6, K - 1, K - 2] = S1[6, K - 2, K - 1] = 50.0  # symmetric, indefinite only at the last pivot
    S2[5] = -S2[5]
    V = [rng.standard_normal((n, m)).astype(dtype) for m in (K, 3, 1)]
    V[1][6, 2] = np.inf
    V[2][3, 0] = -7.5
    V.append(np.empty((n, 0), dtype))  # an absent variable
    code = np.full((2, n), -1, np.int32)
    bound = np.full((2, n), -1.0)
    out = checks.out_initial()
    blockwise, blocks, threads = checks.check_launch(n, K)
    assert blockwise == (K >= checks.WARP_FROM_K)
    kernel = checks.make_check_kernels(K, dtype, blockwise)["state"]
    kernel[blocks, threads](*V, S1, S2, S1.dtype.type(tol), code, bound, out)

    def verdict(Si):
        if not np.isfinite(Si).all():
            return checks.SPD_NONFINITE
        if np.abs(Si - Si.T).max() > tol * np.abs(Si).max():
            return checks.SPD_ASYMMETRIC
        try:
            np.linalg.cholesky(Si)
            return checks.SPD_OK
        except np.linalg.LinAlgError:
            return checks.SPD_INDEFINITE

    assert code.tolist() == [[verdict(Si) for Si in Sc] for Sc in (S1, S2)]
    assert code[0, [1, 2, 3, 4, 6]].tolist() == [1, 2, 3, 3, 3] and code[1, 5] == 3
    worst = [0.0, 0.0]
    for c, Sc in enumerate((S1, S2)):
        for i in range(n):
            if code[c, i] != checks.SPD_OK:
                assert bound[c, i] == np.inf
                continue
            w = np.linalg.eigvalsh(Sc[i].astype(np.float64))  # an upper bound, at most ~K^1.5 too large
            assert w[-1] / w[0] * (1 - 1e-4) <= bound[c, i] <= 2 * K**1.5 * w[-1] / w[0]
            worst[c] = max(worst[c], bound[c, i])
    peaks = [np.inf, np.inf, 7.5, 0.0, np.inf, float(np.abs(S2).max())]
    assert out[checks.PEAKS : checks.PEAKS + 6].tolist()[1:] == peaks[1:]
    assert out[checks.PEAKS] == float(np.abs(V[0]).max())
    assert out[checks.FIRSTS : checks.WORSTS].tolist() == [1.0, 5.0]
    assert out[checks.WORSTS :].tolist() == worst


@pytest.mark.parametrize("scale", [1e-170, 1e-300, 1e150, 1e300])
@pytest.mark.parametrize("K", [3, 10])
def test_state_check_kernel_bound_does_not_depend_on_the_scale(K, scale):
    """The device bound at float64 scales whose squares underflow (entries below ~1e-154) or overflow
    (above ~1e154) equals the bound at scale 1 to rounding: it is never 0 (which would let an ill-conditioned
    matrix pass unchecked), and finite where the matrix is."""
    from vfesim_kernels.cuda import checks

    n = 4
    rng = np.random.default_rng(2)
    L = rng.standard_normal((n, K, K))
    S = L @ L.transpose(0, 2, 1) + 1e-3 * np.eye(K)
    S[n - 1] = np.diag(np.geomspace(1.0, 1e-9, K))  # cond 1e9: must be flagged at every scale

    def bounds(S):
        blockwise, grid, threads = checks.check_launch(n, K)
        kernel = checks.make_check_kernels(K, "float64", blockwise)["state"]
        V = [np.empty((n, 0))] * 4
        code, bound, out = np.full((2, n), -1, np.int32), np.full((2, n), -1.0), checks.out_initial()
        kernel[grid, threads](*V, S, S, 64 * np.finfo(np.float64).eps, code, bound, out)
        assert code.tolist() == [[checks.SPD_OK] * n] * 2
        return bound[0]

    unit, scaled = bounds(S), bounds(S * scale)
    cond = [np.linalg.cond(Si) for Si in S]
    assert np.all(unit >= np.multiply(cond, 1 - 1e-6)) and np.all(unit <= 2 * K**1.5 * np.array(cond))
    np.testing.assert_allclose(scaled, unit, rtol=1e-10)


@pytest.mark.parametrize("n, K, blocks", [(1, 3, None), (9, 3, None), (1, 9, None), (9, 9, 2)])
def test_state_check_kernel_partial_blocks_and_second_matrix(monkeypatch, n, K, blocks):
    """Agents that do not fill the last block (a thread per agent), one agent, blocks striding over an
    uneven share (a warp per agent): a fault only in the second batch (an all-NaN matrix, an indefinite
    one) is found there, the first batch's verdicts stay clean, and the peaks are the arrays'."""
    from vfesim_kernels.cuda import checks

    if blocks:
        monkeypatch.setattr(checks, "CHECK_BLOCKS", blocks)
    rng = np.random.default_rng(1)
    L = rng.standard_normal((2, n, K, K))
    S1, S2 = L @ L.transpose(0, 1, 3, 2) + 0.1 * np.eye(K)
    S2[n - 1] = np.nan
    if n > 1:
        S2[n // 2] = -S2[n // 2]
    V = [rng.standard_normal((n, K)), np.empty((n, 0)), rng.standard_normal((n, 3)), np.empty((n, 0))]
    V[2][n - 1, 1] = 40.0
    code, bound, out = np.full((2, n), -1, np.int32), np.full((2, n), -1.0), checks.out_initial()
    blockwise, grid, threads = checks.check_launch(n, K)
    kernel = checks.make_check_kernels(K, "float64", blockwise)["state"]
    kernel[grid, threads](*V, S1, S2, 64 * np.finfo(np.float64).eps, code, bound, out)
    expect = [checks.SPD_OK] * n
    expect[n - 1] = checks.SPD_NONFINITE
    if n > 1:
        expect[n // 2] = checks.SPD_INDEFINITE
    assert code[0].tolist() == [checks.SPD_OK] * n and code[1].tolist() == expect
    first = n // 2 if n > 1 else n - 1
    assert out[checks.FIRSTS : checks.WORSTS].tolist() == [np.inf, float(first)]
    assert out[checks.WORSTS] == bound[0].max() and np.all(np.isfinite(bound[0]))
    assert out[checks.WORSTS + 1] == max((b for b in bound[1] if np.isfinite(b)), default=0.0)
    peaks = [np.abs(V[0]).max(), 0.0, 40.0, 0.0, np.abs(S1).max(), np.inf]
    assert out[checks.PEAKS : checks.PEAKS + 6].tolist() == peaks


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_dense_rows_sum_to_all_pairs(aggregator):
    """pairwise_dense_rows (a receiver range against every sender, the unit of a scheduler task) over a
    partition of the receivers adds up to the all-pairs reference; each range's rows equal its rows."""
    from vfesim.pairwise.reference import pairwise_dense

    rng = np.random.default_rng(4)
    N, D, kappa = 13, 5, 0.7
    A, B = rng.normal(size=(N, D)), rng.normal(size=(N, D))
    c = rng.uniform(1.0, 2.0, N)
    E, gA, gB, gc = pairwise_dense(A, B, c, kappa, aggregator)
    gB_sum = np.zeros_like(gB)
    E_sum = 0.0
    for r0, r1 in [(0, 4), (4, 5), (5, 13)]:
        erow, gA_r, gc_r, gB_part = cb.pairwise_dense_rows(A[r0:r1], c[r0:r1], B, r0, kappa, aggregator)
        np.testing.assert_allclose(gA_r, gA[r0:r1], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(gc_r, gc[r0:r1], rtol=1e-12, atol=1e-14)
        gB_sum += gB_part
        E_sum += float(erow.sum())
    np.testing.assert_allclose(gB_sum, gB, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(E_sum, E, rtol=1e-12)
    with pytest.raises(ValueError, match="r0=10"):
        cb.pairwise_dense_rows(A[:5], c[:5], B, 10, kappa, aggregator)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_dense_two_passes_sum_to_all_pairs(aggregator, dtype):
    """pairwise_dense_receivers over receiver ranges (energies, gA, gc, row statistics) and
    pairwise_dense_senders over other sender ranges (gB from every receiver's statistics, the grads
    kernel with receiver offset -s0) equal the all-pairs reference; one-agent ranges at both ends test
    the excluded diagonal. The grads launch splits the 40 receivers in two slices (simulator sizes).
    float64 runs the tensor-core kernels, float32 the SIMT kernels (negative receiver offsets included)."""
    from vfesim.pairwise.reference import pairwise_dense

    rng = np.random.default_rng(5)
    N, D, kappa = 40, 5, 0.7
    A, B = rng.normal(size=(N, D)), rng.normal(size=(N, D))
    c = rng.uniform(1.0, 2.0, N)
    E, gA, gB, gc = pairwise_dense(A, B, c, kappa, aggregator)
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == "float64" else dict(rtol=2e-5, atol=2e-6)
    A, B, c = (x.astype(dtype) for x in (A, B, c))
    p1 = [
        cb.pairwise_dense_receivers(A[a:b], c[a:b], B, a, kappa, aggregator) for a, b in [(0, 13), (13, 40)]
    ]
    np.testing.assert_allclose(sum(float(p[0].sum()) for p in p1), E, rtol=tol["rtol"])
    for k, want in [(1, gA), (2, gc)]:
        np.testing.assert_allclose(np.concatenate([p[k] for p in p1]), want, **tol)
    m, inv_s, abar = (np.concatenate([p[k] for p in p1]) for k in (3, 4, 5))
    spans = [(0, 1), (1, 22), (22, 39), (39, 40)]
    parts = [cb.pairwise_dense_senders(A, c, m, inv_s, abar, B[a:b], a, kappa, aggregator) for a, b in spans]
    assert all(p.dtype == np.float64 for p in parts)
    np.testing.assert_allclose(np.concatenate(parts), gB, **tol)
    with pytest.raises(ValueError, match="s0=30"):
        cb.pairwise_dense_senders(A, c, m, inv_s, abar, B[:20], 30, kappa, aggregator)
    with pytest.raises(ValueError, match="r0=30"):
        cb.pairwise_dense_receivers(A[:20], c[:20], B, 30, kappa, aggregator)


@pytest.mark.parametrize("N", [16, 37])
@pytest.mark.parametrize("order", ["rising", "falling", "random"])
@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_receiver_sums_follow_a_moving_maximum(aggregator, order, N):
    """The receiver pass sums sender rows weighted relative to a running maximum, rescaled when it moves.
    Logits spread over ~400 (weights from 1 down to e^-400, none overflowing) and senders in an order that
    moves every receiver's maximum at each sender ("rising"), never ("falling") or at random, over
    one (N = 16) or two sender slices and three owner blocks (N = 37, the float64 tensor-core kernels' layout
    here): equal to the all-pairs reference (float64)."""
    from vfesim.pairwise.reference import pairwise_dense

    rng = np.random.default_rng(7)
    D, kappa = 4, 0.5
    A = rng.normal(size=(N, D))
    A[:, 0] = 1.0  # KL_ij / kappa = (A_i . B_j + c_i) / (2 kappa): B_j[0] sets a sender's logit for everyone
    B = 0.1 * rng.normal(size=(N, D))
    rank = {"rising": np.arange(N)[::-1], "falling": np.arange(N), "random": rng.permutation(N)}[order]
    B[:, 0] = 400.0 * rank / N  # small B[0] = large logit: "rising" meets ever larger logits
    c = rng.uniform(1.0, 2.0, N)
    nt, per_block = kc.dense_layout(D, "float64")
    assert kc.dense_splits(N, N, 0, per_block, nt)[0] == (1 if N == 16 else 2)
    E, gA, gB, gc = pairwise_dense(A, B, c, kappa, aggregator)
    erow, gA_r, gc_r, gB_c = cb.pairwise_dense_rows(A, c, B, 0, kappa, aggregator)
    for got, want in [(gA_r, gA), (gc_r, gc), (gB_c, gB)]:
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13 * np.abs(want).max())
    np.testing.assert_allclose(float(erow.sum()), E, rtol=1e-12)


def test_dense_kernels_take_register_caps(monkeypatch, request):
    """The dense kernels' register caps: the tuned table by default (cached on disk), or a variant's own
    (a sweep's); the same pairs either way."""
    monkeypatch.setitem(kc.DENSE_REGISTERS, ("float32", 10), (96, 128))
    kc.make_dense_kernels.cache_clear()  # kernels made under the patched table go with it (below)
    request.addfinalizer(kc.make_dense_kernels.cache_clear)
    default = kc.make_dense_kernels(10, "float32", "softmin")
    assert default["registers"] == (96, 128) == kc.dense_registers(10, np.float32)
    assert kc.dense_registers(10, "float64") == kc.DENSE_REGISTERS.get(("float64", 10), (None, None))
    variant = kc.make_dense_kernels(10, "float32", "softmin", registers=(80, 80))
    assert variant["registers"] == (80, 80) and variant["stats"] is not default["stats"]
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((2, 40, 10)).astype(np.float32)
    c = rng.standard_normal(40).astype(np.float32)
    want = cb.BACKEND.pairwise_dense(A, B, c, 0.7, "softmin")
    monkeypatch.setattr(
        kc, "make_dense_kernels", lambda *a, make=kc.make_dense_kernels: make(*a, registers=(80, 80))
    )
    got = cb.BACKEND.pairwise_dense(A, B, c, 0.7, "softmin")
    assert got[0] == want[0]
    for x, y in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(x, y)
