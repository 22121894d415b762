"""cuda backend on a real GPU: parity with the numpy backend (SPEC §4: 1e-10 relative in float64, 1e-4 in
float32) for energies and every gradient, both aggregators, dense and sparse, several tiles and slices;
bitwise determinism; the public API with backend="cuda". Skipped without a CUDA GPU."""

import os

import numpy as np
import pytest
from conftest import TOL

import vfesim
from vfesim.backends import cuda_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not cuda_available(), reason="needs a CUDA GPU"
    ),
]


def _arrays(cfg, n, dtype, seed=0):
    st = vfesim.random_state(cfg, n_agents=n, seed=seed, dtype=dtype)
    return {k: st[k].values.copy() for k in st.data_vars}


def _parity(cfg, arrays):
    """GPU result against the numpy backend in float64 on the same (up-cast) inputs."""
    from vfesim.backends import cuda_backend as cb
    from vfesim.backends import numpy_backend as nb

    dt = arrays["mu_q"].dtype
    t_c, g_c = cb.energy_and_gradient(cb.to_device(arrays), cfg)
    g_c = cb.to_host(g_c)
    t_n, g_n = nb.energy_and_gradient({k: v.astype(np.float64) for k, v in arrays.items()}, cfg)
    rtol = TOL[dt.name]["rtol"]
    for k in t_n:
        np.testing.assert_allclose(t_c[k], t_n[k], rtol=rtol, atol=rtol * abs(t_n["total"]), err_msg=k)
    for k in g_n:
        assert g_c[k].dtype == dt and g_c[k].shape == arrays[k].shape, k
        np.testing.assert_allclose(
            g_c[k], g_n[k], rtol=rtol, atol=rtol * float(np.abs(g_n[k]).max()), err_msg=k
        )
    return t_c, g_c


BASE = dict(lambda_prior=0.6, kappa_beta=0.7, kappa_gamma=1.3)


@pytest.mark.parametrize("n", [300, 1500])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_dense_parity(n, aggregator, dtype):
    cfg = vfesim.ModelConfig(K=3, aggregator=aggregator, **BASE)
    _parity(cfg, _arrays(cfg, n, dtype))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "kw", [dict(K=21), dict(irreps=[0, 1, 2]), dict(K=5, jitter=0.1)], ids=["K21", "irr012", "K5j"]
)
def test_other_shapes(dtype, kw):
    cfg = vfesim.ModelConfig(**kw, **BASE)
    _parity(cfg, _arrays(cfg, 200, dtype))


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sparse_parity(aggregator, dtype):
    rng = np.random.default_rng(5)
    n = 700
    lists = [
        sorted(set(rng.choice(n, size=rng.integers(0, 12), replace=False).tolist()) - {i}) for i in range(n)
    ]
    nbrs = vfesim.SparseNeighbours.from_lists(lists)
    cfg = vfesim.ModelConfig(K=3, aggregator=aggregator, neighbours=nbrs, **BASE)
    _parity(cfg, _arrays(cfg, n, dtype))


def test_observation_term():
    from conftest import make_obs_config

    cfg = make_obs_config(K=3, obs_dim=2, lambda_prior=0.5, lambda_obs=0.7)
    _parity(cfg, _arrays(cfg, 400, "float64"))


def test_bitwise_deterministic():
    from vfesim.backends import cuda_backend as cb

    cfg = vfesim.ModelConfig(K=3, **BASE)
    x = cb.to_device(_arrays(cfg, 3000, "float32", seed=4))
    t1, g1 = cb.energy_and_gradient(x, cfg)
    t2, g2 = cb.energy_and_gradient(x, cfg)
    assert t1 == t2
    for k in g1:
        assert bool((g1[k] == g2[k]).all()), k


def test_public_api_backend_cuda():
    cfg = vfesim.ModelConfig(K=3, **BASE)
    st = vfesim.random_state(cfg, n_agents=257, seed=2)
    t_c, g_c = vfesim.energy_and_gradient(st, cfg, backend="cuda")
    t_n, g_n = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    np.testing.assert_allclose(t_c["total"], t_n["total"], **TOL["float64"])
    for k in g_n.data_vars:
        assert isinstance(g_c[k].data, np.ndarray)
        np.testing.assert_allclose(
            g_c[k].values, g_n[k].values, rtol=1e-10, atol=1e-10 * float(abs(g_n[k]).max())
        )


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy-state", "cupy-state"])
@pytest.mark.parametrize("K", [3, 21])
def test_public_api_validates_on_the_device(on_device, K):
    """backend="cuda" checks a state where it will be used; each fault names the variable and agent as
    the host checks do."""
    import cupy

    cfg = vfesim.ModelConfig(K=K, **BASE)
    st = vfesim.random_state(cfg, n_agents=300, seed=4, dtype="float32")
    faults = {
        "nan": ("mu_p", 17, "contains NaN or Inf"),
        "asym": ("sigma_q", 41, "is not symmetric"),
        "indefinite": ("sigma_p", 299, "is not positive definite"),
    }
    for fault, (var, agent, msg) in faults.items():
        bad = st.copy(deep=True)
        a = bad[var].values
        if fault == "nan":
            a[agent, 1] = np.nan
        elif fault == "asym":
            a[agent, 0, 1] += 0.5
        else:
            a[agent] = -a[agent]
        if on_device:
            bad = bad.copy(data={k: cupy.asarray(bad[k].values) for k in bad.data_vars})
        with pytest.raises(vfesim.StateError, match=rf"{var}\[agent={agent}\]: {msg}"):
            vfesim.energy_and_gradient(bad, cfg, backend="cuda")
        with pytest.raises(vfesim.StateError, match=rf"{var}\[agent={agent}\]: {msg}"):
            vfesim.energy_and_gradient(bad.as_numpy(), cfg, backend="numpy")


# ------------------------------------------------------------------------------------------------
# Large K: block-per-agent kernels with GEMM pairs (and the batched fallback)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("K", [9, 21])
def test_block_kernels_parity(K, dtype, aggregator):
    from vfesim.backends import cuda_backend as cb

    cfg = vfesim.ModelConfig(K=K, aggregator=aggregator, jitter=0.01, **BASE)
    assert cb._mode(K, np.dtype(dtype)) == "block"
    _parity(cfg, _arrays(cfg, 333, dtype, seed=K))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_block_kernels_row_blocks_and_sparse(monkeypatch, dtype):
    from vfesim.pairwise import gemm

    monkeypatch.setattr(gemm, "GEMM_BLOCK_BYTES", 500 * 97 * 8)  # 3-6 receiver blocks at N = 500
    cfg = vfesim.ModelConfig(K=21, **BASE)
    _parity(cfg, _arrays(cfg, 500, dtype, seed=1))
    rng = np.random.default_rng(2)
    lists = [sorted(set(rng.choice(400, size=9, replace=False).tolist()) - {i}) for i in range(400)]
    cfg = vfesim.ModelConfig(K=21, neighbours=vfesim.SparseNeighbours.from_lists(lists), **BASE)
    _parity(cfg, _arrays(cfg, 400, dtype, seed=3))


def test_batched_fallback_parity(monkeypatch):
    from vfesim_kernels import cuda as kc

    from vfesim.backends import cuda_backend as cb

    monkeypatch.setattr(kc.gaussian, "BLOCK_SHARED_BYTES", 0)
    cfg = vfesim.ModelConfig(K=21, **BASE)
    assert cb._mode(21, np.dtype("float64")) == "batched"
    _parity(cfg, _arrays(cfg, 300, "float64"))


def test_block_kernels_bitwise_deterministic():
    from vfesim.backends import cuda_backend as cb

    cfg = vfesim.ModelConfig(K=21, **BASE)
    x = cb.to_device(_arrays(cfg, 1500, "float32", seed=6))
    t1, g1 = cb.energy_and_gradient(x, cfg)
    t2, g2 = cb.energy_and_gradient(x, cfg)
    assert t1 == t2
    for k in g1:
        assert bool((g1[k] == g2[k]).all()), k


# --- integrators and runs on the device -----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "method, opts",
    [("gradient_flow", {}), ("gradient_flow", {"rule": "adam"}), ("verlet", {"friction": 0.3})],
    ids=["natural", "adam", "verlet"],
)
def test_run_dynamics_parity(method, opts, dtype):
    cfg = vfesim.ModelConfig(K=3, **BASE)
    st = vfesim.random_state(cfg, n_agents=500, seed=3, dtype=dtype)
    runs = {
        b: vfesim.run_dynamics(st, cfg, method, 0.01, 5, backend=b, seed=2, **opts) for b in ("numpy", "cuda")
    }
    (s_n, h_n), (s_c, h_c) = runs["numpy"], runs["cuda"]
    rtol = TOL[dtype]["rtol"]
    for k in s_n.data_vars:
        assert isinstance(s_c[k].data, np.ndarray) and s_c[k].dtype == s_n[k].dtype, k
        b = s_n[k].values
        np.testing.assert_allclose(s_c[k].values, b, rtol=rtol, atol=rtol * float(np.abs(b).max()), err_msg=k)
    for k in h_n.data_vars:
        np.testing.assert_allclose(h_c[k].values, h_n[k].values, rtol=rtol, err_msg=k)


def test_integrator_state_stays_on_device():
    import cupy

    from vfesim.integrators import make_integrator

    cfg = vfesim.ModelConfig(K=3, **BASE)
    st = vfesim.random_state(cfg, n_agents=300, seed=1)
    for method in ("gradient_flow", "pefrl"):
        integ = make_integrator(method, cfg, 0.01, backend="cuda")
        c = integ.step(integ.step(integ.init(st)))
        assert all(isinstance(c.state[k].data, cupy.ndarray) for k in c.state.data_vars), method
        assert all(isinstance(v, cupy.ndarray) for v in c.aux.values()), method
        assert all(type(v) is float for v in c.terms.values()), method


def test_simulate_resume_bitwise_on_gpu(tmp_path):
    from vfesim.simulate import resume, simulate

    scn = {
        "model": {"K": 3, "lambda_belief": 1.0, "kappa_beta": 2.0, "lambda_self": 0.1},
        "population": {"n_agents": 400, "seed": 1},
        "integrator": {"method": "pefrl", "dt": 0.01},
        "run": {"n_steps": 8, "save_every": 2, "checkpoint_every": 4},
    }
    full = simulate(scn, out=tmp_path / "full.zarr", backend="cuda", progress=False)
    simulate(scn, out=tmp_path / "part.zarr", backend="cuda", steps=4, progress=False)
    res = resume(tmp_path / "part.zarr", steps=8, progress=False)
    a, b = full.open(), res.open()
    assert a.attrs["backend"] == "cuda" and a.sizes["time"] == 5
    for k in a.data_vars:
        np.testing.assert_array_equal(b[k].values, a[k].values, err_msg=k)
    assert res.terms == full.terms


@pytest.mark.parametrize("d", [4, 8])
@pytest.mark.parametrize("dtype", ["complex128", "complex64"])
@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_quantum_parity(aggregator, dtype, d):
    """Density-matrix agents on the GPU against numpy: at d = 4 one thread per agent and the streaming
    pairs, at d = 8 the cooperative eigensolver and the GEMM pairs."""
    cfg = vfesim.QuantumConfig(d=d, aggregator=aggregator, lambda_prior=0.5, lambda_obs=0.2)
    qs = vfesim.random_state(cfg, n_agents=300, seed=2, dtype=dtype)
    rtol = 1e-10 if dtype == "complex128" else 1e-4
    t_ref, g_ref = vfesim.energy_and_gradient(qs, cfg, backend="numpy")
    t, g = vfesim.energy_and_gradient(qs, cfg, backend="cuda")
    for k in t_ref:
        np.testing.assert_allclose(t[k], t_ref[k], rtol=rtol, atol=rtol * abs(t_ref["total"]), err_msg=k)
    for k in g_ref.data_vars:
        assert isinstance(g[k].data, np.ndarray) and g[k].dtype == g_ref[k].dtype, k
        b = g_ref[k].values
        np.testing.assert_allclose(g[k].values, b, rtol=rtol, atol=rtol * float(np.abs(b).max()), err_msg=k)


@pytest.mark.parametrize("dtype", ["complex128", "complex64"])
def test_cooperative_eigh_on_the_gpu(dtype):
    """The cooperative eigensolver (d = 8, four matrices a warp, 16 a block): right against numpy, each
    matrix's result bitwise independent of its neighbours in the batch (alone, or beside a NaN matrix
    that runs every sweep), NaN eigenvalues last."""
    import cupy

    from vfesim.backends.cuda_backend import batched_eigh

    rng = np.random.default_rng(4)
    X = rng.normal(size=(200, 8, 8)) + 1j * rng.normal(size=(200, 8, 8))
    X = (X + X.conj().swapaxes(1, 2)).astype(dtype)
    X[3] = np.diag(np.r_[2.0, 2.0, 1.0, 5.0, 2.0, 0.0, 1.0, 3.0])  # ties, already diagonal
    w, V = (a.get() for a in batched_eigh(cupy.asarray(X)))
    tol = 1e-13 if dtype == "complex128" else 5e-6
    np.testing.assert_allclose(w, np.linalg.eigvalsh(X.astype(complex)), rtol=0, atol=tol * np.abs(X).max())
    np.testing.assert_allclose(X @ V, V * w[:, None, :], rtol=0, atol=tol * np.abs(X).max())
    alone = [a.get() for a in batched_eigh(cupy.asarray(X[37:38]))]
    np.testing.assert_array_equal(alone[0][0], w[37])
    np.testing.assert_array_equal(alone[1][0], V[37])
    Y = X.copy()
    Y[36, 2, 5] = np.nan
    wy, Vy = (a.get() for a in batched_eigh(cupy.asarray(Y)))
    np.testing.assert_array_equal(np.delete(wy, 36, 0), np.delete(w, 36, 0))
    np.testing.assert_array_equal(np.delete(Vy, 36, 0), np.delete(V, 36, 0))
    nan = np.isnan(wy[36])
    assert nan.any() and not nan[: np.argmax(nan)].any()  # NaN eigenvalues after the numbers


@pytest.mark.parametrize("K", [3, 21])
def test_device_conditioning_verdicts_match_the_host(K):
    """The device check's condition-number bounds only select agents: warnings and refusals are the host's."""
    import cupy

    cfg = vfesim.ModelConfig(K=K, **BASE)
    st = vfesim.random_state(cfg, n_agents=200, seed=5)
    for cond, expect in ((1e8, vfesim.ConditioningWarning), (1e15, vfesim.StateError)):
        bad = st.copy(deep=True)
        bad["sigma_q"].values[7] = np.diag(np.r_[1.0, np.full(K - 1, 1.0 / cond)])
        on_dev = bad.copy(data={k: cupy.asarray(bad[k].values) for k in bad.data_vars})
        for ds in (bad, on_dev):
            ctx = pytest.warns(expect) if expect is vfesim.ConditioningWarning else pytest.raises(expect)
            with ctx, np.errstate(all="ignore"):
                try:
                    vfesim.validate_state(ds, cfg)
                except vfesim.StateError as e:
                    assert "sigma_q[agent=7]" in str(e)
                    raise
    vfesim.validate_state(st.copy(data={k: cupy.asarray(st[k].values) for k in st.data_vars}), cfg)


@pytest.mark.parametrize("K", [3, 21])
def test_device_checks_one_pass(K):
    """device_checks: every array's peak and each covariance's first failing agent and largest bound from
    one launch and one transfer; validate_state reports faults in the host's order (values first)."""
    import cupy

    from vfesim.state import device_checks

    cfg = vfesim.ModelConfig(K=K, **BASE)
    st = vfesim.random_state(cfg, n_agents=200, seed=6)
    host = {k: st[k].values.copy() for k in st.data_vars}
    host["sigma_q"][150] = -host["sigma_q"][150]
    host["sigma_p"][9] = -host["sigma_p"][9]
    host["sigma_p"][30] = -host["sigma_p"][30]
    dev = {k: cupy.asarray(v) for k, v in host.items()}
    peaks, spd = device_checks(dev, {k: dev[k] for k in ("sigma_q", "sigma_p")})
    assert peaks == {k: float(np.abs(v).max()) for k, v in host.items()}
    assert spd["sigma_q"][0] == 150 and spd["sigma_p"][0] == 9
    clean = {k: cupy.asarray(st[k].values) for k in ("sigma_q", "sigma_p")}
    _, spd = device_checks({}, clean)
    for k, (first, bounds, worst) in spd.items():
        exact = np.linalg.cond(st[k].values)
        assert first is None and worst == float(bounds.max()) and np.all(bounds.get() >= exact * (1 - 1e-12))
    # A NaN in phi is reported before the indefinite covariances (as on the host).
    host["phi"][77, 2] = np.nan
    for arrays in (host, {k: cupy.asarray(v) for k, v in host.items()}):
        with pytest.raises(vfesim.StateError, match=r"phi\[agent=77\]: contains NaN or Inf"):
            vfesim.validate_state(st.copy(data=arrays), cfg)


@pytest.mark.parametrize(
    "dyn",
    [dict(coupling="C1"), dict(coupling="C1", gate="soft", dephasing_basis="energy"), dict(coupling="C2")],
)
def test_quantum_rollout_on_the_device_matches_numpy(dyn):
    """A rollout of CuPy-resident density-matrix agents (channel step, sender states, adjoint and incoming
    kernels on the GPU) against the array code on NumPy: loss and every gradient."""
    import cupy as cp

    from vfesim.backends.cuda_backend import QUANTUM_OPS
    from vfesim.quantum import QuantumDynamics, Schedule, rollout
    from vfesim.quantum.channels import causal_window
    from vfesim.quantum.state import make_state

    n, d, T = 64, 4, 5
    rng = np.random.default_rng(7)
    cfg = vfesim.QuantumConfig(d=d, lambda_belief=0.5)
    host = vfesim.random_state(cfg, n, seed=3)
    keys = ("rho", "hamiltonian", "temperature", "phi")
    dev = make_state(cfg, *(cp.asarray(host[k].values) for k in keys))
    qd = QuantumDynamics(
        coupling_strength=0.4, neighbours=causal_window(n, 8), dephasing_rate=rng.uniform(0.1, 0.9, n),
        gate_threshold=0.1, gate_width=0.5, **dyn,
    )  # fmt: skip
    sched = Schedule(qd, 0.2, T, rng.integers(-1, d, size=(T, n)))
    want = rollout(host, cfg, sched, loss={"born": 1.0, "free_energy": 0.3})
    got = rollout(dev, cfg, sched, loss={"born": 1.0, "free_energy": 0.3}, ops=QUANTUM_OPS)
    assert got.stats["step_adjoint"] == "kernels" and isinstance(got.final["rho"].data, cp.ndarray)
    assert got.loss == pytest.approx(want.loss, rel=1e-11)
    for k, b in want.grads.items():
        a = got.grads[k]
        a, b = (a.get() if hasattr(a, "get") else np.asarray(a)), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-10 * float(np.abs(b).max(initial=1.0)), err_msg=k)


def test_dense_kernels_honour_register_caps(monkeypatch):
    """A capped variant of the dense pair kernels (benchmarks/bench_gpu.py --tune-registers) compiles
    within its caps and gives the uncapped kernels' pairs to rounding."""
    import cupy as cp
    from vfesim_kernels import cuda as kc

    from vfesim.backends import cuda_backend as cb

    D, dtype, caps = 10, "float32", (80, 96)
    rng = np.random.default_rng(0)
    A, B = (cp.asarray(rng.standard_normal((1000, D)), dtype) for _ in range(2))
    c = cp.asarray(rng.standard_normal(1000), dtype)
    want = cb.BACKEND.pairwise_dense(A, B, c, 1.0, "softmin")
    make = kc.make_dense_kernels
    monkeypatch.setattr(kc, "make_dense_kernels", lambda *a: make(*a, registers=caps))
    got = cb.BACKEND.pairwise_dense(A, B, c, 1.0, "softmin")
    ks = make(D, dtype, "softmin", registers=caps)
    for name, cap in zip(("stats", "grads"), caps, strict=True):
        assert max(ks[name].get_regs_per_thread().values()) <= cap, name
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5)
    for x, y in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(cp.asnumpy(x), cp.asnumpy(y), rtol=1e-4, atol=1e-5 * float(abs(y).max()))


@pytest.mark.parametrize("K", [8, 4])
def test_tensor_core_products_keep_the_ptx_fragment_layout(K):
    """The float64 mma.sync primitives of the pair kernels (kernels/cuda/warp.py) on the hardware: D = A B + C
    with the fragment layouts written out in tests/reference/fragments.py (the simulator's emulation is
    checked against the same maps)."""
    from numba import cuda
    from reference import fragments

    A, B, C, want = fragments.products(K, seed=K)
    out = cuda.to_device(np.full((16, 8), np.nan))
    fragments.kernels()[K][1, 32](cuda.to_device(A), cuda.to_device(B), cuda.to_device(C), out)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-14, atol=1e-14)
    v = np.random.default_rng(K).normal(size=32)
    q = cuda.to_device(np.zeros((2, 32)))
    fragments.kernels()["quads"][1, 32](cuda.to_device(v), q)
    quads = v.reshape(8, 4)
    np.testing.assert_array_equal(q.copy_to_host()[1], np.repeat(quads.max(axis=1), 4))
    np.testing.assert_allclose(q.copy_to_host()[0], np.repeat(quads.sum(axis=1), 4), rtol=1e-15)


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_tensor_core_pairs_with_underflowed_senders(aggregator):
    """float64 dense pairs (the tensor-core kernels) where senders 0 and 1 of every 16 sit 1500 below the
    others in every receiver's logits: weights exactly 0 for one lane's pair of senders in every other
    tile of 8, so its partial sums stay 0 while its rows' maxima move (a rescaling keyed to the lane's own
    sum missed them, 5 % off in gA). Equal to the all-pairs reference; tests/cudasim/test_pair_mma_sim.py
    checks the same logic under the simulator."""
    import cupy as cp

    from vfesim.backends import cuda_backend as cb
    from vfesim.pairwise.reference import pairwise_dense

    rng = np.random.default_rng(11)
    N, D, kappa = 700, 16, 0.7
    A = 0.3 * rng.standard_normal((N, D))
    A[:, 0] = 1.0
    B = 0.3 * rng.standard_normal((N, D))
    B[np.arange(N) % 16 < 2, 0] += 2100.0  # KL' = (A . B + c) / (2 kappa): +1500 for those senders
    c = rng.uniform(0.5, 2.0, N)
    want = pairwise_dense(A, B, c, kappa, aggregator)
    got = cb.BACKEND.pairwise_dense(cp.asarray(A), cp.asarray(B), cp.asarray(c), kappa, aggregator)
    assert float(got[0]) == pytest.approx(want[0], rel=1e-10)
    for x, y in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(cp.asnumpy(x), y, rtol=1e-10, atol=1e-12 * np.abs(y).max())


AHEAD_SCRIPT = """
import json, sys
from importlib import import_module
import vfesim
from vfesim.backends import cuda_backend as cb
from vfesim.integrators import make_integrator
from vfesim_kernels import cuda as kc

reports, compile_ahead = [], kc.ahead.compile_ahead
kc.ahead.compile_ahead = lambda jobs, n=None, **k: reports.append(compile_ahead(jobs, n, **k)) or reports[-1]
K, dtype, dense = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "dense"
n = 600
lists = [[(i + 1) % n, (i + 7) % n] for i in range(n)]
nbrs = "dense" if dense else vfesim.SparseNeighbours.from_lists(lists)
if dtype.startswith("complex"):  # density-matrix agents, d = K: the energy
    cfg = vfesim.QuantumConfig(d=K, neighbours=nbrs, lambda_prior=0.5)
    vfesim.energy_and_gradient(vfesim.random_state(cfg, n, seed=0, dtype=dtype), cfg, backend="cuda")
    jobs = cb.quantum_jobs(K, dtype, cfg.aggregator, dense)
else:
    cfg = vfesim.ModelConfig(K=K, neighbours=nbrs, lambda_prior=0.5)
    s = vfesim.random_state(cfg, n_agents=n, seed=0, dtype=dtype)
    vfesim.energy_and_gradient(s, cfg, backend="cuda")
    for method in ("verlet", "gradient_flow"):
        integ = make_integrator(method, cfg, 1e-3, backend="cuda", seed=1)
        integ.step(integ.init(s))
    jobs = cb.gaussian_jobs(K, dtype, cfg.aggregator, dense)
planned = {}
for j in jobs:
    planned.setdefault((j.module, j.factory, j.args), set()).add((j.kernel, j.argtypes()))
unplanned, sets = [], []
for (m, f, a), sigs in planned.items():
    sets.append(getattr(import_module(m), f)(*a))
    for name, disp in sets[-1].items():
        unplanned += [f"{f}.{name}{t}" for t in getattr(disp, "overloads", {}) if (name, t) not in sigs]
compiled, loaded = kc.compile_report(*sets)
out = dict(reports=reports, jobs=len(jobs), unplanned=unplanned, compiled=compiled, loaded=loaded)
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    "K, dtype, pairs",
    [(3, "float32", "dense"), (3, "float64", "sparse"), (9, "float32", "dense"), (4, "complex128", "dense")],
)
def test_a_first_run_launches_only_kernels_compiled_ahead(tmp_path, K, dtype, pairs):
    """A process with an empty kernel cache compiles every kernel of its run ahead, in worker processes
    (vfesim_kernels.cuda.ahead), with the signatures its launches then use; a second process loads them
    all from the cache and compiles none. Gaussian agents (K, float dtypes) and density-matrix agents
    (d = K, complex dtypes)."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), VFESIM_COMPILE_WORKERS="4")
    cmd = [sys.executable, "-c", AHEAD_SCRIPT, str(K), dtype, pairs]
    runs = []
    for _ in range(2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-5000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    (report,) = first["reports"]
    assert report["failed"] == [] and report["compiled"] == first["jobs"], first
    assert first["unplanned"] == [] and second["unplanned"] == [], runs
    assert second["reports"][0]["compiled"] == 0 and second["compiled"] == 0 and second["loaded"] > 0, second


def test_fast_launches_give_numba_launch_bits(monkeypatch):
    """The cached launches of vfesim_kernels.cuda.launch against numba's own launch: a density-matrix
    rollout with its gradient and a Gaussian energy and gradient give the same bits, and the cached path
    ran (compiled kernels recorded for it)."""
    import cupy as cp
    from vfesim_kernels.cuda import launch as L

    from vfesim.backends import cuda_backend as cb
    from vfesim.quantum import QuantumDynamics, Schedule, rollout
    from vfesim.quantum.channels import causal_window
    from vfesim.quantum.state import make_state

    n, d, T = 96, 4, 4
    rng = np.random.default_rng(5)
    qcfg = vfesim.QuantumConfig(d=d, lambda_belief=0.5)
    host = vfesim.random_state(qcfg, n, seed=4)
    dev = make_state(
        qcfg, *(cp.asarray(host[k].values) for k in ("rho", "hamiltonian", "temperature", "phi"))
    )
    qd = QuantumDynamics(coupling_strength=0.4, neighbours=causal_window(n, 8), dephasing_rate=0.3)
    sched = Schedule(qd, 0.2, T, rng.integers(-1, d, size=(T, n)))
    gcfg = vfesim.ModelConfig(K=3, **BASE)
    garrays = _arrays(gcfg, 700, "float32")

    def results():
        r = rollout(dev, qcfg, sched, loss={"born": 1.0, "free_energy": 0.3}, ops=cb.QUANTUM_OPS)
        t, g = cb.energy_and_gradient(cb.to_device(garrays), gcfg)
        out = [np.float64(r.loss), *(np.asarray(t[k]) for k in sorted(t))]
        out += [cp.asnumpy(v) if hasattr(v, "get") else np.asarray(v) for _, v in sorted(r.grads.items())]
        return out + [cb.to_host(g)[k] for k in sorted(g)]

    results()  # first launches: numba's (compiles, binds), recorded for the cached path
    fast = results()
    assert L.FAST_LAUNCH and sum(k is not None for _, k in L._KERNELS.values()) >= 8
    monkeypatch.setattr(L, "FAST_LAUNCH", False)
    slow = results()
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
