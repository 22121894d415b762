"""The compile-ahead plans (vfesim.backends.cuda_backend.gaussian_jobs) name every kernel a first run
launches, with the argument types its launches pass: under the Numba CUDA simulator each launch's
arguments are typed as numba types them on a GPU, and must be one of the plan's specialisations (a
kernel launched with other types would compile again at its first launch). On a GPU,
tests/test_cuda_gpu.py checks the same through the kernel cache."""

import numba
import pytest
from numba.core import types
from numba.cuda.simulator.kernel import FakeCUDAKernel

import vfesim
from vfesim.backends import cuda_backend as cb
from vfesim.integrators import make_integrator

pytestmark = pytest.mark.cudasim


def _type(a):
    t = numba.typeof(a)
    # the simulator's arrays are host arrays (some read-only views); a device array never is
    return t.copy(readonly=False) if isinstance(t, types.Array) else t


@pytest.fixture
def launches(monkeypatch):
    seen = set()
    call = FakeCUDAKernel.__call__

    def record(self, *args):
        if not self._device:
            seen.add((self.fn, tuple(_type(a) for a in args)))
        return call(self, *args)

    monkeypatch.setattr(FakeCUDAKernel, "__call__", record)
    return seen


@pytest.mark.parametrize(
    "K, dtype, pairs, aggregator",
    [
        (3, "float32", "dense", "softmin"),
        (3, "float64", "sparse", "expected"),
        (9, "float32", "dense", "softmin"),
        (5, "float64", "dense", "expected"),
    ],
)
def test_a_first_run_launches_only_planned_specialisations(launches, K, dtype, pairs, aggregator):
    n = 6
    nbrs = (
        "dense" if pairs == "dense" else vfesim.SparseNeighbours.from_lists([[(i + 1) % n] for i in range(n)])
    )
    cfg = vfesim.ModelConfig(K=K, neighbours=nbrs, aggregator=aggregator, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=n, seed=0, dtype=dtype)
    vfesim.energy_and_gradient(state, cfg, backend="cuda")
    for method in ("verlet", "gradient_flow"):
        integ = make_integrator(method, cfg, 1e-3, backend="cuda", seed=1)
        integ.step(integ.init(state))
    planned = {
        (job.dispatcher().fn, job.argtypes())
        for job in cb.gaussian_jobs(K, dtype, aggregator, pairs == "dense")
    }
    assert launches, "no kernel launched"
    unplanned = [f"{fn.__qualname__}{sig}" for fn, sig in launches - planned]
    assert not unplanned
    assert len(launches & planned) >= len(planned) - 4  # the plan's idle update kernels (adam, ...) aside


@pytest.mark.parametrize(
    "d, dtype, pairs, aggregator",
    [
        (4, "complex128", "dense", "softmin"),
        (3, "complex64", "sparse", "expected"),
        (5, "complex128", "dense", "expected"),
    ],
)
def test_a_first_density_matrix_energy_launches_only_planned_specialisations(
    launches, d, dtype, pairs, aggregator
):
    n = 5
    nbrs = (
        "dense" if pairs == "dense" else vfesim.SparseNeighbours.from_lists([[(i + 1) % n] for i in range(n)])
    )
    cfg = vfesim.QuantumConfig(d=d, neighbours=nbrs, aggregator=aggregator, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=n, seed=0, dtype=dtype)
    vfesim.energy_and_gradient(state, cfg, backend="cuda")
    planned = {
        (job.dispatcher().fn, job.argtypes())
        for job in cb.quantum_jobs(d, dtype, aggregator, pairs == "dense")
    }
    unplanned = [f"{fn.__qualname__}{sig}" for fn, sig in launches - planned]
    assert launches and not unplanned
    assert len(launches & planned) >= len(planned) - 2  # (max |x| of a second-pass float64 may idle)
