"""The "numba" backend (kernels/pairwise_cpu.py) against the numpy reference (SPEC §2.4, §4).

Energies and every gradient agree to the dtype table of conftest (1e-10 float64, 1e-4 float32), the
results are bitwise reproducible, and N = 16384 runs under an address-space cap that one N x N float64
array would break.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
from conftest import tol
from vfesim_kernels import pairwise_cpu

import vfesim
from vfesim import pairwise as np_pairwise

VARS = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")

NEIGHBOURS = {
    "dense": lambda n: "dense",
    "ring": lambda n: vfesim.SparseNeighbours.ring(n, 2),
    # ragged lists with empty rows (every third agent receives nothing)
    "ragged": lambda n: vfesim.SparseNeighbours.from_lists(
        [[(i + 3) % n, (i + 5) % n, (i + 1) % n][: i % 3 + (i % 3 > 0)] for i in range(n)]
    ),
}


def _scaled_tol(dtype, ref):
    """The dtype table's rtol, with atol relative to the array's scale (gradients cross zero)."""
    t = tol(dtype)
    return {"rtol": t["rtol"], "atol": t["rtol"] * float(np.max(np.abs(ref), initial=0.0))}


def _compare(state, cfg):
    t_np, g_np = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    t_nb, g_nb = vfesim.energy_and_gradient(state, cfg, backend="numba")
    dt = state.mu_q.dtype
    for k, v in t_np.items():
        np.testing.assert_allclose(t_nb[k], v, rtol=tol(dt)["rtol"], atol=tol(dt)["atol"], err_msg=k)
    for k in VARS:
        assert g_nb[k].dtype == dt, k
        ref = g_np[k].values
        np.testing.assert_allclose(g_nb[k].values, ref, **_scaled_tol(dt, ref), err_msg=k)
    return t_nb, g_nb


@pytest.mark.parametrize("neighbours", list(NEIGHBOURS))
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("irreps", [(1,), (2,), (0, 1, 2)])
def test_backend_matches_numpy(irreps, aggregator, neighbours, dtype):
    n = 37  # not a multiple of the receiver tile
    cfg = vfesim.ModelConfig(
        irreps=irreps,
        lambda_prior=0.4,
        kappa_beta=0.6,
        kappa_gamma=1.7,
        aggregator=aggregator,
        neighbours=NEIGHBOURS[neighbours](n),
    )
    st = vfesim.random_state(cfg, n, seed=3, dtype=dtype, mu_scale=1.5, phi_radius=2.5)
    _compare(st, cfg)


@pytest.mark.parametrize("with_obs", [False, True])
def test_backend_matches_numpy_large_k(with_obs, dtype):
    """K = 21 (the BLAS pairwise path, BLAS products in the agent kernels), jitter, and the self term
    computed by agent_cpu.self_kl next to the shared observation term."""
    n, K = 45, 21
    kw = {}
    if with_obs:
        rng = np.random.default_rng(0)
        kw = {"lambda_obs": 0.7, "W": rng.standard_normal((2, K)), "R": np.diag([1.5, 0.7])}
    cfg = vfesim.ModelConfig(K=K, lambda_self=0.8, lambda_prior=0.4, jitter=1e-3, **kw)
    st = vfesim.random_state(cfg, n, seed=2, dtype=dtype, mu_scale=1.5, phi_radius=3.0)
    terms, _ = _compare(st, cfg)
    assert terms["self"] > 0 and terms["belief_align"] > 0 and (terms["observation"] > 0) == with_obs


@pytest.mark.parametrize("n", [1, 2])
def test_one_and_two_agents(n, dtype):
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5)
    st = vfesim.random_state(cfg, n, seed=1, dtype=dtype)
    terms, grads = _compare(st, cfg)
    if n == 1:
        assert terms["belief_align"] == 0.0 and terms["prior_align"] == 0.0


def _features(rng, n, D, dtype, spread=3.0):
    """Random features whose KLs spread over several kappa (a non-trivial softmax)."""
    A = rng.standard_normal((n, D)) * 0.4
    B = rng.standard_normal((n, D)) * 0.4
    c = rng.standard_normal(n) * spread
    return A.astype(dtype), B.astype(dtype), c.astype(dtype)


# 300 receivers span 10 receiver tiles and two sender tiles (the second one partial); N^2 D decides
# between the serial (300, 10) and the threaded kernels (300, 253) and (600, 10).
# D >= DOT_MIN_D takes the BLAS slab path: (70, 253) runs on one thread in slabs of 14 receivers,
# (300, 253) in one threaded slab; (300, 32) is the first D on that path.
@pytest.mark.parametrize("n, D", [(300, 10), (300, 253), (600, 10), (70, 253), (300, 32)])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_pairwise_dense_matches_numpy(n, D, aggregator, dtype, rng):
    A, B, c = _features(rng, n, D, dtype)
    ref = np_pairwise.pairwise_dense(A, B, c, 0.8, aggregator)
    out = pairwise_cpu.pairwise_dense(A, B, c, 0.8, aggregator)
    assert isinstance(out[0], float)
    np.testing.assert_allclose(out[0], ref[0], rtol=tol(dtype)["rtol"])
    for a, b in zip(out[1:], ref[1:], strict=True):
        assert a.dtype == np.dtype(dtype) and a.shape == b.shape
        np.testing.assert_allclose(a, b, **_scaled_tol(dtype, b))


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_pairwise_sparse_matches_numpy(aggregator, dtype, rng):
    n, k = 200, 9
    index = np.stack([rng.choice(np.delete(np.arange(n), i), k, replace=False) for i in range(n)])
    mask = rng.random((n, k)) < 0.7
    mask[::5] = False  # receivers without neighbours
    A, B, c = _features(rng, n, 21, dtype)
    ref = np_pairwise.pairwise_sparse(A, B, c, index, mask, 0.8, aggregator)
    out = pairwise_cpu.pairwise_sparse(A, B, c, index, mask, 0.8, aggregator)
    np.testing.assert_allclose(out[0], ref[0], rtol=tol(dtype)["rtol"])
    for a, b in zip(out[1:], ref[1:], strict=True):
        np.testing.assert_allclose(a, b, **_scaled_tol(dtype, b))
    assert not np.any(out[1][::5]) and not np.any(out[3][::5])


def test_serial_and_threaded_builds_agree(rng, monkeypatch):
    """Small problems run a serial build; it matches the threaded one to rounding and is reproducible."""
    A, B, c = _features(rng, 300, 10, "float64")
    serial = pairwise_cpu.pairwise_dense(A, B, c, 0.8, "expected")
    monkeypatch.setattr(pairwise_cpu, "SERIAL_WORK", 0)
    threaded = pairwise_cpu.pairwise_dense(A, B, c, 0.8, "expected")
    again = pairwise_cpu.pairwise_dense(A, B, c, 0.8, "expected")
    np.testing.assert_allclose(serial[0], threaded[0], rtol=1e-14)
    assert threaded[0] == again[0]
    for a, b, b2 in zip(serial[1:], threaded[1:], again[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13 * np.abs(b).max())
        np.testing.assert_array_equal(b, b2)


@pytest.mark.parametrize("K", [3, 21])
@pytest.mark.parametrize("neighbours", ["dense", "ring"])
def test_bitwise_deterministic(neighbours, K):
    n = 700
    cfg = vfesim.ModelConfig(K=K, lambda_prior=0.5, neighbours=NEIGHBOURS[neighbours](n))
    st = vfesim.random_state(cfg, n, seed=5)
    t1, g1 = vfesim.energy_and_gradient(st, cfg, backend="numba")
    t2, g2 = vfesim.energy_and_gradient(st, cfg, backend="numba")
    assert t1 == t2
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        t3, g3 = vfesim.energy_and_gradient(st, cfg, backend="numba")
    finally:
        numba.set_num_threads(threads)
    assert t1 == t3
    for k in VARS:
        np.testing.assert_array_equal(g1[k].values, g2[k].values)
        np.testing.assert_array_equal(g1[k].values, g3[k].values)


_MEMCAP_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    import vfesim

    N = int(sys.argv[1])
    cfg = vfesim.ModelConfig(K=3)
    vfesim.energy_and_gradient(vfesim.random_state(cfg, 64, seed=0), cfg, backend="numba")  # JIT, threads
    state = vfesim.random_state(cfg, N, seed=0)

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    cap = vm_bytes() + (512 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        np.ones((N, N))  # 2 GiB: must not fit, or the cap proves nothing
        print("NXN-FITS")
    except MemoryError:
        print("NXN-REFUSED")
    terms, grads = vfesim.energy_and_gradient(state, cfg, backend="numba")
    assert np.isfinite(terms["total"]) and np.isfinite(grads.phi.values).all()
    print("OK", terms["total"])
    """
)


@pytest.mark.slow
def test_large_n_streams_under_memory_cap():
    """N = 16384, K = 3: runs with 512 MiB of address space above the warm baseline (N x N f64 = 2 GiB)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMCAP_SCRIPT, "16384"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split()
    assert "NXN-REFUSED" in lines, proc.stdout
    assert "OK" in lines, proc.stdout


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_vector_exp_matches_numpy(dtype, rng):
    """exp_row_f64 / exp_row_f32 (each in its own dtype) against np.exp, down to the clamp."""
    lo = {"float64": -708.0, "float32": -87.0}[dtype]
    x = np.concatenate([-rng.uniform(0, 750, 4000), -rng.uniform(0, 90, 4000)])
    x = np.concatenate([x, [0.0, -1e-300, lo, -745.0, 1e-3, -0.5 * np.log(2)]]).astype(dtype)
    out = np.empty_like(x)
    exp_row = pairwise_cpu.exp_row_f64 if dtype == "float64" else pairwise_cpu.exp_row_f32
    exp_row(x, x.size, out)
    assert out.dtype == x.dtype
    ref = np.exp(np.minimum(x.astype(np.float64), 0.0))
    kept = x >= lo
    # float64: degree-11 Taylor, 1e-14; float32: Cephes' expf polynomial, within 2 ulp (1 ulp <= 1.2e-7)
    rtol = {"float64": 5e-14, "float32": 2.4e-7}[dtype]
    np.testing.assert_allclose(out[kept], ref[kept], rtol=rtol)
    np.testing.assert_allclose(out[~kept], np.exp(lo), rtol=rtol)  # clamped tail: tiny, positive, normal
    # exp(x) does not depend on the element's position (vector body or scalar remainder of the loop)
    for n in (1, 3, 7, 13):
        part = np.empty(n, x.dtype)
        exp_row(x[-n:], n, part)
        np.testing.assert_array_equal(part, out[-n:])
    nan = np.array([0.0, np.nan, -1.0], dtype)
    exp_row(nan, 3, nan)
    assert np.isnan(nan[1]) and np.isfinite(nan[[0, 2]]).all()


def test_unknown_backend_is_an_error():
    cfg = vfesim.ModelConfig(K=3)
    st = vfesim.random_state(cfg, 4, seed=0)
    with pytest.raises(ValueError, match="backend: unknown 'numbaa'"):
        vfesim.energy_and_gradient(st, cfg, backend="numbaa")


def test_bad_feature_dtype_is_an_error():
    A = np.ones((3, 10), np.int64)
    with pytest.raises(TypeError, match="float32 or float64"):
        pairwise_cpu.pairwise_dense(A, A, np.ones(3, np.int64), 1.0, "expected")


_BLAS_THREADS_SCRIPT = textwrap.dedent(
    """
    import hashlib
    import numpy as np
    from vfesim_kernels import pairwise_cpu

    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((2, 600, 253)) * 0.4
    c = rng.standard_normal(600) * 3.0
    out = pairwise_cpu.pairwise_dense(A, B, c, 0.8, "expected")
    h = hashlib.sha256(np.float64(out[0]).tobytes())
    for a in out[1:]:
        h.update(a.tobytes())
    print("HASH", h.hexdigest())
    """
)


def test_blas_path_independent_of_blas_threads():
    """The BLAS slab path gives bitwise the same results with 1 or 2 OpenBLAS threads."""
    hashes = []
    for threads in ("1", "2"):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=threads)
        proc = subprocess.run(
            [sys.executable, "-c", _BLAS_THREADS_SCRIPT], capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        hashes.append(proc.stdout.split("HASH")[-1].strip())
    assert hashes[0] == hashes[1]
