"""Numba backend: per-agent and pairwise stages as Numba CPU kernels (SPEC §2.3–2.4).

Arrays stay NumPy arrays on the host. The per-agent stages (frames, features, their adjoint, dF/dphi)
run in :mod:`vfesim_kernels.agent_cpu` through :class:`~vfesim.gaussian.energy.AgentOps` (density-matrix
agents: :mod:`vfesim_kernels.quantum_cpu` through :class:`~vfesim.quantum.energy.QuantumOps`); the pairwise
part in :mod:`vfesim_kernels.pairwise_cpu` (parallel over receiver / sender blocks, deterministic, no
N x N array; field agents' weighted pairs parallel over grid points). Thread count: Numba's
(``NUMBA_NUM_THREADS`` or ``numba.set_num_threads``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from vfesim_kernels import agent_cpu, kernel_cache_dir, quantum_cpu
from vfesim_kernels.pairwise_cpu import pairwise_dense, pairwise_points, pairwise_sparse

from ..gaussian.energy import AgentOps
from ..gaussian.features import agent_features
from ..gaussian.geometry import MOVABLE
from ..gaussian.terms import self_kl
from ..groups import generators
from ..quantum.energy import NUMPY_OPS
from ..quantum.kernel_ops import kernel_ops, sized_ops
from . import Backend
from .numpy_backend import to_device, to_host  # host arrays: nothing to move

__all__ = [
    "BACKEND",
    "FIRST_COMPILE",
    "to_device",
    "to_host",
    "energy_and_gradient",
    "AGENT_OPS",
    "QUANTUM_OPS",
    "NumbaUpdates",
    "SerialUpdates",
]


def _frames(phi, irreps, *, serial: bool = False):
    """R = exp(phi . G) (N, K, K): the algorithm of vfesim.groups.expm_so3, fused per agent."""
    return agent_cpu.frames(phi, generators(irreps), max(irreps), serial)


def _features(mu, sigma, R, name: str = "sigma", *, centre=None, serial: bool = False):
    """agent_features in one kernel (the cache holds what agent_cpu.features_vjp reads). Where a
    transported covariance is not positive definite the NumPy code takes over: it raises the StateError
    naming the agent and ``name`` (its FeatureCache has the fields of agent_cpu's cache, in order)."""
    A, B, c, cache, ok = agent_cpu.features(mu, sigma, R, centre, serial)
    if not ok.all():
        return agent_features(mu, sigma, R, name, centre=centre)
    return A, B, c, cache


def _self_kl(mu_q, sigma_q, mu_p, sigma_p, lam: float, *, serial: bool = False):
    """lam * KL(q_i || p_i) per agent and its gradient in one kernel. The batched NumPy Cholesky and two
    inv calls it replaces took ~1.5 ms of ~7 ms at N = 64, K = 21. Where a covariance is not positive
    definite the NumPy code runs to raise the StateError naming the agent and the covariance."""
    lam_n = np.full(mu_q.shape[0], lam, mu_q.dtype)
    kl, *g, ok = agent_cpu.self_kl(mu_q, sigma_q, mu_p, sigma_p, lam_n, serial)
    if not ok.all():
        self_kl(mu_q, sigma_q, mu_p, sigma_p)
    return (kl, *g)


def agent_ops(serial: bool = False) -> AgentOps:
    """The per-agent stages in the fused CPU kernels: parallel builds above a problem size, or always the
    serial builds (``serial``: the dask backend's tasks, which run on the scheduler's threads)."""
    if not serial:
        return AgentOps(_frames, _features, agent_cpu.features_vjp, agent_cpu.phi_grad, _self_kl)
    return AgentOps(
        partial(_frames, serial=True),
        partial(_features, serial=True),
        partial(agent_cpu.features_vjp, serial=True),
        partial(agent_cpu.phi_grad, serial=True),
        partial(_self_kl, serial=True),
    )


AGENT_OPS = agent_ops()


class NumbaUpdates:
    """Integrator update operations in the fused CPU kernels of :mod:`vfesim_kernels.update_cpu` (one
    ``prange`` pass over agents per step or sub-step)."""

    def __init__(self, K: int):
        from vfesim_kernels import update_cpu

        self.K = K
        self.kernels = update_cpu

    def gradient_flow(self, arrays, direc, eta, mode: int) -> dict:
        out = {k: np.empty_like(arrays[k]) for k in MOVABLE}
        c = np.ascontiguousarray
        self.kernels.gradient_flow_update_cpu(
            *(c(arrays[k]) for k in MOVABLE),
            *(c(direc[k]) for k in MOVABLE),
            np.asarray(eta, np.float64),
            mode,
            *(out[k] for k in MOVABLE),
        )
        return out

    def kick_drift(self, args, sigma, phi_args):
        """``kick_drift_cpu(*args, S, *phi_args)`` in place; returns the new covariance (``sigma``
        itself when the drift is 0). A block without frames passes empty stand-ins."""
        S = np.empty_like(sigma) if args[7] != 0.0 else sigma
        if not phi_args[4]:
            x = args[0][:, :0]
            phi_args = (x, x, x, 1.0, False)
        self.kernels.kick_drift_cpu(*args, S, *phi_args)
        return S

    def theta_to_sigma(self, theta):
        out = np.empty(theta.shape[:1] + (self.K, self.K), theta.dtype)
        self.kernels.theta_to_sigma_cpu(np.ascontiguousarray(theta), self.K, out)
        return out


class _SerialKernels:
    """The serial builds of :mod:`vfesim_kernels.update_cpu` under the parallel builds' names."""

    def __init__(self):
        from vfesim_kernels import update_cpu

        self.gradient_flow_update_cpu = update_cpu.gradient_flow_update_serial
        self.kick_drift_cpu = update_cpu.kick_drift_serial
        self.theta_to_sigma_cpu = update_cpu.theta_to_sigma_serial


class SerialUpdates(NumbaUpdates):
    """:class:`NumbaUpdates` in the serial builds (one thread per call): the update operations of the
    dask backend's per-chunk tasks. Bitwise equal to the parallel builds (the same per-agent code)."""

    def __init__(self, K: int):
        self.K = K
        self.kernels = _SerialKernels()


# Per-agent Jacobi kernels up to d = 8 (as on the GPU); LAPACK's batched eigh (the array code) above.
# Measured on 2 cores: the free energy's fused passes (self + belief, N = 2048) take 0.45x the array code's
# time at d = 4 and 0.55x at 5 (quantum_cpu_stages_stop30.txt), 0.72x at 6 and 0.96x at 8 (run directly,
# kernel_ops over quantum_cpu.launch); the channel-step kernels, which share the limit, take 0.27-1.0x
# the array code's step at d = 5-8, and the kernels' rollout adjoint (no tapes) makes T = 8 rollouts at
# N = 1024 4.2x (d = 6) and 3.4x (d = 8) faster than the taped array code
# (quantum_dynamics_numba_maxd_stop30.txt). (Until stop 30 the limit was 5: the staged kernels' eig_log
# alone took 1.7x NumPy's time at d = 6 and 1.9x at d = 8.)
QUANTUM_JACOBI_MAX_D = 8
QUANTUM_OPS = sized_ops(
    kernel_ops(lambda: np, quantum_cpu.launch, pairwise=(pairwise_dense, pairwise_sparse)),
    NUMPY_OPS,
    QUANTUM_JACOBI_MAX_D,
)

# Per family, its per-agent stages in the serial builds (the dask backend's inner "numba" tasks: each
# task runs in one of the scheduler's threads, with no threads of its own).
SERIAL_OPS = {
    "gaussian": agent_ops(serial=True),
    "quantum": sized_ops(kernel_ops(lambda: np, quantum_cpu.launch_serial), NUMPY_OPS, QUANTUM_JACOBI_MAX_D),
}

log = logging.getLogger("vfesim")


class FirstCompile:
    """Announces (log INFO) the first use in a process of the CPU kernels while the on-disk kernel cache
    holds none of them: compiling them takes about 30 s on a fresh machine (a later process loads them from
    the cache; an edit of ``kernels/`` starts a new cache folder, so compiles them once more)."""

    def __init__(self):
        self.done = False

    def begin(self) -> float | None:
        if self.done:
            return None
        self.done = True
        cache = kernel_cache_dir()
        if cache is None or any(Path(cache).rglob("*_cpu.*.nbi")):  # numba's index files of the CPU kernels
            return None
        log.info(
            "compiling the CPU kernels for their first use (about 30 s on a fresh machine; cached in %s "
            "for later processes)",
            cache,
        )
        return time.perf_counter()

    @staticmethod
    def end(started: float | None) -> None:
        if started is not None:
            log.info("CPU kernels ready in %.1f s", time.perf_counter() - started)


FIRST_COMPILE = FirstCompile()


@dataclass(frozen=True)
class NumbaBackend(Backend):
    """The numba :class:`Backend`: its first energy evaluation in a process with an empty kernel cache is
    announced (:class:`FirstCompile`)."""

    def energy_and_gradient(self, arrays: dict, cfg) -> tuple[dict, dict]:
        started = FIRST_COMPILE.begin()
        try:
            return super().energy_and_gradient(arrays, cfg)
        finally:
            FIRST_COMPILE.end(started)


BACKEND = NumbaBackend(
    name="numba",
    array_module=lambda: np,
    to_device=to_device,
    to_host=to_host,
    pairwise_dense=pairwise_dense,
    pairwise_sparse=pairwise_sparse,
    updates=NumbaUpdates,
    agent_ops={"gaussian": AGENT_OPS, "quantum": QUANTUM_OPS},
    pairwise_points=pairwise_points,
)


def energy_and_gradient(arrays: dict, cfg) -> tuple[dict, dict]:
    """Terms and gradients (SPEC §2.2–2.3) of NumPy arrays, per-agent and pairwise work in Numba kernels."""
    return BACKEND.energy_and_gradient(arrays, cfg)
