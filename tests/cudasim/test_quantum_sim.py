"""Density-matrix agents on the cuda backend under the Numba CUDA simulator: the per-agent CUDA kernels
(Jacobi eigensolver, Daleckii–Krein adjoints) and the streaming pair kernels against the numpy backend."""

import numpy as np
import pytest
from quantum_stages import (
    ALL_WEIGHTS,
    POISONED,
    assert_stages_match,
    channel_case,
    check_born_ops,
    stage_inputs,
    stage_outputs,
)

import vfesim
from vfesim.backends.cuda_backend import QUANTUM_OPS
from vfesim.quantum.energy import NUMPY_OPS

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_cuda_matches_numpy(aggregator):
    cfg = vfesim.QuantumConfig(d=3, aggregator=aggregator, lambda_prior=0.5, lambda_obs=0.2)
    qs = vfesim.random_state(cfg, n_agents=9, seed=1)
    t_ref, g_ref = vfesim.energy_and_gradient(qs, cfg, backend="numpy")
    t, g = vfesim.energy_and_gradient(qs, cfg, backend="cuda")
    for k in t_ref:
        np.testing.assert_allclose(t[k], t_ref[k], rtol=1e-10, atol=1e-10 * abs(t_ref["total"]), err_msg=k)
    for k in g_ref.data_vars:
        b = g_ref[k].values
        np.testing.assert_allclose(g[k].values, b, rtol=1e-10, atol=1e-10 * float(np.abs(b).max()), err_msg=k)


@pytest.mark.parametrize(
    "d, dtype, rtol",
    [(2, "complex128", 1e-12), (4, "complex128", 1e-12), (8, "complex128", 1e-11), (3, "complex64", 2e-5)],
)
def test_cuda_kernels_match_numpy_stages(d, dtype, rtol):
    """The fused per-agent CUDA kernels (one thread per agent) against the array code."""
    assert_stages_match(QUANTUM_OPS, stage_inputs(d, dtype, N=6), rtol)


@pytest.mark.parametrize("agent_minor", [False, True])
@pytest.mark.parametrize("weights", ALL_WEIGHTS)
def test_cuda_kernels_with_terms_off(weights, agent_minor):
    """Every set of terms on, the kernels' buffers starting as NaN (tests/quantum_stages.Poisoned): they
    read only what they wrote and match the array code, in either layout."""
    from vfesim.backends.cuda_backend import _quantum_launch
    from vfesim.quantum.kernel_ops import kernel_ops

    poisoned = kernel_ops(lambda: POISONED, _quantum_launch, agent_minor=agent_minor)
    assert_stages_match(poisoned, stage_inputs(2, "complex128", N=5, seed=3), 1e-12, weights)


@pytest.mark.parametrize("weights", [(0.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.0, 1.0)])
def test_cooperative_eigh_forward_with_terms_off(weights):
    """From d = 6 the forward pass runs energy_mats, the cooperative eigh and energy_finish: with a part
    of the terms off and the buffers starting as NaN, it reads only what it wrote and matches the array
    code."""
    from vfesim_kernels.cuda.eigh import COOP_MIN_D

    from vfesim.backends.cuda_backend import _quantum_launch
    from vfesim.quantum.kernel_ops import kernel_ops

    poisoned = kernel_ops(lambda: POISONED, _quantum_launch, agent_minor=True, batched_eigh_from=COOP_MIN_D)
    assert_stages_match(poisoned, stage_inputs(COOP_MIN_D, "complex128", N=4, seed=5), 1e-12, weights)


def _is_agent_minor(a, axis=0):
    return np.moveaxis(np.asarray(a), axis, -1).flags.c_contiguous


@pytest.mark.parametrize("coupling", ["C1", "C2"])
def test_agent_minor_layout_gives_the_row_major_bits(coupling):
    """The backend's layout (agent axis fastest in memory: vfesim.arrays.agent_minor) against row-major
    arrays, with the same kernels: every output of the free energy's passes, the channel step and its
    adjoint bitwise equal; the step's states and the adjoint's cotangents come out agent-minor, and a
    step from such a state takes it without a copy."""
    from vfesim.backends.cuda_backend import _quantum_launch
    from vfesim.quantum.kernel_ops import kernel_ops

    assert QUANTUM_OPS.step_vjp(3).agent_minor
    rows, minor = (kernel_ops(lambda: np, _quantum_launch, agent_minor=m) for m in (False, True))
    v = stage_inputs(3, "complex128", N=7, seed=4)
    want, got = stage_outputs(rows, v), stage_outputs(minor, v)
    for k, b in want.items():
        assert np.array_equal(got[k], b, equal_nan=True), k
    P, rho, dyn = channel_case(3, "complex128", coupling, "energy", "soft", N=7)
    out_r, out_m = rows.channel_step(P, rho, 0.3, dyn), minor.channel_step(P, rho, 0.3, dyn)
    assert _is_agent_minor(out_m) and not _is_agent_minor(out_r)
    assert np.array_equal(out_m, out_r)
    again = minor.channel_step(P, out_m, 0.3, dyn)
    assert np.array_equal(again, rows.channel_step(P, out_r, 0.3, dyn))
    rng = np.random.default_rng(5)
    ob = rng.normal(size=rho.shape) + 1j * rng.normal(size=rho.shape)
    b_r = rows.step_vjp(3)(P, out_r, ob, 0.3, dyn)
    b_m = minor.step_vjp(3)(P, out_m, ob, 0.3, dyn)
    assert _is_agent_minor(b_m["bar"]) and _is_agent_minor(b_m["H_bar"])
    assert b_r.keys() == b_m.keys()
    for k, b in b_r.items():
        assert np.array_equal(b_m[k], b), k


def test_cuda_sparse_complex64_matches_numpy():
    rng = np.random.default_rng(0)
    N = 10
    index = np.stack([rng.choice(np.delete(np.arange(N), i), 3, replace=False) for i in range(N)])
    neighbours = vfesim.SparseNeighbours(index, np.ones_like(index, bool))
    cfg = vfesim.QuantumConfig(d=2, lambda_prior=0.3, neighbours=neighbours)
    qs = vfesim.random_state(cfg, n_agents=N, seed=2, dtype="complex64")
    t_ref, g_ref = vfesim.energy_and_gradient(qs, cfg, backend="numpy")
    t, g = vfesim.energy_and_gradient(qs, cfg, backend="cuda")
    for k in t_ref:
        np.testing.assert_allclose(t[k], t_ref[k], rtol=1e-4, atol=1e-4 * abs(t_ref["total"]), err_msg=k)
    for k in g_ref.data_vars:
        b = g_ref[k].values
        np.testing.assert_allclose(g[k].values, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()), err_msg=k)


@pytest.mark.parametrize(
    "coupling, basis, gate, dtype, tol",
    [("C1", "energy", "soft", "complex128", 1e-13), ("C2", "computational", "hard", "complex64", 2e-6)],
)
def test_cuda_channel_step_matches_the_array_code(coupling, basis, gate, dtype, tol):
    """The channel step kernel (one thread per agent) against vfesim.quantum.evolve's array code."""
    P, rho, dyn = channel_case(3, dtype, coupling, basis, gate, N=6)
    want = NUMPY_OPS.channel_step(P, rho, 0.3, dyn)
    got = QUANTUM_OPS.channel_step(P, rho, 0.3, dyn)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


def test_cuda_channel_step_vjp_matches_the_cpu_kernel():
    """The adjoint kernel of one channel step under the simulator against the same maths on the CPU (itself
    checked against the array code in tests/test_quantum_kernels.py)."""
    from vfesim_kernels import quantum_cpu

    from vfesim.backends.cuda_backend import _quantum_launch
    from vfesim.quantum.kernel_ops import kernel_step_vjp

    P, rho, dyn = channel_case(3, "complex128", "C1", "energy", "soft", N=6)
    rng = np.random.default_rng(2)
    ob = rng.normal(size=rho.shape) + 1j * rng.normal(size=rho.shape)
    ob = ob + ob.conj().swapaxes(1, 2)
    want = kernel_step_vjp(lambda: np, quantum_cpu.launch)(P, rho, ob, 0.3, dyn)
    got = kernel_step_vjp(lambda: np, _quantum_launch)(P, rho, ob, 0.3, dyn)
    for k, b in want.items():
        np.testing.assert_allclose(
            got[k], b, rtol=0, atol=1e-12 * max(1.0, float(np.abs(b).max())), err_msg=k
        )


@pytest.mark.parametrize("d, dtype, tol", [(2, "complex128", 1e-13), (4, "complex128", 1e-13),
                                           (3, "complex64", 5e-6), (6, "complex128", 1e-13),
                                           (7, "complex64", 5e-6)])  # fmt: skip
def test_batched_eigh_kernel_against_numpy(d, dtype, tol, monkeypatch):
    """The cuda backend's eigensolver of the array code (the ``eigh`` kernel, registered for CuPy arrays in
    vfesim.quantum.linalg.EIGENSOLVERS) under the simulator: any leading batch shape, ascending eigenvalues,
    columns that are eigenvectors, launched with the argument types of its signature. From d = 6 the
    kernel is the cooperative one (vfesim_kernels.cuda.eigh), odd d with its dummy index."""
    import numba
    from numba.core import sigutils
    from vfesim_kernels import cuda as kc

    from vfesim.backends import cuda_backend

    launched = []
    real_launch = cuda_backend._launch

    def record(k, blocks, threads, *args):
        launched.append(tuple(numba.typeof(a) for a in args))
        real_launch(k, blocks, threads, *args)

    monkeypatch.setattr(cuda_backend, "_launch", record)
    rng = np.random.default_rng(d)
    X = rng.normal(size=(2, 3, d, d)) + 1j * rng.normal(size=(2, 3, d, d))
    X = (X + X.conj().swapaxes(-1, -2)).astype(dtype)
    X[0, 0] = 2.0 * np.eye(d)  # a degenerate spectrum
    w, V = cuda_backend.batched_eigh(X)
    assert w.shape == (2, 3, d) and V.shape == X.shape and V.dtype == X.dtype
    assert (np.diff(w, axis=-1) >= 0).all()
    np.testing.assert_allclose(w, np.linalg.eigvalsh(X.astype(complex)), rtol=0, atol=tol * np.abs(X).max())
    np.testing.assert_allclose(X @ V, V * w[..., None, :], rtol=0, atol=tol * np.abs(X).max())
    want = sigutils.normalize_signature(kc.quantum_kernel_signatures(dtype)["eigh"])[0]
    (types,) = launched
    assert [(t.dtype, t.ndim, t.layout) if isinstance(t, numba.types.Array) else t for t in types] == [
        (w.dtype, w.ndim, w.layout) if isinstance(w, numba.types.Array) else w for w in want
    ]


@pytest.mark.parametrize("dtype, tol", [("complex128", 1e-13), ("complex64", 1e-6)])
def test_cuda_born_kernels_against_naive_sums(dtype, tol):
    """The Born terms of rollouts by the CUDA kernels (``born_logp``, ``born_add``) under the simulator."""
    from vfesim.backends.cuda_backend import _quantum_launch
    from vfesim.quantum.kernel_ops import kernel_born

    check_born_ops(kernel_born(lambda: np, _quantum_launch), dtype, tol)
