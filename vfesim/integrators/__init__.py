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
    "OPTION_DOCS",
    "ORDERS",
    "available",
    "is_hamiltonian",
    "make_integrator",
    "option_defaults",
    "option_reference",
]

ORDERS = {"gradient_flow": 1, **{k: v[0] for k, v in SCHEMES.items()}, "riemannian_leapfrog": 2}

# Every option of every method (make_integrator's **options; a scenario's integrator.options):
# option -> (type, one-line description). The defaults are the methods' own (option_defaults); the docs'
# option reference is generated from both, and tests/test_docs.py checks that every option has one.
OPTION_DOCS = {
    "rule": (
        '"natural" | "euclidean" | "adam"',
        "gradient_flow direction: Fisher-Rao natural gradient, plain gradient, or Adam moments of it",
    ),
    "step_scale": (
        "table field -> float >= 0",
        "per-field multiplier of dt (mu_q, sigma_q, mu_p, sigma_p, phi; 0 freezes)",
    ),
    "update_priors": ("bool", "move the priors mu_p, sigma_p too"),
    "update_frames": ("bool", "move the frames phi"),
    "adam_beta1": ("float in [0, 1)", 'decay of Adam\'s first moment (rule = "adam")'),
    "adam_beta2": ("float in [0, 1)", 'decay of Adam\'s second moment (rule = "adam")'),
    "adam_eps": ("float > 0", 'Adam\'s eps in m_hat / (sqrt(v_hat) + eps) (rule = "adam")'),
    "mass": (
        "table field -> float > 0",
        "per-field masses M, default 1 each (riemannian_leapfrog: factors of the Fisher metric)",
    ),
    "momenta": (
        '"random" | "zero"',
        "initial momenta p ~ N(0, M) drawn with the run's seed (F can rise at first), or at rest",
    ),
    "fixed_point_tol": ("float > 0", "relative tolerance of the implicit leapfrog's fixed-point iterations"),
    "fixed_point_max_iter": ("int >= 1", "fixed-point iterations before a DynamicsError"),
    "energy": (
        "callable (Python only)",
        "(arrays) -> (terms, grads) replacing the model energy (custom potentials)",
    ),
}


def option_defaults() -> dict[str, dict]:
    """method -> {option: default}: the options each method accepts (unknown ones raise ValueError)."""
    from .gradient_flow import DEFAULTS as FLOW
    from .hamiltonian import DEFAULTS as CONSTANT_MASS
    from .hamiltonian import RIEMANN_DEFAULTS

    out = {"gradient_flow": dict(FLOW)}
    out.update({m: dict(CONSTANT_MASS) for m in SCHEMES})
    out["riemannian_leapfrog"] = dict(RIEMANN_DEFAULTS)
    return out


def option_reference() -> list[tuple[str, str, dict, str]]:
    """Every integrator option, documented: ``(option, type, {method: default}, description)`` in the
    order of :data:`OPTION_DOCS`. An option without an entry there (or an entry no method accepts)
    raises ValueError naming it."""
    by_option: dict[str, dict] = {}
    for method, opts in option_defaults().items():
        for k, v in opts.items():
            by_option.setdefault(k, {})[method] = v
    missing = sorted(set(by_option) - set(OPTION_DOCS))
    stale = sorted(set(OPTION_DOCS) - set(by_option))
    if missing or stale:
        raise ValueError(
            f"vfesim.integrators.OPTION_DOCS: options without a description {missing}, "
            f"descriptions of options no method accepts {stale}"
        )
    return [(k, typ, by_option[k], doc) for k, (typ, doc) in OPTION_DOCS.items()]


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
