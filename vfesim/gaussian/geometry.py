"""Geometry of Gaussian agents for the integrators (SPEC §2.5), NumPy reference versions.

- Fisher–Rao gradient-flow update: means ``mu - eta Sigma g``, covariances by the affine-invariant
  exponential retraction, frames wrapped into the principal ball (:func:`gradient_flow_update`, the
  NumPy twin of ``vfesim_kernels.update_cpu.gradient_flow_update_cpu``);
- the log-Cholesky chart ``theta`` of a covariance (``Sigma = L L^T``, diagonal stored as ``log L_kk``,
  T = K(K+1)/2 entries, row-major lower triangle), the chain rule into it and a fused Hamiltonian
  kick/drift (:func:`kick_drift`, twin of ``kick_drift_cpu``);
- the Fisher metric in that chart (Riemannian-mass leapfrog).

Fields: means and covariances move in (mean, covariance) blocks (:data:`BLOCKS`), frames on their own.
"""

from __future__ import annotations

import numpy as np
from vfesim_kernels.update_math import PHI_MAX, TWO_PI

from ..state import linalg_named

__all__ = [
    "MOVABLE",
    "BLOCKS",
    "FRAME",
    "PRIORS",
    "retract_spd",
    "wrap_phi",
    "gradient_flow_update",
    "sigma_to_theta",
    "theta_to_L",
    "theta_to_sigma",
    "theta_grad",
    "kick_drift",
    "fisher_metric_theta",
    "fisher_kinetic_theta_grad",
    "NumpyUpdates",
]

# Variables an integrator may move, in the order of the fused update kernels' arguments.
MOVABLE = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
# (mean, covariance) pairs that move together; the first is the belief, the second the prior.
BLOCKS = (("mu_q", "sigma_q"), ("mu_p", "sigma_p"))
FRAME = "phi"
PRIORS = ("mu_p", "sigma_p")


def retract_spd(S: np.ndarray, G: np.ndarray, eta: float, mode: int) -> np.ndarray:
    """Exponential-map retraction for a batch: S, G (N, K, K) -> (N, K, K), SPD.

    A = S^-1/2 dS S^-1/2 with dS = -2 S G S (mode 0), -G (mode 1) or G (mode 2, G is the direction);
    out = S^1/2 expm(eta A) S^1/2, evaluated as B B^T, B = S^1/2 U exp(eta a/2) with A = U diag(a) U^T.
    """
    w, V = np.linalg.eigh(S)
    sq = np.sqrt(w)
    H = (V * (sq if mode == 0 else 1.0 / sq)[:, None, :]) @ np.swapaxes(V, 1, 2)
    coef = -2.0 * eta if mode == 0 else (-eta if mode == 1 else eta)
    A = H @ G @ H
    A = coef * (0.5 * (A + np.swapaxes(A, 1, 2)))
    e, U = np.linalg.eigh(A)
    Sh = (V * sq[:, None, :]) @ np.swapaxes(V, 1, 2)
    B = (Sh @ U) * np.exp(0.5 * e)[:, None, :]
    out = B @ np.swapaxes(B, 1, 2)
    return 0.5 * (out + np.swapaxes(out, 1, 2))


def wrap_phi(phi: np.ndarray) -> np.ndarray:
    """Principal-ball representative (N, 3): phi r / |phi| with r = |phi| reduced mod 2 pi into [-pi, pi]
    (the same rotation); phi itself when |phi| <= pi. Twin of ``update_math.wrap_phi``: an exact
    ``np.fmod``, no loop; |phi| > PHI_MAX or infinite gives NaN (the integrators' guard reports it)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # |phi| = inf gives NaN below
        # Summed in the kernel's order: the same t to the last bit, so the same reduction (float64).
        t = np.sqrt(phi[:, 0] * phi[:, 0] + phi[:, 1] * phi[:, 1] + phi[:, 2] * phi[:, 2])
        big = t > np.pi
        r = np.fmod(t, TWO_PI)
        r = np.where(r > np.pi, r - TWO_PI, r)  # exact (Sterbenz): r in (pi, 2 pi)
        f = np.where(big, np.where(t <= PHI_MAX, r / np.where(big, t, 1.0), np.nan), 1.0)
    return phi * f[:, None]


def gradient_flow_update(
    arrays: dict[str, np.ndarray], direc: dict[str, np.ndarray], eta: np.ndarray, mode: int
) -> dict[str, np.ndarray]:
    """NumPy twin of ``vfesim_kernels.update_cpu.gradient_flow_update_cpu`` (same arguments, by field)."""
    out = {}
    for f, (m, s) in enumerate((("mu_q", "sigma_q"), ("mu_p", "sigma_p"))):
        em, es = float(eta[2 * f]), float(eta[2 * f + 1])  # Python floats keep float32 states float32
        mu, S = arrays[m], arrays[s]
        if em == 0.0:
            out[m] = mu
        elif mode == 0:
            out[m] = mu - em * np.einsum("nab,nb->na", S, direc[m])
        elif mode == 1:
            out[m] = mu - em * direc[m]
        else:
            out[m] = mu + em * direc[m]
        if es == 0.0:
            out[s] = S
        else:  # eigh raises on a non-finite force: name the agent (the step is added by the integrator)
            retract = lambda S, G, es=es: retract_spd(S, G, es, mode)
            out[s] = linalg_named(
                s, "the exponential-map retraction", retract, S, direc[s], labels=(s, f"the force on {s}")
            )
    ep = float(eta[4])
    if ep == 0.0:
        out["phi"] = arrays["phi"]
    else:
        sgn = 1.0 if mode == 2 else -1.0
        out["phi"] = wrap_phi(arrays["phi"] + sgn * ep * direc["phi"])
    return out


# --- log-Cholesky coordinates --------------------------------------------------------------------
def _tril(K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r, c = np.tril_indices(K)
    return r, c, np.flatnonzero(r == c)


# The chart maps and the Fisher metric take any leading batch dims (N, ...): field agents keep their
# grid dims there. Batch axes are indexed with "...", which leaves (N, ...) results bitwise as they were.
def theta_to_L(theta: np.ndarray, K: int) -> np.ndarray:
    """theta (..., T) -> lower-triangular L (..., K, K) with L_kk = exp(theta_kk)."""
    r, c, d = _tril(K)
    L = np.zeros(theta.shape[:-1] + (K, K), theta.dtype)
    L[..., r, c] = theta
    L[..., r[d], c[d]] = np.exp(theta[..., d])
    return L


def theta_to_sigma(theta: np.ndarray, K: int) -> np.ndarray:
    """Sigma = L L^T (..., K, K) from theta (..., T)."""
    L = theta_to_L(theta, K)
    S = L @ np.swapaxes(L, -1, -2)
    return 0.5 * (S + np.swapaxes(S, -1, -2))


def sigma_to_theta(S: np.ndarray) -> np.ndarray:
    """theta (..., T) of an SPD batch S (..., K, K) (Cholesky, log of the diagonal)."""
    K = S.shape[-1]
    r, c, d = _tril(K)
    theta = np.linalg.cholesky(S)[..., r, c]
    theta[..., d] = np.log(theta[..., d])
    return theta


def theta_grad(G: np.ndarray, L: np.ndarray) -> np.ndarray:
    """dF/dtheta (..., T) from the symmetric G = dF/dSigma (..., K, K): dF/dL = 2 G L (lower part),
    times L_kk on the log-diagonal (dL_kk = L_kk dtheta_kk)."""
    K = L.shape[-1]
    r, c, d = _tril(K)
    out = (2.0 * (G @ L))[..., r, c]
    out[..., d] *= L[..., r[d], c[d]]
    return out


def kick_drift(
    x_mu, x_theta, p_mu, p_theta, g_mu, g_sigma, kick, drift, inv_m_mu, inv_m_theta,
    x_phi=None, p_phi=None, g_phi=None, inv_m_phi=1.0, do_phi=False,
):  # fmt: skip
    """NumPy twin of ``vfesim_kernels.update_cpu.kick_drift_cpu``: in place on x and p; returns the new
    Sigma (N, K, K) after a drift, else None."""
    K = x_mu.shape[1]
    if kick != 0.0:
        p_mu -= kick * g_mu
        p_theta -= kick * theta_grad(g_sigma, theta_to_L(x_theta, K))
        if do_phi:
            p_phi -= kick * g_phi
    if drift == 0.0:
        return None
    x_mu += (drift * inv_m_mu) * p_mu
    x_theta += (drift * inv_m_theta) * p_theta
    if do_phi:
        x_phi += (drift * inv_m_phi) * p_phi
    return theta_to_sigma(x_theta, K)


# --- Fisher metric in log-Cholesky coordinates ----------------------------------------------------
def _fisher_columns(L: np.ndarray) -> np.ndarray:
    """C (..., T, K, K): A = L^-1 dL = sum_a v_a C_a, C_a = L^-1 E_a with E_a = e_k e_l^T (l < k) or
    L_kk e_k e_k^T (diagonal)."""
    K = L.shape[-1]
    r, c, d = _tril(K)
    Linv = np.linalg.inv(L)
    C = np.zeros(L.shape[:-2] + (r.size, K, K), L.dtype)
    for a, (k, l) in enumerate(zip(r, c, strict=True)):
        C[..., a, :, l] = Linv[..., :, k] * (L[..., k, k][..., None] if k == l else 1.0)
    return C


def _weights(K: int, dtype) -> np.ndarray:
    W = np.tril(np.ones((K, K), dtype)) + np.eye(K, dtype=dtype)
    return W


def fisher_metric_theta(L: np.ndarray) -> np.ndarray:
    """g (..., T, T) with v^T g v = 1/2 tr(Sigma^-1 dS Sigma^-1 dS) = sum_{k>l} A_kl^2 + 2 sum_k A_kk^2,
    A = L^-1 dL (lower triangular), dL the image of the coordinate velocity v."""
    C = _fisher_columns(L)
    W = _weights(L.shape[-1], L.dtype)
    return np.einsum("...akl,kl,...bkl->...ab", C, W, C)


def fisher_kinetic_theta_grad(L: np.ndarray, v: np.ndarray) -> np.ndarray:
    """d/dtheta of f(theta; v) = v^T g(theta) v at fixed velocity v (..., T) -> (..., T).

    With A = L^-1 Ldot (Ldot: off-diagonal v_kl, diagonal L_kk v_kk) and B = W o A (W = 2 on the diagonal,
    1 below): df = 2<B, dA>, dA = -L^-1 dL A + L^-1 dLdot, so df/dL = -2 L^-T B A^T and
    df/dLdot = 2 L^-T B; dL_kk = L_kk dtheta_kk, dLdot_kk = L_kk v_kk dtheta_kk, dL_kl = dtheta_kl.
    """
    K = L.shape[-1]
    r, c, d = _tril(K)
    Ld = np.zeros_like(L)
    Ld[..., r, c] = v
    Ld[..., r[d], c[d]] = L[..., r[d], c[d]] * v[..., d]
    Linv = np.linalg.inv(L)
    A = np.tril(Linv @ Ld)
    B = _weights(K, L.dtype) * A
    LiB = np.swapaxes(Linv, -1, -2) @ B
    gL = -2.0 * (LiB @ np.swapaxes(A, -1, -2))
    out = gL[..., r, c]
    Lkk = L[..., r[d], c[d]]
    out[..., d] = out[..., d] * Lkk + 2.0 * LiB[..., r[d], c[d]] * Lkk * v[..., d]
    return out


class NumpyUpdates:
    """Integrator update operations of the NumPy backend (the reference twins of the fused kernels)."""

    def __init__(self, K: int):
        self.K = K

    def gradient_flow(self, arrays, direc, eta, mode: int) -> dict:
        return gradient_flow_update(arrays, direc, eta, mode)

    def kick_drift(self, args, sigma, phi_args):
        """:func:`kick_drift` in place; returns the new covariance (``sigma`` when the drift is 0)."""
        S = kick_drift(*args, *phi_args)
        return sigma if S is None else S

    def theta_to_sigma(self, theta):
        return theta_to_sigma(theta, self.K)
