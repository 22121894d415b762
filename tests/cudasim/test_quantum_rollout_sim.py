"""Rollouts on the cuda backend under the Numba CUDA simulator: the Jacobi steps run in the CUDA channel
step kernel forward and in its adjoint kernel in reverse (``QuantumOps.step_vjp``, no tapes); loss and
every gradient equal the array code's (NUMPY_OPS). The same on the CPU kernels, with more cases:
tests/test_quantum_rollout_kernels.py."""

import numpy as np
import pytest

import vfesim
from vfesim.backends.cuda_backend import QUANTUM_OPS
from vfesim.quantum.channels import causal_window
from vfesim.quantum.evolve import QuantumDynamics
from vfesim.quantum.rollout import Schedule, rollout

pytestmark = pytest.mark.cudasim

LOSS = {"born": 1.0, "free_energy": 0.3}


@pytest.mark.parametrize(
    "d, dtype, dyn, scheme, rtol",
    [(2, "complex128", dict(coupling="C1", gate="soft"), dict(checkpoint_every=1), 1e-12),
     (3, "complex128", dict(coupling="C2", dephasing_basis="energy", neighbours="ragged"),
      dict(checkpoints=1), 1e-12),
     (2, "complex64", dict(coupling="C1", dephasing_basis="energy", gate="soft"), dict(checkpoints=2), 1e-4)],
)  # fmt: skip
def test_cuda_rollout_matches_the_array_code(d, dtype, dyn, scheme, rtol):
    n, T = 4, 2
    rng = np.random.default_rng(d)
    cfg = vfesim.QuantumConfig(d=d, lambda_belief=0.5, lambda_prior=0.3)
    st = vfesim.random_state(cfg, n, seed=1, dtype=dtype)
    # ragged: lists with masked slots and an agent without senders
    nb = vfesim.SparseNeighbours.from_lists([[1, 3], [0], [], [2, 0, 1]]) if "neighbours" in dyn else None
    dyn = QuantumDynamics(
        coupling_strength=0.4, neighbours=nb or causal_window(n, 2), dephasing_rate=rng.uniform(0.1, 0.9, n),
        thermal_rate=rng.uniform(0.05, 0.4, n), gate_threshold=0.1, gate_width=0.5,
        **{k: v for k, v in dyn.items() if k != "neighbours"},
    )  # fmt: skip
    sched = Schedule(dyn, [0.3, 0.2], T, rng.integers(-1, d, size=(T, n)))
    want = rollout(st, cfg, sched, loss=LOSS, **scheme)
    got = rollout(st, cfg, sched, loss=LOSS, ops=QUANTUM_OPS, **scheme)
    assert want.stats["step_adjoint"] == "tape" and got.stats["step_adjoint"] == "kernels"
    # no tapes: no replay of the last step of a uniform segment nor of a binomial step before its adjoint
    saved = T if "checkpoints" in scheme else want.stats["checkpoints"]
    assert got.stats["forward_steps"] == want.stats["forward_steps"] - saved
    assert got.loss == pytest.approx(want.loss, rel=rtol)
    for k, b in want.grads.items():
        a, b = np.asarray(got.grads[k]), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, k
        np.testing.assert_allclose(a, b, rtol=0, atol=rtol * float(np.abs(b).max(initial=0.0)), err_msg=k)
