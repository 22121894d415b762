"""The dask backend's per-chunk CUDA path (inner="cuda") under the CUDA simulator: chunk pair kernels
(dense receiver ranges, sparse lists into gathered senders) and per-agent stages on the device, against
the numpy backend and the CPU row kernels. Tiny N: the simulator runs ~1-5 ms per thread."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vfesim_kernels.pairwise_cpu import pairwise_sparse_rows as cpu_sparse_rows

import vfesim
from vfesim.backends import cuda_backend, get
from vfesim.backends.dask_backend import resolve_inner
from vfesim.scenario import Scenario

dask = pytest.importorskip("dask")

N = 8


@pytest.fixture(autouse=True)
def _one_thread():
    """The simulator runs one kernel launch at a time (it swaps the ``cuda`` module of the kernel's
    globals during a launch): tasks run in this thread (on a GPU, tasks take turns: DEVICE_LOCK)."""
    with dask.config.set(scheduler="synchronous"):
        yield


def test_sparse_rows_match_the_cpu_kernel():
    rng = np.random.default_rng(3)
    n_r, n_s, D = 3, 5, 4
    A, c, B = rng.normal(size=(n_r, D)), rng.normal(size=n_r), rng.normal(size=(n_s, D))
    index = np.array([[4, 0], [1, 1], [2, 0]])
    mask = np.array([[True, True], [True, False], [False, True]])
    got = cuda_backend.pairwise_sparse_rows(A, c, B, index, mask, 1.3, "softmin")
    ref = cpu_sparse_rows(A, c, B, index, mask, 1.3, "softmin")
    for g, r, name in zip(got, ref, ("erow", "gA", "gc", "gB"), strict=True):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-14, err_msg=name)
    assert got[0].dtype == got[3].dtype == np.float64 and got[3].shape == (n_s, D)


@pytest.mark.parametrize(
    ("neighbours", "aggregator"), [("dense", "softmin"), ("dense", "expected"), ("ring", "expected")]
)
def test_cuda_chunks_match_numpy(neighbours, aggregator):
    nb = "dense" if neighbours == "dense" else vfesim.SparseNeighbours.ring(N, 1)
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.6, kappa_beta=0.8, aggregator=aggregator, neighbours=nb)
    state = vfesim.random_state(cfg, N, seed=5)
    ref_terms, ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    terms, grads = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(3, 5), inner="cuda")
    for k, v in ref_terms.items():
        assert abs(terms[k] - v) <= 1e-10 * abs(ref_terms["total"]), k
    for k in ref.data_vars:
        x, y = grads[k].values, ref[k].values
        assert isinstance(x, np.ndarray) and x.dtype == y.dtype, k
        assert np.abs(x - y).max() <= 1e-10 * np.abs(y).max(), k


def test_cuda_two_passes_gathered_or_direct_give_the_same_bits(monkeypatch):
    """The two dense passes take every chunk's features and statistics directly or (more than
    DIRECT_CHUNKS chunks) one gathered copy: the same bits."""
    from vfesim.backends import dask_backend

    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.6, aggregator="softmin")
    state = vfesim.random_state(cfg, N, seed=5)
    monkeypatch.setattr(dask_backend, "_distributed", lambda: True)  # direct inputs, as on a cluster
    t1, g1 = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(3, 5), inner="cuda")
    monkeypatch.setattr(dask_backend, "DIRECT_CHUNKS", 1)
    t2, g2 = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(3, 5), inner="cuda")
    assert t1 == t2
    for k in g1.data_vars:
        np.testing.assert_array_equal(g1[k].values, g2[k].values)


def test_default_inner_is_cuda_where_the_workers_see_a_gpu():
    assert resolve_inner(None) == "cuda"  # the simulator stands in for a GPU


@pytest.mark.parametrize("rule", ["natural", "adam"])
def test_cuda_chunked_flow_matches_numpy(rule):
    """Gradient-flow runs chunked with inner "cuda": the fused device update per chunk (and the device
    population sums) agree with the in-memory numpy run; sparse lists reused across steps."""
    from vfesim.backends import get

    nb = vfesim.SparseNeighbours.ring(N, 2)
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5, aggregator="softmin", neighbours=nb)
    state = vfesim.random_state(cfg, N, seed=6)
    kw = {"method": "gradient_flow", "dt": 0.02, "n_steps": 3, "rule": rule}
    ref, h_ref = vfesim.run_dynamics(state, cfg, backend="numpy", **kw)
    backend = dataclasses.replace(get("dask"), chunks=(3, 5), inner="cuda")
    out, h = vfesim.run_dynamics(state, cfg, backend=backend, **kw)
    for k in ref.data_vars:
        np.testing.assert_allclose(out[k].values, ref[k].values, rtol=1e-10, atol=1e-12, err_msg=k)
    np.testing.assert_allclose(h["energy_total"].values, h_ref["energy_total"].values, rtol=1e-10)


def test_cuda_chunked_flow_guard_names_the_global_agent():
    """A NaN force on the second agent of a chunk starting at agent 3: the device update's flag brings
    in the host guard, whose error names the step and the global agent."""
    from vfesim.integrators.chunked import ChunkDynamicsError, _flow_task, _FlowRule
    from vfesim.integrators.gradient_flow import flow_settings

    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5)
    state = vfesim.random_state(cfg, 5, seed=6)
    arrays = {k: state[k].values for k in state.data_vars}
    grads = {k: v.values for k, v in vfesim.energy_and_gradient(state, cfg, backend="numpy")[1].items()}
    _, fields, eta, moving, mode, b1, b2, eps = flow_settings(cfg, 0.01, 0.0, {})
    rule = _FlowRule(None, eta, mode, moving, b1, b2, eps, tuple(fields))
    new, _ = _flow_task(rule, cfg, arrays, grads, {}, 2, 3, "cuda")  # a clean chunk: no error
    assert all(np.isfinite(v).all() for v in new.values())
    grads["mu_q"][1, 2] = np.nan
    with pytest.raises(ChunkDynamicsError) as e:
        _flow_task(rule, cfg, arrays, grads, {}, 2, 3, "cuda")
    err = e.value.error()
    assert (err.step, err.variable, err.agent) == (2, "mu_q", 4)


@pytest.mark.parametrize("coupling", ["C1", "C2"])
def test_quantum_run_steps_with_cuda_chunks_match_numpy(coupling, monkeypatch):
    """A density-matrix run on dask with inner "cuda": the Jacobi channel step of every chunk in the cuda
    backend's kernels, given the window's senders, and the energy of the mirror steps on the device;
    equal to the numpy run."""
    calls = []

    def channel_step(P, rho, dt, dyn, senders=None):
        calls.append(rho.shape[0])
        assert senders is not None
        return kernel_step(P, rho, dt, dyn, senders=senders)

    ops = cuda_backend.QUANTUM_OPS
    kernel_step = ops.channel_step
    monkeypatch.setattr(cuda_backend, "QUANTUM_OPS", ops._replace(channel_step=channel_step))
    scn = Scenario.from_dict(
        {
            "quantum": {"d": 2, "lambda_self": 0.3, "lambda_belief": 1.0, "lambda_obs": 0.2},
            "population": {"n_agents": 5, "seed": 3, "neighbours": "ring", "half_width": 1},
            "integrator": {
                "method": "channels",
                "dt": 0.1,
                "coupling": coupling,
                "coupling_strength": 0.3,
                "observe": "born",
                "mirror_steps": 1,
            },
            "run": {"n_steps": 2},
        }
    )
    state = scn.initial_state()
    make = lambda be: scn.spec.make_integrator(scn.model, scn.integrator, backend=be, seed=0)
    ref, dk = make("numpy"), make(dataclasses.replace(get("dask"), chunks=2, inner="cuda"))
    a, b = ref.init(state), dk.init(state)
    for _ in range(2):
        a, b = ref.step(a), dk.step(b)
    assert dk.layout.inner == "cuda"
    assert calls == [2, 2, 1] * 2  # every chunk, every step
    x, y = b.state["rho"].values, a.state["rho"].values
    assert np.abs(x - y).max() <= 1e-12 * np.abs(y).max()
    assert abs(b.terms["total"] - a.terms["total"]) <= 1e-12 * abs(a.terms["total"])
    np.testing.assert_array_equal(b.state["outcome"].values, a.state["outcome"].values)


def test_sparse_rows_cache_lists_by_key():
    """Lists named by a key are checked, transposed and copied to the device once: a moved copy of the
    same lists under the same key reuses the entry (same results), another key makes a new one."""
    rng = np.random.default_rng(4)
    n_r, n_s, D = 3, 5, 4
    A, c, B = rng.normal(size=(n_r, D)), rng.normal(size=n_r), rng.normal(size=(n_s, D))
    index = np.array([[4, 0], [1, 1], [2, 0]])
    mask = np.array([[True, True], [True, False], [False, True]])
    cuda_backend.clear_cache()
    rows = cuda_backend.pairwise_sparse_rows
    first = rows(A, c, B, index, mask, 1.3, "softmin", key="plan:0")
    again = rows(A, c, B, index.copy(), mask.copy(), 1.3, "softmin", key="plan:0")
    assert len(cuda_backend._neighbours) == 1
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    rows(A, c, B, index, mask, 1.3, "softmin", key="plan:3")
    assert len(cuda_backend._neighbours) == 2


@pytest.mark.parametrize("bad", [-1, 5])
def test_sparse_rows_refuse_listed_senders_out_of_range(bad):
    """A listed sender outside the gathered rows is an error before any kernel (or transposition) runs."""
    rng = np.random.default_rng(5)
    A, c, B = rng.normal(size=(2, 4)), rng.normal(size=2), rng.normal(size=(5, 4))
    index = np.array([[bad, 0], [1, 2]])
    mask = np.ones((2, 2), bool)
    with pytest.raises(ValueError, match=r"listed senders must be rows 0 \.\. 4"):
        cuda_backend.pairwise_sparse_rows(A, c, B, index, mask, 1.0, "softmin")


def test_gaussian_chunks_run_the_fused_stages_centred_on_the_population(monkeypatch):
    """inner="cuda" chunks of Gaussian agents run the fused device stages with the population's centre
    and the chunk's given pairs (not the CuPy array code); means far from the origin, uneven chunks."""
    made = []
    real = cuda_backend.FusedStages.__init__

    def spy(self, *args, **kwargs):
        made.append((kwargs.get("centre") is not None, kwargs.get("given_pairs")))
        real(self, *args, **kwargs)

    monkeypatch.setattr(cuda_backend.FusedStages, "__init__", spy)
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.6, neighbours=vfesim.SparseNeighbours.ring(N, 2))
    state = vfesim.random_state(cfg, N, seed=7)
    state["mu_q"] = state["mu_q"] + 40.0
    ref_terms, ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    terms, grads = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(5, 3), inner="cuda")
    assert made and set(made) == {(True, True)}
    for k, v in ref_terms.items():
        assert abs(terms[k] - v) <= 1e-10 * abs(ref_terms["total"]), k
    for k in ref.data_vars:
        assert np.abs(grads[k].values - ref[k].values).max() <= 1e-9 * np.abs(ref[k].values).max(), k


def test_gaussian_chunks_where_the_fused_kernels_do_not_fit(monkeypatch):
    """The staged array code with the population's centre (K whose block kernels do not fit: forced
    here) gives the numpy backend's result too."""
    monkeypatch.setattr(cuda_backend, "_mode", lambda K, dtype: "batched")
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.6, neighbours=vfesim.SparseNeighbours.ring(N, 2))
    state = vfesim.random_state(cfg, N, seed=7)
    state["mu_p"] = state["mu_p"] - 25.0
    ref_terms, ref = vfesim.energy_and_gradient(state, cfg, backend="numpy")
    terms, grads = vfesim.energy_and_gradient(state, cfg, backend="dask", chunks=(5, 3), inner="cuda")
    for k, v in ref_terms.items():
        assert abs(terms[k] - v) <= 1e-10 * abs(ref_terms["total"]), k
    for k in ref.data_vars:
        assert np.abs(grads[k].values - ref[k].values).max() <= 1e-9 * np.abs(ref[k].values).max(), k
