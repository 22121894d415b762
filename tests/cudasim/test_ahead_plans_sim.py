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


def _neighbours(pairs: str, n: int):
    ring = [[(i + 1) % n] for i in range(n)]
    return "dense" if pairs == "dense" else vfesim.SparseNeighbours.from_lists(ring)


def _assert_planned(launches, jobs, idle: int) -> None:
    """Every launch one of the plan's specialisations; at most ``idle`` planned ones not launched."""
    planned = {(job.dispatcher().fn, job.argtypes()) for job in jobs}
    unplanned = [f"{fn.__qualname__}{sig}" for fn, sig in launches - planned]
    assert launches and not unplanned
    assert len(launches & planned) >= len(planned) - idle


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
    cfg = vfesim.ModelConfig(K=K, neighbours=_neighbours(pairs, n), aggregator=aggregator, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=n, seed=0, dtype=dtype)
    vfesim.energy_and_gradient(state, cfg, backend="cuda")
    for method in ("verlet", "gradient_flow"):
        integ = make_integrator(method, cfg, 1e-3, backend="cuda", seed=1)
        integ.step(integ.init(state))
    # idle: update kernels of other integrators (adam, ...)
    _assert_planned(launches, cb.gaussian_jobs(K, dtype, aggregator, pairs == "dense"), idle=4)


@pytest.mark.parametrize(
    "d, dtype, pairs, aggregator",
    [
        (4, "complex128", "dense", "softmin"),
        (3, "complex64", "sparse", "expected"),
        (5, "complex128", "dense", "expected"),
        (6, "complex64", "dense", "softmin"),  # the cooperative eigh between energy_mats and energy_finish
    ],
)
def test_a_first_density_matrix_energy_launches_only_planned_specialisations(
    launches, d, dtype, pairs, aggregator
):
    # (d = 4, dense: enough agents for two sender slices of the tensor-core kernels, whose partial sums the
    # plan's fold kernel adds)
    n = 36 if (d, pairs) == (4, "dense") else 5
    cfg = vfesim.QuantumConfig(d=d, neighbours=_neighbours(pairs, n), aggregator=aggregator, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=n, seed=0, dtype=dtype)
    vfesim.energy_and_gradient(state, cfg, backend="cuda")
    # idle: max |x| (host under the simulator)
    _assert_planned(launches, cb.quantum_jobs(d, dtype, aggregator, pairs == "dense"), idle=2)
