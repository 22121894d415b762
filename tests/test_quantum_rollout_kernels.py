"""Rollouts on a kernel backend (vfesim.quantum.rollout with the numba backend's QuantumOps): Jacobi steps
run forward in the channel step kernel and in reverse in its adjoint kernel (``QuantumOps.step_vjp``, no
tapes); loss and every gradient equal the array code's (NUMPY_OPS) to round-off for both couplings, both
dephasing bases, the soft gate, the thermalising channel, mirror steps, uniform and binomial
checkpointing. The array code itself is checked against finite differences of the oracle in
tests/test_quantum_rollout.py; the CUDA kernels under the simulator in
tests/cudasim/test_quantum_rollout_sim.py."""

import importlib

import numpy as np
import pytest
from vfesim_kernels import quantum_cpu

import vfesim
from vfesim.backends.numba_backend import QUANTUM_JACOBI_MAX_D, QUANTUM_OPS
from vfesim.quantum.channels import causal_window
from vfesim.quantum.energy import NUMPY_OPS
from vfesim.quantum.evolve import QuantumDynamics
from vfesim.quantum.rollout import Schedule, rollout

LOSS = {"born": 1.0, "free_energy": 0.3}

CASES = {
    "C1-computational-thermal-sparse-uniform": dict(
        d=2, dyn=dict(coupling="C1"), window="sparse", scheme=dict(checkpoint_every=2)
    ),
    "C1-energy-soft-dense-binomial": dict(
        d=3, dyn=dict(coupling="C1", dephasing_basis="energy", gate="soft"), window="dense",
        scheme=dict(checkpoints=2),
    ),
    "C2-computational-soft-causal-binomial": dict(
        d=4, dyn=dict(coupling="C2", gate="soft"), window="causal", scheme=dict(checkpoints=3)
    ),
    "C2-energy-positions-uniform": dict(
        d=3, dyn=dict(coupling="C2", dephasing_basis="energy"), window="causal", positions=True,
        scheme=dict(checkpoint_every=3),
    ),
    # Mirror steps without belief alignment: its Hessian-vector product is a central difference (error
    # about 1e-10 relative, docs/quantum-dynamics.md), which would hide the step's round-off.
    "uncoupled-energy-soft-mirror": dict(
        d=2, dyn=dict(coupling="none", dephasing_basis="energy", gate="soft", mirror_steps=1),
        window="dense", scheme=dict(checkpoints=2), lambda_belief=0.0,
    ),
}  # fmt: skip


def _case(d, dyn, window, positions=False, dtype="complex128", n=7, T=4, seed=0, lambda_belief=0.5):
    """(cfg, state, schedule): per-agent dephasing and thermal rates, one dt per step, outcomes with
    unobserved entries; sparse windows are ragged (masked slots, one agent without senders)."""
    rng = np.random.default_rng(seed)
    cfg = vfesim.QuantumConfig(d=d, lambda_belief=lambda_belief, lambda_prior=0.3)
    st = vfesim.random_state(cfg, n, seed=seed + 1, dtype=dtype)
    if window == "sparse":
        lists = [list(rng.choice(np.delete(np.arange(n), i), i % 4, replace=False)) for i in range(n)]
        nb = vfesim.SparseNeighbours.from_lists(lists)
    else:
        nb = causal_window(n, 3) if window == "causal" else "dense"
    dyn = QuantumDynamics(
        coupling_strength=0.4, coupling_length=1.3, neighbours=nb,
        positions=rng.normal(size=(n, 2)) if positions else None,
        dephasing_rate=rng.uniform(0.1, 0.9, n), thermal_rate=rng.uniform(0.05, 0.4, n),
        gate_threshold=0.1, gate_width=0.5, mirror_eta=0.4, max_backtracks=4, **dyn,
    )  # fmt: skip
    sched = Schedule(dyn, rng.uniform(0.15, 0.35, T), T, rng.integers(-1, d, size=(T, n)))
    return cfg, st, sched


def _replays_saved(want, sched) -> int:
    """Forward steps the kernel path does not run (its adjoint needs no tape): the last step of every
    uniform segment, every binomial taped replay; none with mirror steps (their adjoints need inputs)."""
    if sched.dynamics.mirror_steps:
        return 0
    return sched.n_steps if want.stats["scheme"] == "binomial" else want.stats["checkpoints"]


def _assert_same(got, want, rtol):
    assert got.loss == pytest.approx(want.loss, rel=rtol)
    for k, v in want.terms.items():
        assert got.terms[k] == pytest.approx(v, rel=rtol), k
    np.testing.assert_allclose(got.final.rho.values, want.final.rho.values, rtol=0, atol=rtol)
    assert set(got.grads) == set(want.grads)
    for k, b in want.grads.items():
        a, b = np.asarray(got.grads[k]), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, k
        scale = float(np.abs(b).max(initial=0.0))  # 0 (e.g. no coupling): a must be 0 too
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale, err_msg=k)
    assert got.stats["checkpoints"] == want.stats["checkpoints"]
    assert got.stats["max_stored"] <= want.stats["max_stored"]


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_rollout_matches_the_array_code(name):
    c = CASES[name]
    cfg, st, sched = _case(
        c["d"], c["dyn"], c["window"], c.get("positions", False), lambda_belief=c.get("lambda_belief", 0.5)
    )
    want = rollout(st, cfg, sched, loss=LOSS, **c["scheme"])
    got = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, **c["scheme"])
    assert want.stats["step_adjoint"] == "tape" and got.stats["step_adjoint"] == "kernels"
    assert got.stats["forward_steps"] == want.stats["forward_steps"] - _replays_saved(want, sched)
    _assert_same(got, want, 1e-12)
    if sched.dynamics.gate == "soft":
        assert got.grads["gate_threshold"] != 0 and got.grads["gate_width"] != 0


@pytest.mark.parametrize("name", ["C1-energy-soft-dense-binomial", "C2-computational-soft-causal-binomial"])
def test_kernel_rollout_complex64(name):
    c = CASES[name]
    cfg, st, sched = _case(c["d"], c["dyn"], c["window"], dtype="complex64", T=3)
    want = rollout(st, cfg, sched, loss=LOSS, **c["scheme"])
    got = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, **c["scheme"])
    assert got.stats["step_adjoint"] == "kernels" and got.final.rho.dtype == np.complex64
    _assert_same(got, want, 1e-4)


def test_the_kernels_run_every_jacobi_step_and_no_tape(monkeypatch):
    """Forward steps (loss pass and replays; the last step of a segment is not replayed) in the channel
    step kernel, one adjoint kernel per step, and the array code's taped step never called."""
    evolve = importlib.import_module("vfesim.quantum.evolve")  # the package exports evolve(), the function
    c = CASES["C1-computational-thermal-sparse-uniform"]
    cfg, st, sched = _case(c["d"], c["dyn"], c["window"])
    names = {v: k for k, v in quantum_cpu.KERNELS.items()}
    calls = []
    run = quantum_cpu._run
    monkeypatch.setattr(quantum_cpu, "_run", lambda k, *a: (calls.append(names[k]), run(k, *a)))
    monkeypatch.setattr(evolve, "agent_update", lambda *a, **k: pytest.fail("array code step called"))
    res = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, checkpoint_every=2)
    T = sched.n_steps
    assert res.stats["forward_steps"] == 2 * T - 2  # two segments
    assert calls.count("channel_step") == 2 * T - 2 and calls.count("channel_step_vjp") == T


def test_kernel_rollout_is_deterministic_and_independent_of_the_thread_split(monkeypatch):
    c = CASES["C1-energy-soft-dense-binomial"]
    cfg, st, sched = _case(c["d"], c["dyn"], c["window"], n=9)
    one = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, checkpoints=2)
    again = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, checkpoints=2)
    monkeypatch.setattr(quantum_cpu, "MIN_AGENTS_PER_THREAD", 1)
    split = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, checkpoints=2)
    for r in (again, split):
        assert r.loss == one.loss
        for k, g in one.grads.items():
            np.testing.assert_array_equal(r.grads[k], g, err_msg=k)


def test_checkpointing_schemes_agree_on_the_kernel_path():
    c = CASES["C2-computational-soft-causal-binomial"]
    cfg, st, sched = _case(c["d"], c["dyn"], c["window"], T=5)
    ref = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, checkpoint_every=5)
    for scheme in (
        dict(checkpoint_every=1),
        dict(checkpoint_every=2),
        dict(checkpoints=1),
        dict(checkpoints=3),
    ):
        res = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, **scheme)
        assert res.loss == ref.loss, scheme  # deterministic kernels: bitwise the same forward states
        for k, g in ref.grads.items():
            np.testing.assert_array_equal(res.grads[k], g, err_msg=f"{k} {scheme}")


@pytest.mark.parametrize("what", ["gauss_seidel", "large_d"])
def test_the_array_code_runs_where_the_kernels_do_not(what):
    """Gauss–Seidel order and d above the backend's kernel size: the array code's taped step (results as
    NUMPY_OPS, the free energy's stages still the backend's)."""
    d = QUANTUM_JACOBI_MAX_D + 1 if what == "large_d" else 3
    dyn = dict(coupling="C1", order="gauss_seidel") if what == "gauss_seidel" else dict(coupling="C1")
    cfg, st, sched = _case(d, dyn, "causal", n=4, T=2)
    want = rollout(st, cfg, sched, loss=LOSS, checkpoints=2)
    got = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, checkpoints=2)
    assert got.stats["step_adjoint"] == "tape"
    _assert_same(got, want, 1e-12)


def test_forward_only_kernel_rollout():
    c = CASES["C2-energy-positions-uniform"]
    cfg, st, sched = _case(c["d"], c["dyn"], c["window"], c.get("positions", False))
    want = rollout(st, cfg, sched, loss=LOSS, grad=False)
    got = rollout(st, cfg, sched, loss=LOSS, grad=False, ops=QUANTUM_OPS)
    assert got.grads is None and got.stats["forward_steps"] == sched.n_steps
    assert got.loss == pytest.approx(want.loss, rel=1e-12)
    np.testing.assert_allclose(got.final.rho.values, want.final.rho.values, rtol=0, atol=1e-13)


def test_kernel_adjoint_names_the_agent_with_a_degenerate_hamiltonian():
    c = CASES["C2-energy-positions-uniform"]
    cfg, st, sched = _case(c["d"], c["dyn"], c["window"], n=5, T=2)
    st = st.copy(deep=True)
    st["hamiltonian"][2] = np.diag([0.5, 0.5, -1.0])
    for ops in (NUMPY_OPS, QUANTUM_OPS):
        with pytest.raises(ValueError, match=r"^hamiltonian\[agent=2\]: energy-basis dephasing"):
            rollout(st, cfg, sched, loss=LOSS, ops=ops)


def test_kernel_rollout_takes_the_backends_pair_kernels():
    """The free energy of a rollout (and of its mirror steps) runs in the backend's pair kernels that its
    QuantumOps carry, not in the array code's all-pairs reference (which holds N x N arrays and is NumPy
    only: a CuPy rollout with the F loss failed there)."""
    from vfesim.backends import numba_backend

    assert QUANTUM_OPS.pairwise_dense is numba_backend.pairwise_dense
    assert QUANTUM_OPS.pairwise_sparse is numba_backend.pairwise_sparse
    n, d = 5, 3
    cfg = vfesim.QuantumConfig(d=d, lambda_belief=0.5)
    st = vfesim.random_state(cfg, n, seed=4)
    dyn = QuantumDynamics(coupling_strength=0.3, neighbours=causal_window(n, 2), mirror_steps=1)
    sched = Schedule(dyn, 0.2, 2, np.zeros((2, n), np.int64))
    calls = []
    dense = QUANTUM_OPS.pairwise_dense
    ops = QUANTUM_OPS._replace(pairwise_dense=lambda *a: (calls.append(1), dense(*a))[1])
    got = rollout(st, cfg, sched, loss=LOSS, ops=ops)
    want = rollout(st, cfg, sched, loss=LOSS)
    assert calls and got.loss == pytest.approx(want.loss, rel=1e-12)
