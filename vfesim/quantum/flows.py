"""Flows of the free energy over the beliefs of density-matrix agents (spec/quantum.md §3.4, §3.5).

F and its gradient G_i = dF/drho_i (traceless Hermitian) come from
:func:`vfesim.quantum.energy.energy_and_gradient_arrays`; H_i, T_i and phi_i are held fixed.

- Mirror descent (matrix exponentiated gradient, Tsuda–Rätsch–Warmuth; the BKM natural gradient):
  log rho_i <- log x_i - eta G_i, rho_i = exp(.)/tr exp(.), with x_i = (1 - e) rho_i + e I/d the floored
  state (spec §2.3) so the log exists. Every iterate lies in S_d. One step size eta for the whole
  population, chosen by Armijo backtracking: start at eta0 and halve until
  F(rho(eta)) <= F(rho) + c sum_i tr(G_i (rho_i(eta) - rho_i)); the right side is <= F(rho), so F is
  non-increasing. If no eta in eta0 2^-k (k <= max_backtracks) passes, the state is returned unchanged with
  eta = 0 (a stationary point to working precision; recorded, not hidden).
- Lie-midpoint isospectral flow of rho_dot = -i[G(rho), rho] (§3.5, Lie–Poisson flow: dF/dt = 0, spectra
  conserved): rho_half = e^{-i G(rho_n) dt/2} rho_n e^{+i G(rho_n) dt/2},
  rho_{n+1} = e^{-i G(rho_half) dt} rho_n e^{+i G(rho_half) dt}. Spectra are exact (conjugations), the
  drift of F is of order >= 2 in dt.
"""

from __future__ import annotations

from typing import Any

from ..arrays import array_module as _xp
from .config import QuantumConfig
from .energy import NUMPY_OPS, QuantumOps, energy_and_gradient_arrays, floor_eps
from .linalg import dagger, eigh, from_eig, herm

__all__ = ["mirror_descent_step", "lie_midpoint_step"]


def _log_floored(rho):
    xp = _xp(rho)
    d = rho.shape[-1]
    e = floor_eps(rho.dtype)
    s, W = eigh((1.0 - e) * herm(rho) + (e / d) * xp.eye(d, dtype=rho.dtype))
    return from_eig(W, xp.log(s))


def _exp_normalised(A):
    xp = _xp(A)
    a, W = eigh(A)
    a = a - a.max(axis=1, keepdims=True)
    p = xp.exp(a)
    return herm(from_eig(W, p / p.sum(axis=1, keepdims=True)))


def mirror_descent_step(
    arrays: dict[str, Any],
    cfg: QuantumConfig,
    *,
    eta0: float = 1.0,
    armijo_c: float = 1e-4,
    max_backtracks: int = 30,
    ops: QuantumOps = NUMPY_OPS,
    terms: dict | None = None,
    grads: dict | None = None,
) -> tuple[Any, dict[str, float]]:
    """One Armijo mirror-descent step on rho (module docstring) -> (rho_new (N, d, d), info).

    info: ``eta`` (accepted step, 0 if none), ``backtracks``, ``F_old``, ``F_new``. ``terms``/``grads``:
    F and its gradient at ``arrays`` when already known (saves one evaluation).
    """
    if not eta0 > 0:
        raise ValueError(f"eta0: must be > 0, got {eta0}")
    if not 0 < armijo_c < 1:
        raise ValueError(f"armijo_c: must be in (0, 1), got {armijo_c}")
    xp = _xp(arrays["rho"])
    if terms is None or grads is None:
        terms, grads = energy_and_gradient_arrays(arrays, cfg, ops=ops)
    F0 = terms["total"]
    G = grads["rho"]
    rho = arrays["rho"]
    log_x = _log_floored(rho)
    eta = float(eta0)
    for k in range(max_backtracks + 1):
        new = _exp_normalised(log_x - eta * G)
        F1 = energy_and_gradient_arrays({**arrays, "rho": new}, cfg, ops=ops)[0]["total"]
        decrease = float(xp.einsum("nkl,nlk->", G, new - rho).real)
        if F1 <= F0 + armijo_c * decrease:
            return new, {"eta": eta, "backtracks": k, "F_old": F0, "F_new": F1}
        eta *= 0.5
    return rho, {"eta": 0.0, "backtracks": max_backtracks + 1, "F_old": F0, "F_new": F0}


def _conjugate_exp(G, rho, t: float):
    """e^{-i G t} rho e^{+i G t} by eigh of the Hermitian G (N, d, d)."""
    xp = _xp(G)
    g, V = eigh(G)
    U = (V * xp.exp(-1j * g * t).astype(V.dtype)[:, None, :]) @ dagger(V)
    return herm(U @ rho @ dagger(U))


def lie_midpoint_step(
    arrays: dict[str, Any], cfg: QuantumConfig, dt: float, *, ops: QuantumOps = NUMPY_OPS
) -> Any:
    """One Lie-midpoint step of rho_dot = -i[G(rho), rho] (module docstring) -> rho_new (N, d, d)."""
    rho = arrays["rho"]
    G0 = energy_and_gradient_arrays(arrays, cfg, ops=ops)[1]["rho"]
    half = _conjugate_exp(G0, rho, 0.5 * dt)
    G1 = energy_and_gradient_arrays({**arrays, "rho": half}, cfg, ops=ops)[1]["rho"]
    return _conjugate_exp(G1, rho, dt)
