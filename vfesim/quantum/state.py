"""The state Dataset of density-matrix agents (spec/quantum.md §1.2): schema, constructors, validation.

Dims: ``agent``, ``bra``, ``ket`` (= d), ``gauge`` (= 3).
Variables: ``rho`` (agent, bra, ket) complex Hermitian PSD with unit trace (the belief, in the agent's own
frame); ``hamiltonian`` (agent, bra, ket) complex Hermitian (the Gibbs prior's H_i); ``temperature``
(agent) real > 0 (T_i); ``phi`` (agent, gauge) real (frame, U_i = exp(-i phi_i . J)); optional ``outcome``
(agent) integer in [0, d) (the Born term's y_i, needed when lambda_obs > 0).
complex128 states have float64 real variables, complex64 states float32 ones. Rank-deficient rho is legal.

Round-off tolerances (``TOL``, per real precision u = machine epsilon): Hermiticity
``max|X - X^dagger| <= 1000 u max(1, max|X|)``, trace ``|tr rho - 1| <= 1000 u d``, positivity
``lambda_min(rho) >= -1000 u d``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import xarray as xr

from ..arrays import array_module
from ..state import StateError, state_dataset
from .config import DTYPES, QuantumConfig
from .linalg import eigvalsh

__all__ = [
    "VARIABLES",
    "ATTRIBUTES",
    "REQUIRED",
    "REAL_DTYPE",
    "make_state",
    "random_state",
    "validate_state",
    "tolerance",
]

VARIABLES = {
    "rho": ("agent", "bra", "ket"),
    "hamiltonian": ("agent", "bra", "ket"),
    "temperature": ("agent",),
    "phi": ("agent", "gauge"),
    "outcome": ("agent",),
}
# CF attributes of each variable (docs/outputs.md); H_i and T_i share their (dimensionless) unit.
ATTRIBUTES = {
    "rho": {"long_name": "density matrix rho_i (belief, in the agent's frame)", "units": "1"},
    "hamiltonian": {"long_name": "prior Hamiltonian H_i (Gibbs prior exp(-H_i/T_i)/Z)", "units": "1"},
    "temperature": {"long_name": "prior temperature T_i", "units": "1"},
    "phi": {"long_name": "frame phi_i (U_i = exp(-i phi_i . J))", "units": "rad"},
    "outcome": {"long_name": "Born outcome y_i (basis index)", "units": "1"},
}
REQUIRED = ("rho", "hamiltonian", "temperature", "phi")
REAL_DTYPE = {np.dtype(np.complex128): np.dtype(np.float64), np.dtype(np.complex64): np.dtype(np.float32)}


def tolerance(dtype) -> float:
    """Round-off tolerance 1000 u of a complex (or real) dtype (u = machine epsilon of its real part)."""
    return 1000.0 * float(np.finfo(np.dtype(dtype)).eps)


def make_state(
    cfg: QuantumConfig, rho, hamiltonian, temperature, phi, outcome=None, *, validate: bool = True
) -> xr.Dataset:
    """Wrap arrays into the state Dataset; attrs carry the family, config JSON, version and dtype."""
    data = {"rho": rho, "hamiltonian": hamiltonian, "temperature": temperature, "phi": phi}
    if outcome is not None:
        data["outcome"] = outcome
    ds = state_dataset("quantum", VARIABLES, data, cfg, rho.dtype, ATTRIBUTES)
    if validate:
        validate_state(ds, cfg)
    return ds


def _haar_unitaries(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    Z = (rng.standard_normal((n, d, d)) + 1j * rng.standard_normal((n, d, d))) / np.sqrt(2)
    Q, R = np.linalg.qr(Z)
    ph = np.diagonal(R, axis1=1, axis2=2)
    return Q * (ph / np.abs(ph))[:, None, :]


def random_state(
    cfg: QuantumConfig,
    n_agents: int,
    seed: int = 0,
    dtype: str | None = None,
    *,
    spectrum_spread: float = 3.0,
    hamiltonian_scale: float = 1.0,
    temperature_range: tuple[float, float] = (0.5, 2.0),
    phi_radius: float = 1.0,
    outcome: bool | None = None,
) -> xr.Dataset:
    """A reproducible random population.

    rho = Q diag(p) Q^dagger with Haar-random Q and p proportional to exp(u), u uniform in
    [0, spectrum_spread] (full rank, lambda_max / lambda_min <= e^spectrum_spread); H = (Z + Z^dagger)/2 times
    hamiltonian_scale / sqrt(d) for complex Gaussian Z; T log-uniform in ``temperature_range``; phi uniform
    in the ball |phi| <= phi_radius; outcomes uniform in [0, d), made when ``outcome`` (default:
    lambda_obs > 0).
    """
    dtype = dtype or cfg.dtype or "complex128"
    if dtype not in DTYPES:
        raise StateError("dtype", f"must be one of {DTYPES}, got {dtype!r}")
    if isinstance(n_agents, bool) or not isinstance(n_agents, (int, np.integer)) or n_agents < 1:
        raise StateError("n_agents", f"must be a positive integer, got {n_agents!r}")
    lo, hi = temperature_range
    if not 0 < lo <= hi < np.inf:
        raise StateError(
            "temperature", f"temperature_range must satisfy 0 < lo <= hi, got {temperature_range}"
        )
    if not (0 <= spectrum_spread < np.inf):
        raise StateError("rho", f"spectrum_spread must be finite and >= 0, got {spectrum_spread}")
    if not 0 <= phi_radius < np.inf:
        raise StateError("phi", f"phi_radius must be finite and >= 0, got {phi_radius}")
    if not cfg.dense and cfg.neighbours.n_agents != n_agents:
        raise StateError(
            "agent", f"config has sparse neighbours for {cfg.neighbours.n_agents} agents, not {n_agents}"
        )
    n, d = int(n_agents), cfg.d
    rng = np.random.default_rng(seed)
    Q = _haar_unitaries(rng, n, d)
    p = np.exp(rng.uniform(0.0, spectrum_spread, size=(n, d)))
    p /= p.sum(axis=1, keepdims=True)
    rho = (Q * p[:, None, :]) @ Q.conj().swapaxes(1, 2)
    rho = 0.5 * (rho + rho.conj().swapaxes(1, 2))
    Z = rng.standard_normal((n, d, d)) + 1j * rng.standard_normal((n, d, d))
    H = (hamiltonian_scale / np.sqrt(d)) * 0.5 * (Z + Z.conj().swapaxes(1, 2))
    T = np.exp(rng.uniform(np.log(lo), np.log(hi), size=n))
    direction = rng.standard_normal((n, 3))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    phi = direction * phi_radius * rng.uniform(size=(n, 1)) ** (1 / 3)
    if outcome is None:
        outcome = cfg.lambda_obs > 0
    y = rng.integers(0, d, size=n) if outcome else None
    real = REAL_DTYPE[np.dtype(dtype)]
    c = lambda a, t: np.ascontiguousarray(a, dtype=t)
    return make_state(cfg, c(rho, dtype), c(H, dtype), c(T, real), c(phi, real), y)


def _first_bad(xp, bad) -> int | None:
    return int(xp.argmax(bad)) if bool(bad.any()) else None


def _check_hermitian(xp, X, name: str, tol: float) -> None:
    n = X.shape[0]
    scale = xp.maximum(xp.abs(X).reshape(n, -1).max(axis=1), 1.0)
    asym = xp.abs(X - X.conj().swapaxes(1, 2)).reshape(n, -1).max(axis=1)
    i = _first_bad(xp, asym > tol * scale)
    if i is not None:
        raise StateError(name, f"is not Hermitian (max |X - X^dagger| = {float(asym[i]):.3g})", agent=i)


def validate_state(
    state: xr.Dataset | Mapping, cfg: QuantumConfig, *, check_spd: bool = True, conditioning: str = "exact"
) -> None:
    """Raise :class:`~vfesim.StateError` naming the variable and agent for the first problem found.

    ``conditioning`` is accepted for the common signature of :func:`vfesim.validate_state` and has no
    effect here: density matrices may be rank-deficient (logs use the depolarising floor).

    Checks presence, dims, shapes and dtypes; finiteness; Hermitian rho and hamiltonian; unit trace;
    temperature > 0; outcome in [0, d); and, with ``check_spd``, rho positive semidefinite (eigenvalues
    >= -tolerance; rank-deficient rho is legal). Tolerances: module docstring.
    """
    is_ds = isinstance(state, xr.Dataset)
    get = (lambda k: state.variables[k].data) if is_ds else (lambda k: state[k])  # no DataArray per access
    names = set(state.data_vars) if is_ds else set(state)
    for k in REQUIRED:
        if k not in names:
            raise StateError(k, "missing from the state")
    unknown = names - set(VARIABLES)
    if unknown:
        raise StateError(sorted(unknown)[0], f"unknown state variable (known: {list(VARIABLES)})")
    if cfg.lambda_obs > 0 and "outcome" not in names:
        raise StateError("outcome", "lambda_obs > 0 needs the Born outcomes y_i in the state")
    rho = get("rho")
    n = rho.shape[0] if rho.ndim else 0
    if n == 0:
        raise StateError("agent", "the state has no agents")
    d = cfg.d
    cdt = np.dtype(rho.dtype)
    if cdt not in REAL_DTYPE:
        raise StateError("rho", f"dtype must be complex64 or complex128, got {cdt}")
    if cfg.dtype is not None and cdt != cfg.dtype:
        raise StateError(
            "rho",
            f"dtype {cdt} differs from the config's dtype {cfg.dtype} (cast the state, or use a config "
            f"with dtype={cdt.name!r} or None)",
        )
    rdt = REAL_DTYPE[cdt]
    expect = {
        "rho": ((n, d, d), cdt),
        "hamiltonian": ((n, d, d), cdt),
        "temperature": ((n,), rdt),
        "phi": ((n, 3), rdt),
        "outcome": ((n,), None),
    }
    for k in sorted(names, key=list(VARIABLES).index):
        a = get(k)
        if is_ds and state.variables[k].dims != VARIABLES[k]:
            raise StateError(k, f"dims must be {VARIABLES[k]}, got {state[k].dims}")
        shape, dt = expect[k]
        if tuple(a.shape) != shape:
            raise StateError(k, f"shape must be {shape} (agents={n}, d={d}), got {tuple(a.shape)}")
        if dt is None:
            if not np.issubdtype(np.dtype(a.dtype), np.integer):
                raise StateError(k, f"dtype must be an integer type, got {a.dtype}")
        elif np.dtype(a.dtype) != dt:
            raise StateError(k, f"dtype must be {dt} (rho is {cdt}), got {a.dtype}")
        xp = array_module(a)
        if dt is not None:
            bad = ~xp.isfinite(a).reshape(n, -1).all(axis=1)
            i = _first_bad(xp, bad)
            if i is not None:
                raise StateError(k, "contains NaN or Inf", agent=i)
    if not cfg.dense and cfg.neighbours.n_agents != n:
        raise StateError(
            "agent",
            f"config has sparse neighbours for {cfg.neighbours.n_agents} agents but the state has {n}",
        )
    xp = array_module(rho)
    tol = tolerance(cdt)
    T = get("temperature")
    i = _first_bad(xp, T <= 0)
    if i is not None:
        raise StateError("temperature", f"must be > 0, got {float(T[i])}", agent=i)
    if "outcome" in names:
        y = get("outcome")
        i = _first_bad(xp, (y < 0) | (y >= d))
        if i is not None:
            raise StateError("outcome", f"must be in [0, {d}), got {int(y[i])}", agent=i)
    _check_hermitian(xp, rho, "rho", tol)
    _check_hermitian(xp, get("hamiltonian"), "hamiltonian", tol)
    tr = rho.diagonal(axis1=1, axis2=2).sum(axis=1)
    i = _first_bad(xp, xp.abs(tr - 1) > tol * d)
    if i is not None:
        raise StateError("rho", f"trace must be 1, got {complex(tr[i]):.6g}", agent=i)
    if check_spd:
        lam_min = eigvalsh(rho)[:, 0]
        i = _first_bad(xp, lam_min < -tol * d)
        if i is not None:
            raise StateError(
                "rho", f"is not positive semidefinite (smallest eigenvalue {float(lam_min[i]):.3g})", agent=i
            )
