"""Lindblad evolution of independent qudits with positivity-preserving integrators (spec/quantum.md §3.3).

    d rho/dt = -i[H, rho] + sum_k (L_k rho L_k^dag - 1/2 {L_k^dag L_k, rho})

per agent, with general jump operators ``jumps`` (N, K, d, d) (or (K, d, d) shared) and/or
computational-basis dephasing at rates gamma_i (L_k = sqrt(gamma_i) |k><k|, k = 0..d-1). Methods:

- "exact": rho(t + dt) = exp(L dt) rho(t) with the d^2 x d^2 Liouvillian (row-major vec:
  vec(A X B) = (A (x) B^T) vec(X)), one :func:`.linalg.expm` per run; d <= 8 (cost O(d^6)).
- "strang": U_{dt/2} o exp(D dt) o U_{dt/2}, U from one eigh of H (§3.1); the dissipative factor is the
  closed-form dephasing channel eps = 1 - exp(-gamma dt) when there are no general jumps (exact), else the
  exponential of the dissipator's superoperator (CPTP). Order 2; exact when the dissipator commutes with H.
- "kraus1", "kraus2": normalised Kraus (Rouchon) steps, completely positive by construction and trace
  preserving after normalisation M~ = M S^{-1/2}, S = sum M^dag M. With G = -iH - 1/2 sum L^dag L:
  order 1: M_0 = I + dt G, M_k = sqrt(dt) L_k;
  order 2 (second-order Dyson expansion of exp(L dt)): M_0 = I + dt G + dt^2 G^2/2,
  M_k = sqrt(dt) (L_k + dt/2 (G L_k + L_k G)), M_kl = dt/sqrt(2) L_k L_l.
"""

from __future__ import annotations

import numpy as np

from ..arrays import array_module as _xp
from .channels import dephase, dephasing_strength
from .linalg import dagger, expm, herm, psd_inv_sqrt
from .unitary import hamiltonian_eig, propagator, unitary_step

__all__ = [
    "METHODS",
    "jump_operators",
    "liouvillian",
    "exact_propagator",
    "kraus_operators",
    "lindblad_evolve",
]

METHODS = ("exact", "strang", "kraus1", "kraus2")
MAX_EXACT_D = 8


def jump_operators(H, jumps=None, dephasing_rate=None):
    """All jump operators (N, K, d, d): the given ``jumps`` then sqrt(gamma_i)|k><k| for k < d."""
    xp = _xp(H)
    n, d = H.shape[0], H.shape[-1]
    parts = []
    if jumps is not None:
        Lj = xp.asarray(jumps, dtype=H.dtype)
        if Lj.ndim == 3:
            Lj = xp.broadcast_to(Lj[None], (n, *Lj.shape))
        if Lj.ndim != 4 or Lj.shape[0] != n or Lj.shape[-2:] != (d, d):
            raise ValueError(f"jumps: must have shape (K, {d}, {d}) or ({n}, K, {d}, {d}), got {Lj.shape}")
        parts.append(Lj)
    if dephasing_rate is not None:
        g = xp.broadcast_to(xp.asarray(dephasing_rate, dtype=H.real.dtype), (n,))
        if bool((g < 0).any()) or not bool(xp.isfinite(g).all()):
            raise ValueError("dephasing_rate: must be finite and >= 0")
        proj = xp.zeros((d, d, d), H.dtype)
        proj[np.arange(d), np.arange(d), np.arange(d)] = 1.0
        parts.append(xp.sqrt(g)[:, None, None, None].astype(H.dtype) * proj[None])
    if not parts:
        return xp.zeros((n, 0, d, d), H.dtype)
    return xp.concatenate(parts, axis=1)


def _kron(A, B):
    n, d = A.shape[0], A.shape[-1]
    return (A[:, :, None, :, None] * B[:, None, :, None, :]).reshape(n, d * d, d * d)


def liouvillian(H, jumps):
    """Row-major Liouvillian superoperator (N, d^2, d^2) of H (N, d, d) and jumps (N, K, d, d)."""
    xp = _xp(H)
    d = H.shape[-1]
    eye = xp.broadcast_to(xp.eye(d, dtype=H.dtype), H.shape)
    Lv = -1j * (_kron(H, eye) - _kron(eye, H.swapaxes(-1, -2)))
    for k in range(jumps.shape[1]):
        L = jumps[:, k]
        LdL = dagger(L) @ L
        Lv = Lv + _kron(L, L.conj()) - 0.5 * _kron(LdL, eye) - 0.5 * _kron(eye, LdL.swapaxes(-1, -2))
    return Lv


def exact_propagator(H, jumps, dt: float):
    """exp(L dt) (N, d^2, d^2); d <= 8."""
    d = H.shape[-1]
    if d > MAX_EXACT_D:
        raise ValueError(f"method 'exact': the Liouvillian propagator is for d <= {MAX_EXACT_D}, got d = {d}")
    return expm(liouvillian(H, jumps) * dt)


def _apply_superop(P, rho):
    n, d = rho.shape[0], rho.shape[-1]
    return herm((P @ rho.reshape(n, d * d, 1)).reshape(n, d, d))


def kraus_operators(H, jumps, dt: float, order: int):
    """Normalised Rouchon Kraus operators (N, m, d, d) of order 1 or 2 (module docstring)."""
    xp = _xp(H)
    n, d = H.shape[0], H.shape[-1]
    eye = xp.eye(d, dtype=H.dtype)
    K = jumps.shape[1]
    G = -1j * H - 0.5 * sum((dagger(jumps[:, k]) @ jumps[:, k] for k in range(K)), xp.zeros_like(H))
    if order == 1:
        ops = [eye + dt * G] + [np.sqrt(dt) * jumps[:, k] for k in range(K)]
    elif order == 2:
        ops = [eye + dt * G + 0.5 * dt**2 * (G @ G)]
        ops += [
            np.sqrt(dt) * (jumps[:, k] + 0.5 * dt * (G @ jumps[:, k] + jumps[:, k] @ G)) for k in range(K)
        ]
        ops += [dt / np.sqrt(2.0) * (jumps[:, k] @ jumps[:, l]) for k in range(K) for l in range(K)]
    else:
        raise ValueError(f"order: must be 1 or 2, got {order!r}")
    M = xp.stack([xp.broadcast_to(m, (n, d, d)) for m in ops], axis=1)
    S = (dagger(M) @ M).sum(axis=1)
    Sm, _ = psd_inv_sqrt(S)
    return M @ Sm[:, None]


def lindblad_evolve(
    rho, H, dt: float, n_steps: int, *, jumps=None, dephasing_rate=None, method: str = "strang"
):
    """Trajectory (n_steps + 1, N, d, d) of independent qudits from rho (N, d, d) (module docstring)."""
    if method not in METHODS:
        raise ValueError(f"method: must be one of {METHODS}, got {method!r}")
    if not dt > 0:
        raise ValueError(f"dt: must be > 0, got {dt}")
    if isinstance(n_steps, bool) or not isinstance(n_steps, (int, np.integer)) or n_steps < 0:
        raise ValueError(f"n_steps: must be an integer >= 0, got {n_steps!r}")
    xp = _xp(rho)
    Ls = jump_operators(H, jumps, dephasing_rate)
    if method == "exact":
        P = exact_propagator(H, Ls, dt)
        advance = lambda r: _apply_superop(P, r)
    elif method == "strang":
        lam, V = hamiltonian_eig(H)
        Uh = propagator(lam, V, 0.5 * dt)
        if jumps is None:
            g = (
                xp.zeros(H.shape[0])
                if dephasing_rate is None
                else xp.broadcast_to(xp.asarray(dephasing_rate), (H.shape[0],))
            )
            eps = dephasing_strength(g.astype(lam.dtype), dt)
            dissipate = lambda r: dephase(r, eps)
        else:
            Pd = expm(liouvillian(xp.zeros_like(H), Ls) * dt)
            dissipate = lambda r: _apply_superop(Pd, r)
        advance = lambda r: unitary_step(dissipate(unitary_step(r, Uh)), Uh)
    else:
        Ms = kraus_operators(H, Ls, dt, 1 if method == "kraus1" else 2)
        advance = lambda r: herm((Ms @ r[:, None] @ dagger(Ms)).sum(axis=1))
    out = [rho]
    for _ in range(n_steps):
        out.append(advance(out[-1]))
    return xp.stack(out)
