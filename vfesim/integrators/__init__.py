"""Integrators looked up by name (SPEC §2.5): ``make_integrator(method, cfg, dt, ...)`` -> Integrator.

Methods: "gradient_flow" (natural-gradient flow; Euclidean and Adam rules as options), the constant-mass
symplectic schemes "symplectic_euler" (order 1), "verlet" (2), "ruth3" (3), "pefrl" (4), and
"riemannian_leapfrog" (Fisher mass, generalized implicit leapfrog, order 2).

Backends: any registered backend (:mod:`vfesim.backends`); each supplies its update operations ("numba":
fused CPU kernels; "cuda": device-resident state and fused CUDA kernels, every method except
"riemannian_leapfrog").
"""

from __future__ import annotations

from ..config import ModelConfig
from ..state import StateError
from .base import Carry, DynamicsError, Integrator
from .gradient_flow import make_gradient_flow
from .hamiltonian import SCHEMES, make_hamiltonian

__all__ = [
    "Carry",
    "DynamicsError",
    "Integrator",
    "ORDERS",
    "available",
    "is_hamiltonian",
    "make_integrator",
]

ORDERS = {"gradient_flow": 1, **{k: v[0] for k, v in SCHEMES.items()}, "riemannian_leapfrog": 2}


def available() -> list[str]:
    """Names accepted by :func:`make_integrator`."""
    return list(ORDERS)


def is_hamiltonian(method: str) -> bool:
    """True for methods whose carries hold momenta (terms gain "kinetic" and "hamiltonian")."""
    return method in ORDERS and method != "gradient_flow"


def make_integrator(
    method: str,
    cfg: ModelConfig,
    dt: float,
    *,
    backend: str = "numpy",
    friction: float = 0.0,
    seed: int = 0,
    **options,
) -> Integrator:
    """The ``init``/``step``/``restore`` triple of ``method``; unknown methods or options raise ValueError."""
    if method not in ORDERS:
        raise ValueError(f"unknown integrator method {method!r}; available: {available()}")
    from ..backends import get
    from ..family import family_of

    fam = family_of(cfg)
    if fam.geometry is None:
        raise NotImplementedError(
            f"integrators: no dynamics for {fam.name!r} agents yet ({type(cfg).__name__}); "
            "evaluate them with vfesim.energy_and_gradient"
        )
    backend = get(backend)  # unknown names raise here; "auto" picks a device (logged)
    dt = float(dt)
    if not (dt > 0 and dt < float("inf")):
        raise ValueError(f"dt must be finite and > 0, got {dt}")
    if getattr(backend, "chunked", False):  # the dask backend: state chunked on the workers
        from .chunked import make_chunked

        integ = make_chunked(method, cfg, dt, backend=backend, friction=friction, seed=seed, **options)
    elif method == "gradient_flow":
        integ = make_gradient_flow(cfg, dt, backend=backend, friction=friction, seed=seed, **options)
    else:
        integ = make_hamiltonian(method, cfg, dt, backend=backend, friction=friction, seed=seed, **options)
    return integ._replace(step=_reporting_step(integ.step))


def _reporting_step(step):
    """Wrap a step so that a StateError raised inside the energy (e.g. a transported covariance that
    fails Cholesky) surfaces as a DynamicsError naming the step, agent and variable."""

    def guarded(carry: Carry) -> Carry:
        try:
            return step(carry)
        except StateError as e:
            msg = str(e).split(": ", 1)[-1]
            raise DynamicsError(carry.step + 1, e.variable, msg, agent=e.agent) from e

    return guarded
