"""Unitary steps, Gibbs priors and the thermodynamic gate of density-matrix agents, with adjoints
(spec/quantum.md §3.1, §3.6, §4.1 R1, R2, R6).

One Hermitian eigendecomposition H_i = V diag(lam) V^dag per rollout (:func:`hamiltonian_eig`) serves
every unitary step U_i(t) = V diag(exp(-i lam t)) V^dag (only the phases are re-formed when dt or the
gate g_i changes, t = g_i dt), the Gibbs prior sigma_i = V diag(p) V^dag, p = softmax(-lam/T_i), the
energy-basis dephasing and the adjoints. Shapes: states and H (N, d, d) complex, lam (N, d), T (N,).

Adjoints (cotangents of §0: Hermitian X_bar with dL = tr(X_bar dX)):
- R1 ``rho_out = U rho U^dag``: rho_bar = U^dag rho_bar_out U; with Y = rho U^dag rho_bar_out,
  Y^ = V^dag Y V and f^[1]_kl = (e^{-i lam_k t} - e^{-i lam_l t}) / (lam_k - lam_l) (stable sinc form,
  :func:`.linalg.dd_expi`): H_bar = herm(V (2 Y^ o (f^[1])^T) V^dag) (equal to the spec's
  V (Xi o V^dag C V) V^dag, C = i[G_in, rho_in]); t_bar = tr(H i[rho_bar_out, rho_out]) (§3.6).
- Gibbs: L = log sigma = -H/T - log Z I; with the cotangent M of L (including Dexp(L)^*[sigma_bar] by
  Daleckii–Krein), H_bar = (-M + tr(M) sigma)/T, T_bar = (tr(M H) - tr(M) tr(sigma H))/T^2.
- Gate g = sigmoid((D(x || sigma) - theta)/tau), x = (1 - e) rho + e I/d the floored state (e =
  FLOOR_EPS, spec §2.3): dD/dx = log x - log sigma + I, dD/d(log sigma) = -x.
"""

from __future__ import annotations

import numpy as np

from ..arrays import array_module as _xp
from .energy import floor_eps
from .linalg import dagger, dd_exp, dd_expi, dk, eigh, from_eig, herm, trace

__all__ = [
    "hamiltonian_eig",
    "propagator",
    "newton_schulz",
    "unitary_step",
    "unitary_step_vjp",
    "gibbs",
    "gibbs_vjp",
    "relative_entropy_gibbs",
    "relative_entropy_gibbs_vjp",
    "soft_gate",
    "soft_gate_vjp",
    "hard_gate",
]


def hamiltonian_eig(H):
    """(lam (N, d) ascending, V (N, d, d)) of Hermitian H (N, d, d): once per rollout."""
    return eigh(H)


def newton_schulz(U):
    """One Newton–Schulz step U (3 I - U^dag U)/2 towards the nearest unitary (polar factor), spec §3.1:
    with U^dag U = I + E it leaves U^dag U = I - 3E^2/4 + O(E^3), so the unitarity residual goes from
    |E| to O(|E|^2) + the round-off of the two products (about d u)."""
    xp = _xp(U)
    eye = xp.eye(U.shape[-1], dtype=U.dtype)
    return U @ (1.5 * eye - 0.5 * (dagger(U) @ U))


def propagator(lam, V, t):
    """U(t) = V diag(exp(-i lam t)) V^dag for per-agent times t (N,) (or a scalar).

    complex64: the float32 eigenvectors V are orthonormal only to ~d u_32 (|U^dag U - I| up to 1e-5 at
    d = 64 on the H200, spec §3.1), so U gets one :func:`newton_schulz` step. The adjoints (R1) treat U as
    the exact exponential; the correction is of the order of that round-off."""
    xp = _xp(lam)
    t = xp.asarray(t, dtype=lam.dtype)
    ph = xp.exp(-1j * lam * (t[..., None] if t.ndim else t)).astype(V.dtype)
    U = (V * ph[:, None, :]) @ dagger(V)
    return newton_schulz(U) if U.dtype == np.complex64 else U


def unitary_step(rho, U):
    """herm(U rho U^dag) (the symmetrisation removes round-off anti-Hermitian parts only)."""
    return herm(U @ rho @ dagger(U))


def unitary_step_vjp(rho_bar_out, rho_in, rho_out, U, lam, V, t):
    """Rule R1 -> (rho_bar_in, H_bar, t_bar (N,)): module docstring."""
    xp = _xp(rho_in)
    t = xp.broadcast_to(xp.asarray(t, dtype=lam.dtype), lam.shape[:1])
    Ud = dagger(U)
    rho_bar_in = herm(Ud @ rho_bar_out @ U)
    Y = dagger(V) @ (rho_in @ Ud @ rho_bar_out) @ V
    f1 = t[:, None, None] * dd_expi(lam * t[:, None])
    H_bar = herm(V @ (2.0 * Y * f1.swapaxes(-1, -2).astype(Y.dtype)) @ dagger(V))
    H = from_eig(V, lam)
    comm = rho_bar_out @ rho_out - rho_out @ rho_bar_out
    t_bar = xp.einsum("nkl,nlk->n", H, 1j * comm).real
    return rho_bar_in, H_bar, t_bar


def gibbs(lam, V, T):
    """sigma = exp(-H/T)/Z (N, d, d) with its log-eigenvalues l = -lam/T - log Z and p = exp(l)."""
    xp = _xp(lam)
    a = -lam / T[:, None]
    m = a.max(axis=1, keepdims=True)
    l = a - (m + xp.log(xp.exp(a - m).sum(axis=1, keepdims=True)))
    p = xp.exp(l)
    return from_eig(V, p), l, p


def gibbs_vjp(sigma_bar, logsig_bar, lam, V, T, sigma, l, p):
    """(H_bar, T_bar) from the cotangents of sigma and of log sigma (either may be None)."""
    xp = _xp(lam)
    M = xp.zeros_like(sigma) if logsig_bar is None else logsig_bar
    if sigma_bar is not None:
        M = M + dk(V, dd_exp(l, p).astype(V.dtype), sigma_bar)
    trM = trace(M).real
    Tc = T[:, None, None]
    H_bar = herm(-M + trM[:, None, None] * sigma) / Tc
    H = from_eig(V, lam)
    tr_MH = xp.einsum("nkl,nlk->n", M, H).real
    tr_sH = (p * lam).sum(axis=1)
    return H_bar, (tr_MH - trM * tr_sH) / T**2


def relative_entropy_gibbs(rho, V, l):
    """D(x || sigma) (N,) of the floored x = (1 - e) rho + e I/d and the Gibbs state
    sigma = V diag(e^l) V^dag; returns (D, cache) with cache = (x, log x, log sigma) for the adjoint."""
    xp = _xp(rho)
    d = rho.shape[-1]
    e = floor_eps(rho.dtype)
    x = (1.0 - e) * herm(rho) + (e / d) * xp.eye(d, dtype=rho.dtype)
    s, W = eigh(x)
    if bool((s <= 0).any()):
        i = int(xp.argmax((s <= 0).any(axis=1)))
        raise ValueError(
            f"rho[agent={i}]: not positive semidefinite (floored eigenvalue {float(s[i].min()):.3g})"
        )
    log_x = from_eig(W, xp.log(s))
    log_sigma = from_eig(V, l)
    D = xp.einsum("nkl,nlk->n", x, log_x - log_sigma).real
    return D, (x, log_x, log_sigma)


def relative_entropy_gibbs_vjp(D_bar, cache, dtype):
    """(rho_bar, logsig_bar) of D(x || sigma): rho_bar = (1 - e) D_bar (log x - log sigma + I),
    logsig_bar = -D_bar x."""
    x, log_x, log_sigma = cache
    xp = _xp(x)
    e = floor_eps(dtype)
    c = D_bar[:, None, None]
    rho_bar = (1.0 - e) * c * (log_x - log_sigma + xp.eye(x.shape[-1], dtype=x.dtype))
    return rho_bar, -c * x


def soft_gate(D, theta: float, tau: float):
    """g = sigmoid((D - theta)/tau) in (0, 1) (§3.6): near 1 far from equilibrium, small near it."""
    xp = _xp(D)
    u = (D - theta) / tau
    return 0.5 * (1.0 + xp.tanh(0.5 * u))


def soft_gate_vjp(g_bar, g, tau: float):
    """D_bar = g_bar g (1 - g) / tau."""
    return g_bar * g * (1.0 - g) / tau


def hard_gate(D, theta: float):
    """The seed's discontinuous gate 1[D > theta] (inference only: it has no gradient)."""
    return (D > theta).astype(np.float64) if isinstance(D, np.ndarray) else (D > theta).astype(D.dtype)
