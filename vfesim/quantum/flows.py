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

Adjoint of an accepted mirror step (rule R9, spec §4.1), :func:`mirror_descent_step_vjp`. With
A = log x(rho) - eta G(rho), rho' = exp(A)/tr exp(A), A = W diag(a) W^dag, p = softmax(a):

    A_bar   = W (K o W^dag rho'_bar W) W^dag - tr(rho' rho'_bar) rho',   K = exp^[1](a - logsumexp a)
    rho_bar = (1 - e) herm(Dlog(x)[A_bar]) + Hess F [P0 G_bar],          G_bar = -eta A_bar

(the (P1) rule of §1.2 and Daleckii–Krein of log; P0 the traceless projection). The step size eta is piecewise
constant in the inputs (Armijo picks it from a discrete set), so it carries no cotangent: the gradient is
exact wherever eta does not jump. The Hessian-vector product and the cross terms of G with H, T, phi
(d/ds grad_theta F(rho + s P0 G_bar), by the symmetry of mixed partials):
- self term G = (1 - e) P0 lambda (log x - log sigma): with v = (1 - e) P0 G_bar,
  rho_bar += (1 - e) lambda Dlog(x)[v], (log sigma)_bar = -lambda v (then the Gibbs adjoint, R6);
- observation term G = -(1 - e) P0 lambda E_yy / x_yy: x_bar_yy += lambda v_yy / x_yy^2;
- belief alignment: central difference of its exact gradient (rho and phi) along P0 G_bar,
  h = min(1e-5, lambda_min(x)/10) / |P0 G_bar|_F (error O(h^2) + O(u/h), about 1e-10 relative; the
  closed form needs second divided differences and the softmin Hessian: not written);
- prior alignment does not depend on rho: no contribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..arrays import array_module as _xp
from .config import QuantumConfig
from .energy import NUMPY_OPS, QuantumOps, energy_and_gradient_arrays, floor_eps
from .linalg import dagger, dd_exp, dd_log, dk, eigh, from_eig, herm, traceless

__all__ = ["mirror_descent_step", "mirror_descent_step_vjp", "lie_midpoint_step"]


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
    energy: Callable | None = None,
) -> tuple[Any, dict[str, float]]:
    """One Armijo mirror-descent step on rho (module docstring) -> (rho_new (N, d, d), info).

    info: ``eta`` (accepted step, 0 if none), ``backtracks``, ``F_old``, ``F_new``. ``terms``/``grads``:
    F and its gradient at ``arrays`` when already known (saves one evaluation). ``energy``: arrays ->
    (terms, grads) of cfg (default :func:`.energy.energy_and_gradient_arrays` with ``ops``; a run passes
    its backend's, e.g. with the backend's pair kernels).
    """
    if energy is None:
        energy = lambda a: energy_and_gradient_arrays(a, cfg, ops=ops)
    if not eta0 > 0:
        raise ValueError(f"eta0: must be > 0, got {eta0}")
    if not 0 < armijo_c < 1:
        raise ValueError(f"armijo_c: must be in (0, 1), got {armijo_c}")
    xp = _xp(arrays["rho"])
    if terms is None or grads is None:
        terms, grads = energy(arrays)
    F0 = terms["total"]
    G = grads["rho"]
    rho = arrays["rho"]
    log_x = _log_floored(rho)
    eta = float(eta0)
    for k in range(max_backtracks + 1):
        new = _exp_normalised(log_x - eta * G)
        F1 = energy({**arrays, "rho": new})[0]["total"]
        decrease = float(xp.einsum("nkl,nlk->", G, new - rho).real)
        if F1 <= F0 + armijo_c * decrease:
            return new, {"eta": eta, "backtracks": k, "F_old": F0, "F_new": F1}
        eta *= 0.5
    return rho, {"eta": 0.0, "backtracks": max_backtracks + 1, "F_old": F0, "F_new": F0}


def mirror_descent_step_vjp(
    rho_bar_out, arrays: dict[str, Any], cfg: QuantumConfig, eta: float, *, ops: QuantumOps = NUMPY_OPS
) -> dict[str, Any]:
    """Rule R9 (module docstring): cotangents of an accepted mirror step with step size ``eta`` taken from
    ``arrays`` (rho the state before the step) given the cotangent ``rho_bar_out`` (N, d, d) of the state
    after it -> {"rho": (N, d, d), "log_sigma": (N, d, d) cotangent of log sigma_i, "phi": (N, 3) or None}.

    eta = 0 (no step accepted) is the identity map. The caller turns ``log_sigma`` into H and T
    cotangents with :func:`.unitary.gibbs_vjp`.
    """
    xp = _xp(rho_bar_out)
    rho = arrays["rho"]
    if eta == 0:
        return {"rho": rho_bar_out, "log_sigma": xp.zeros_like(rho), "phi": None}
    n, d = rho.shape[0], rho.shape[-1]
    e = floor_eps(rho.dtype)
    x = (1.0 - e) * herm(rho) + (e / d) * xp.eye(d, dtype=rho.dtype)
    s, Wx = eigh(x)
    log_x = from_eig(Wx, xp.log(s))
    G = energy_and_gradient_arrays(arrays, cfg, ops=ops)[1]["rho"]
    a, W = eigh(log_x - eta * G)
    lse = a.max(axis=1, keepdims=True)
    lse = lse + xp.log(xp.exp(a - lse).sum(axis=1, keepdims=True))
    l = a - lse
    p = xp.exp(l)
    new = from_eig(W, p)
    rb = herm(rho_bar_out)
    A_bar = dk(W, dd_exp(l, p).astype(W.dtype), rb) - (
        xp.einsum("nkl,nlk->n", new, rb).real[:, None, None] * new
    )
    dlog = dd_log(s).astype(Wx.dtype)
    x_bar = dk(Wx, dlog, A_bar)
    G_bar = -eta * A_bar
    v = (1.0 - e) * traceless(herm(G_bar))
    logsig_bar = xp.zeros_like(rho)
    if cfg.lambda_self > 0:
        x_bar = x_bar + cfg.lambda_self * dk(Wx, dlog, v)
        logsig_bar = -cfg.lambda_self * v
    if cfg.lambda_obs > 0:
        y = xp.asarray(arrays["outcome"])
        idx = xp.arange(n)
        x_bar[idx, y, y] += cfg.lambda_obs * v[idx, y, y].real / x[idx, y, y].real ** 2
    rho_bar = (1.0 - e) * herm(x_bar)
    phi_bar = None
    if cfg.lambda_belief > 0:
        direction = traceless(herm(G_bar))
        norm = float(xp.sqrt((xp.abs(direction) ** 2).sum()))
        if norm > 0:
            h = min(1e-5, 0.1 * float(s.min())) / norm
            bcfg = cfg.replace(lambda_self=0.0, lambda_prior=0.0, lambda_obs=0.0)
            gp = energy_and_gradient_arrays({**arrays, "rho": rho + h * direction}, bcfg, ops=ops)[1]
            gm = energy_and_gradient_arrays({**arrays, "rho": rho - h * direction}, bcfg, ops=ops)[1]
            rho_bar = rho_bar + (gp["rho"] - gm["rho"]) / (2 * h)
            phi_bar = (gp["phi"] - gm["phi"]) / (2 * h)
    return {"rho": rho_bar, "log_sigma": logsig_bar, "phi": phi_bar}


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
