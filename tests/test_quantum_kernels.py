"""The density-matrix per-agent kernels (kernels/quantum_math.py, compiled for the CPU in
kernels/quantum_cpu.py): the Jacobi eigensolver on hard spectra, and the fused passes of ``QuantumOps``
against the array code (complex128 to round-off, complex64 to its precision). The same kernels compiled for
CUDA are checked under the simulator (tests/cudasim/test_quantum_sim.py) and for sm_90
(tests/test_cuda_ptx.py)."""

import numba
import numpy as np
import pytest
from quantum_stages import (
    ALL_WEIGHTS,
    POISONED,
    WEIGHTS,
    assert_stages_match,
    channel_case,
    stage_inputs,
    stage_outputs,
)
from vfesim_kernels import quantum_cpu, quantum_math

from vfesim.backends import numba_backend
from vfesim.quantum.energy import NUMPY_OPS
from vfesim.quantum.kernel_ops import jacobi_tol2, kernel_ops

# The CPU kernels for every d (the numba backend switches to the NumPy stages above a size).
KERNEL_OPS = kernel_ops(lambda: np, quantum_cpu.launch)
_jac = quantum_math.link(numba.njit, "test")
_jacobi, _load, _eigh_agent = _jac.jacobi_eigh, _jac.load_herm, _jac.eigh_agent


@numba.njit
def _eigh_all(X, tol2):
    N, d = X.shape[0], X.shape[1]
    w = np.empty((N, d))
    V = np.empty_like(X)
    A = np.empty((d, d), X.dtype)
    for n in range(N):
        _load(X, n, A)
        _jacobi(A, w[n], V[n], tol2)
    return w, V


def _herm(rng, N, d):
    X = rng.normal(size=(N, d, d)) + 1j * rng.normal(size=(N, d, d))
    return X + X.conj().swapaxes(1, 2)


def _hard_spectra(rng, d):
    """Matrices whose eigen-decomposition is hard for a Jacobi solver: zero, multiples of the identity,
    degenerate and clustered spectra, diagonal input, a tiny off-diagonal against a large gap (|tau| far
    beyond 1e100), entries spanning 1e-8 .. 1e8, and purely imaginary off-diagonals."""
    Q, _ = np.linalg.qr(rng.normal(size=(d, d)) + 1j * rng.normal(size=(d, d)))
    conj = lambda w: (Q * w) @ Q.conj().T
    mats = [
        np.zeros((d, d), complex),
        3.0 * np.eye(d, dtype=complex),
        conj(np.r_[np.full(d - 1, 2.0), -1.0]),
        conj(1.0 + 1e-9 * np.arange(d)),
        np.diag(np.linspace(-2, 5, d)).astype(complex),
        conj(np.logspace(-8, 8, d)),
    ]
    tiny = np.diag(np.arange(d, dtype=float) * 1e3).astype(complex)
    tiny[0, 1], tiny[1, 0] = 1e-200, 1e-200
    mats.append(tiny)
    im = np.zeros((d, d), complex)
    im[np.triu_indices(d, 1)] = 1j
    mats.append(im + im.conj().T)
    return np.stack(mats)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 8])
def test_jacobi_eigh_reconstructs_and_is_unitary(d):
    rng = np.random.default_rng(d)
    X = np.concatenate([_herm(rng, 20, d), _hard_spectra(rng, d)])
    w, V = _eigh_all(X, jacobi_tol2(np.complex128))
    scale = np.abs(X).reshape(len(X), -1).max(axis=1)[:, None, None] + 1e-300
    R = (V * w[:, None, :]) @ V.conj().swapaxes(1, 2)
    assert (np.abs(R - X) / scale).max() < 1e-13
    assert np.abs(V.conj().swapaxes(1, 2) @ V - np.eye(d)).max() < 1e-13
    ref = np.linalg.eigvalsh(X)
    assert (np.abs(np.sort(w, axis=1) - ref) / scale[:, :, 0]).max() < 1e-13


@numba.njit
def _eigh_sorted(X, tol2):
    N, d = X.shape[0], X.shape[1]
    w, V = np.empty((N, d)), np.empty_like(X)
    A, W, r = np.empty((d, d), X.dtype), np.empty((d, d), X.dtype), np.empty(d)
    for n in range(N):
        _eigh_agent(X, n, tol2, w, V, A, r, W)
    return w, V


@pytest.mark.parametrize("d", [2, 4, 8])
def test_eigh_agent_sorts_ascending_with_matching_vectors(d):
    """The batched eigh's per-matrix step (``eigh_agent``, the cuda backend's eigensolver of the array
    code): eigenvalues ascending as numpy's, each column still the eigenvector of its eigenvalue."""
    rng = np.random.default_rng(10 + d)
    X = np.concatenate([_herm(rng, 20, d), _hard_spectra(rng, d)])
    w, V = _eigh_sorted(X, jacobi_tol2(np.complex128))
    scale = np.abs(X).reshape(len(X), -1).max(axis=1)[:, None] + 1e-300
    assert (np.diff(w, axis=1) >= 0).all()
    assert (np.abs(w - np.linalg.eigvalsh(X)) / scale).max() < 1e-13
    residual = X @ V - V * w[:, None, :]  # X v_k = w_k v_k, column by column
    assert (np.abs(residual) / scale[:, :, None]).max() < 1e-13
    assert np.abs(V.conj().swapaxes(1, 2) @ V - np.eye(d)).max() < 1e-13


@pytest.mark.parametrize(
    "d, dtype, rtol",
    [(2, "complex128", 1e-12), (3, "complex128", 1e-12), (4, "complex128", 1e-12), (5, "complex128", 1e-12),
     (8, "complex128", 1e-11), (4, "complex64", 2e-5)],
)  # fmt: skip
def test_cpu_kernels_match_numpy_stages(d, dtype, rtol):
    """The fused per-agent passes (forward: floor, eig_log, Gibbs, frames, energies, features; backward:
    pull-back adjoints, Daleckii–Krein of log and exp, the Gibbs map, rule R2) against the array code."""
    assert_stages_match(KERNEL_OPS, stage_inputs(d, dtype), rtol)


@pytest.mark.parametrize("weights", ALL_WEIGHTS)
def test_cpu_kernels_with_terms_off(weights):
    """Every set of terms on: the passes leave out the parts of the terms off (zero gradients where
    nothing depends on a variable), exactly as the array code does, and read nothing they did not write
    (their buffers start as NaN)."""
    poisoned = kernel_ops(lambda: POISONED, quantum_cpu.launch)
    assert_stages_match(poisoned, stage_inputs(3, "complex128", N=7, seed=2), 1e-12, weights)


def test_results_do_not_depend_on_the_thread_split(monkeypatch):
    v = stage_inputs(4, "complex128", N=40, seed=5)
    one = stage_outputs(KERNEL_OPS, v)
    monkeypatch.setattr(quantum_cpu, "MIN_AGENTS_PER_THREAD", 1)
    split = stage_outputs(KERNEL_OPS, v)
    for k in one:
        np.testing.assert_array_equal(one[k], split[k], err_msg=k)


def test_numba_backend_runs_kernels_up_to_its_size_limit(monkeypatch):
    """The numba backend's passes: Jacobi kernels up to QUANTUM_JACOBI_MAX_D, LAPACK (NumPy) above."""
    calls = []
    run = quantum_cpu._run
    monkeypatch.setattr(quantum_cpu, "_run", lambda k, *a: (calls.append(k), run(k, *a)))
    ops = numba_backend.QUANTUM_OPS
    small, large = numba_backend.QUANTUM_JACOBI_MAX_D, numba_backend.QUANTUM_JACOBI_MAX_D + 1
    ops.forward(stage_inputs(small, "complex128", N=6)[0], WEIGHTS[0])
    assert calls == [quantum_cpu.KERNELS["energy_prep"], quantum_cpu.KERNELS["energy_features"]]
    arrays = stage_inputs(large, "complex128", N=6)[0]
    got, ref = ops.forward(arrays, WEIGHTS[0]), NUMPY_OPS.forward(arrays, WEIGHTS[0])
    np.testing.assert_array_equal(got.energies["self"], ref.energies["self"])
    assert len(calls) == 2  # none more above the limit


CHANNEL_MODES = [
    ("C1", "computational", "none"),
    ("C1", "energy", "soft"),
    ("C2", "computational", "hard"),
    ("C2", "energy", "none"),
    ("none", "computational", "soft"),
]


@pytest.mark.parametrize("coupling, basis, gate", CHANNEL_MODES)
@pytest.mark.parametrize("d, dtype, window", [(2, "complex128", "sparse"), (3, "complex128", "dense"),
                                              (4, "complex128", "sparse"), (5, "complex128", "sparse"),
                                              (4, "complex64", "dense")])  # fmt: skip
def test_channel_step_kernel_matches_the_array_code(coupling, basis, gate, d, dtype, window):
    """One forward channel step (coupling window, gate, unitary, dephasing, thermalising) of the CPU kernel
    against vfesim.quantum.evolve's array code."""
    P, rho, dyn = channel_case(d, dtype, coupling, basis, gate, window)
    want = NUMPY_OPS.channel_step(P, rho, 0.3, dyn)
    got = KERNEL_OPS.channel_step(P, rho, 0.3, dyn)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-13 if dtype == "complex128" else 2e-6
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert np.abs(got - rho).max() > 100 * tol  # the step moved the states


def test_channel_step_kernel_refuses_a_non_positive_state_under_the_gate():
    P, rho, dyn = channel_case(3, "complex128", "none", "computational", "soft")
    rho = rho.copy()
    rho[4] = np.diag([1.2, -0.2, 0.0])
    for ops in (NUMPY_OPS, KERNEL_OPS):
        with pytest.raises(ValueError, match=r"rho\[agent=4\]: not positive semidefinite"):
            ops.channel_step(P, rho, 0.3, dyn)


VJP_MODES = [
    ("C1", "computational", "none"),
    ("C1", "energy", "soft"),
    ("C2", "computational", "soft"),
    ("C2", "energy", "none"),
    ("none", "energy", "soft"),
]


@pytest.mark.parametrize("coupling, basis, gate", VJP_MODES)
@pytest.mark.parametrize("d, dtype, window", [(2, "complex128", "sparse"), (4, "complex128", "dense"),
                                              (3, "complex64", "sparse")])  # fmt: skip
def test_channel_step_vjp_kernel_matches_the_array_code(coupling, basis, gate, d, dtype, window):
    """The adjoint kernels of one channel step (forward recomputed per agent, then the C1 senders' parts)
    against the array code's rollout._update_vjp on the same tape, its senders' parts added
    (channels.add_incoming) and its transports' cotangents taken to the frames (channels.transports_vjp):
    every cotangent, masked window slots included. The frames' cotangents are compared as the angles'
    (frames_vjp): the kernels leave out parts orthogonal to the unitary tangent space."""
    from vfesim.quantum.channels import add_incoming, incoming_slots, transports_vjp
    from vfesim.quantum.evolve import agent_update
    from vfesim.quantum.frames import frames_vjp, spin_generators
    from vfesim.quantum.kernel_ops import kernel_step_vjp
    from vfesim.quantum.rollout import _update_vjp, _zeros_acc

    P, rho, dyn = channel_case(d, dtype, coupling, basis, gate, window)
    dt = 0.3
    rng = np.random.default_rng(5)
    ob = rng.normal(size=rho.shape) + 1j * rng.normal(size=rho.shape)
    ob = (ob + ob.conj().swapaxes(1, 2)).astype(dtype)
    R = rho[P.index]
    _, tape = agent_update(P, slice(None), rho, R, dt, dyn, keep=True)
    acc = _zeros_acc(P, np, rho.dtype)
    x_bar, R_bar, dt_bar = _update_vjp(P, slice(None), R, tape, ob, dt, dyn, acc)
    bar = add_incoming(x_bar, R_bar, incoming_slots(P.index, P.mask, rho.shape[0]))
    got = kernel_step_vjp(lambda: np, quantum_cpu.launch)(P, rho, ob, dt, dyn)
    tol = 1e-11 if dtype == "complex128" else 2e-4

    def close(a, b, name):
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale, err_msg=name)

    mask = P.mask
    close(got["bar"], bar, "bar")
    close(np.where(mask, got["eps_c_bar"], 0), np.where(mask, acc["eps_c"], 0), "eps_c_bar")
    assert not got["eps_c_bar"][~mask].any()  # masked slots get nothing
    J = spin_generators(d)
    phi_bar = frames_vjp(transports_vjp(acc["M"], P.U, P.index), P.fcache, J)
    close(frames_vjp(got["U_bar"], P.fcache, J), phi_bar, "phi (frames through the coupling)")
    close(got["H_bar"], acc["H"], "H_bar")
    close(got["sigma_bar"], acc["sigma"], "sigma_bar")
    close(got["logsig_bar"], acc["logsig"], "logsig_bar")
    if coupling == "C1":
        assert np.abs(phi_bar).max() > 1e-3 and np.abs(bar - x_bar).max() > 1e-3  # the senders' parts count
    close(got["gamma_bar"], acc["gamma"], "dephasing_rate")
    close(got["gamma_th_bar"], acc["gamma_th"], "thermal_rate")
    close(got["dt_bar"], dt_bar, "dt")
    close(-got["D_bar"].sum(), acc["theta"], "gate_threshold")
    close(-(got["D_bar"] * (got["D"] - dyn.gate_threshold)).sum() / dyn.gate_width, acc["tau"], "gate_width")
    if gate != "none":
        assert np.abs(got["D_bar"]).max() > 0


def test_channel_step_vjp_kernel_adds_into_the_accumulators():
    """Given accumulators, the adjoint kernel adds every parameter's cotangent into them (a reverse sweep's
    running sums, no per-step array code): two calls give twice one call's."""
    from vfesim.quantum.kernel_ops import kernel_accumulators, kernel_step_vjp

    P, rho, dyn = channel_case(3, "complex128", "C1", "energy", "soft", "sparse")
    ob = np.broadcast_to(np.eye(3), rho.shape).astype(rho.dtype) * 0.7
    vjp = kernel_step_vjp(lambda: np, quantum_cpu.launch)
    one = vjp(P, rho, ob, 0.3, dyn)
    acc = kernel_accumulators(np, rho.shape[0], P.index.shape[1], 3, rho.dtype)
    for _ in range(2):
        res = vjp(P, rho, ob, 0.3, dyn, acc=acc)
    np.testing.assert_allclose(res["bar"], one["bar"], rtol=1e-14)
    for k in ("H", "sigma", "logsig", "U", "gamma", "gamma_th", "eps_c"):
        assert np.abs(one[f"{k}_bar"]).max() > 0, k
        np.testing.assert_allclose(acc[k], 2 * one[f"{k}_bar"], rtol=1e-13, atol=1e-15, err_msg=k)
