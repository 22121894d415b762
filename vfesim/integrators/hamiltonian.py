"""Hamiltonian dynamics on the free energy (SPEC §2.5): symplectic composition schemes and a Riemannian
(Fisher-mass) generalized leapfrog.

Phase space: unconstrained coordinates x = (mu_q, theta_q, phi[, mu_p, theta_p]) where theta is the
log-Cholesky vector of Sigma = L L^T (T = K(K+1)/2 entries, row-major lower triangle, diagonal stored as
log L_kk), momenta p of the same shapes. ``H = 1/2 p^T M^-1 p + F(x)``.

Constant mass (methods "symplectic_euler", "verlet", "ruth3", "pefrl"): M = diag of per-field masses. One
composition stepper runs a table of (kick b_i, drift a_i) pairs: p -= b_i dt dF/dx, then
x += a_i dt M^-1 p. Friction gamma >= 0 damps momenta exactly, p *= exp(-gamma dt/2), before and after the
composition (a symmetric conformal splitting).

Riemannian mass (method "riemannian_leapfrog"): the Fisher metric of the Gaussian in these coordinates,
M_mu = m_mu Sigma^-1 and M_theta = m_theta g(theta) with g(v, v) = 1/2 tr(Sigma^-1 dSigma Sigma^-1 dSigma),
frames with constant mass; integrated with the generalized leapfrog (Girolami & Calderhead 2011, eq. 16-18):
p' = p - dt/2 dH/dx(x, p') [fixed point], x' = x + dt/2 (dH/dp(x, p') + dH/dp(x', p')) [fixed point],
p'' = p' - dt/2 dH/dx(x', p').

Frames are not wrapped into the principal ball here: that jump would be a non-smooth change of chart.

Options (unknown ones raise ValueError):
  mass: dict field -> mass (> 0) for mu_q, sigma_q, mu_p, sigma_p, phi (default 1).
  momenta: "random" (default: p ~ N(0, M) drawn with the seed) or "zero".
  update_priors (False): include mu_p, Sigma_p in the phase space. update_frames (True): include phi.
  energy: a callable (arrays) -> (terms, grads) replacing the model energy (custom potentials, tests).
  fixed_point_tol (1e-12), fixed_point_max_iter (100): riemannian_leapfrog only; the iteration stops when
      max|change| <= tol * (1 + max|value|) and raises DynamicsError if it has not after max_iter.

Backend "cuda" (constant-mass schemes): positions, log-Cholesky coordinates and momenta stay on the device;
each (kick, drift) pair is one fused kernel per block (``vfesim_kernels.update_cuda``); the initial
momenta are drawn on the host (the same draws as on the CPU backends) and uploaded once.
"""

from __future__ import annotations

import math

import numpy as np
import xarray as xr

from ..config import ModelConfig
from ..state import validate_state
from .base import (
    Carry,
    DynamicsError,
    Integrator,
    check_fields,
    check_options,
    energy_fn,
    guard_state,
    guard_terms,
    make_restore,
    state_arrays,
    with_arrays,
)
from .device import Device, host_array

__all__ = [
    "SCHEMES",
    "make_hamiltonian",
    "sigma_to_theta",
    "theta_to_L",
    "theta_to_sigma",
    "theta_grad",
    "kick_drift",
    "fisher_metric_theta",
    "fisher_kinetic_theta_grad",
]

# Omelyan, Mryglod & Folk, Comput. Phys. Commun. 146, 188 (2002), PEFRL.
_XI = 0.1786178958448091
_LAM = -0.2123418310626054
_CHI = -0.06626458266981849

# name -> (order, ((kick b_i, drift a_i), ...)); each pair is "kick, then drift".
SCHEMES: dict[str, tuple[int, tuple[tuple[float, float], ...]]] = {
    "symplectic_euler": (1, ((1.0, 1.0),)),
    "verlet": (2, ((0.5, 1.0), (0.5, 0.0))),
    # Ruth (1983): drifts (1, -2/3, 2/3), kicks (-1/24, 3/4, 7/24), drift first.
    "ruth3": (3, ((0.0, 1.0), (-1.0 / 24.0, -2.0 / 3.0), (0.75, 2.0 / 3.0), (7.0 / 24.0, 0.0))),
    "pefrl": (
        4,
        (
            (0.0, _XI),
            ((1.0 - 2.0 * _LAM) / 2.0, _CHI),
            (_LAM, 1.0 - 2.0 * (_CHI + _XI)),
            (_LAM, _CHI),
            ((1.0 - 2.0 * _LAM) / 2.0, _XI),
        ),
    ),
}
FIELDS = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
DEFAULTS = {
    "mass": None,
    "momenta": "random",
    "update_priors": False,
    "update_frames": True,
    "energy": None,
}
RIEMANN_DEFAULTS = {**DEFAULTS, "fixed_point_tol": 1e-12, "fixed_point_max_iter": 100}
_CACHE = "_vfesim_force"


# --- log-Cholesky coordinates --------------------------------------------------------------------
def _tril(K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r, c = np.tril_indices(K)
    return r, c, np.flatnonzero(r == c)


def theta_to_L(theta: np.ndarray, K: int) -> np.ndarray:
    """theta (N, T) -> lower-triangular L (N, K, K) with L_kk = exp(theta_kk)."""
    r, c, d = _tril(K)
    L = np.zeros(theta.shape[:1] + (K, K), theta.dtype)
    L[:, r, c] = theta
    L[:, r[d], c[d]] = np.exp(theta[:, d])
    return L


def theta_to_sigma(theta: np.ndarray, K: int) -> np.ndarray:
    """Sigma = L L^T (N, K, K) from theta (N, T)."""
    L = theta_to_L(theta, K)
    S = L @ np.swapaxes(L, 1, 2)
    return 0.5 * (S + np.swapaxes(S, 1, 2))


def sigma_to_theta(S: np.ndarray) -> np.ndarray:
    """theta (N, T) of an SPD batch S (N, K, K) (Cholesky, log of the diagonal)."""
    K = S.shape[-1]
    r, c, d = _tril(K)
    theta = np.linalg.cholesky(S)[:, r, c]
    theta[:, d] = np.log(theta[:, d])
    return theta


def theta_grad(G: np.ndarray, L: np.ndarray) -> np.ndarray:
    """dF/dtheta (N, T) from the symmetric G = dF/dSigma (N, K, K): dF/dL = 2 G L (lower part),
    times L_kk on the log-diagonal (dL_kk = L_kk dtheta_kk)."""
    K = L.shape[-1]
    r, c, d = _tril(K)
    out = (2.0 * (G @ L))[:, r, c]
    out[:, d] *= L[:, r[d], c[d]]
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
    """C (N, T, K, K): A = L^-1 dL = sum_a v_a C_a, C_a = L^-1 E_a with E_a = e_k e_l^T (l < k) or
    L_kk e_k e_k^T (diagonal)."""
    N, K, _ = L.shape
    r, c, d = _tril(K)
    Linv = np.linalg.inv(L)
    C = np.zeros((N, r.size, K, K), L.dtype)
    for a, (k, l) in enumerate(zip(r, c, strict=True)):
        C[:, a, :, l] = Linv[:, :, k] * (L[:, k, k][:, None] if k == l else 1.0)
    return C


def _weights(K: int, dtype) -> np.ndarray:
    W = np.tril(np.ones((K, K), dtype)) + np.eye(K, dtype=dtype)
    return W


def fisher_metric_theta(L: np.ndarray) -> np.ndarray:
    """g (N, T, T) with v^T g v = 1/2 tr(Sigma^-1 dS Sigma^-1 dS) = sum_{k>l} A_kl^2 + 2 sum_k A_kk^2,
    A = L^-1 dL (lower triangular), dL the image of the coordinate velocity v."""
    C = _fisher_columns(L)
    W = _weights(L.shape[-1], L.dtype)
    return np.einsum("nakl,kl,nbkl->nab", C, W, C)


def fisher_kinetic_theta_grad(L: np.ndarray, v: np.ndarray) -> np.ndarray:
    """d/dtheta of f(theta; v) = v^T g(theta) v at fixed velocity v (N, T) -> (N, T).

    With A = L^-1 Ldot (Ldot: off-diagonal v_kl, diagonal L_kk v_kk) and B = W o A (W = 2 on the diagonal,
    1 below): df = 2<B, dA>, dA = -L^-1 dL A + L^-1 dLdot, so df/dL = -2 L^-T B A^T and
    df/dLdot = 2 L^-T B; dL_kk = L_kk dtheta_kk, dLdot_kk = L_kk v_kk dtheta_kk, dL_kl = dtheta_kl.
    """
    K = L.shape[-1]
    r, c, d = _tril(K)
    Ld = np.zeros_like(L)
    Ld[:, r, c] = v
    Ld[:, r[d], c[d]] = L[:, r[d], c[d]] * v[:, d]
    Linv = np.linalg.inv(L)
    A = np.tril(Linv @ Ld)
    B = _weights(K, L.dtype) * A
    LiB = np.swapaxes(Linv, 1, 2) @ B
    gL = -2.0 * (LiB @ np.swapaxes(A, 1, 2))
    out = gL[:, r, c]
    Lkk = L[:, r[d], c[d]]
    out[:, d] = out[:, d] * Lkk + 2.0 * LiB[:, r[d], c[d]] * Lkk * v[:, d]
    return out


# --- integrators ---------------------------------------------------------------------------------
def _blocks(opt) -> tuple[tuple[str, str], ...]:
    return (("mu_q", "sigma_q"),) + ((("mu_p", "sigma_p"),) if opt["update_priors"] else ())


def _momentum_names(blocks, frames: bool) -> tuple[str, ...]:
    names = []
    for m, s in blocks:
        names += [f"p_{m}", f"p_{s}"]
        if frames and m == "mu_q":
            names.append("p_phi")
    return tuple(names)


def _sq(a: np.ndarray) -> float:
    # einsum, not vdot: a BLAS dot wakes BLAS threads, which costs milliseconds on a busy machine.
    a = a.reshape(-1)
    return float(np.einsum("i,i->", a, a))


def _kinetic_const(aux, inv_m) -> float:
    return sum(0.5 * inv_m[k[2:]] * _sq(aux[k]) for k in aux if k.startswith("p_"))


def make_hamiltonian(
    method: str,
    cfg: ModelConfig,
    dt: float,
    *,
    backend: str = "numpy",
    friction: float = 0.0,
    seed: int = 0,
    **options,
) -> Integrator:
    """Build a Hamiltonian integrator (a scheme of :data:`SCHEMES` or ``"riemannian_leapfrog"``)."""
    riemann = method == "riemannian_leapfrog"
    opt = check_options(method, options, RIEMANN_DEFAULTS if riemann else DEFAULTS)
    if riemann and backend == "cuda":
        raise ValueError(
            "method 'riemannian_leapfrog' runs on the 'numpy' and 'numba' backends only, not 'cuda' "
            "(use a constant-mass scheme: symplectic_euler, verlet, ruth3, pefrl)"
        )
    friction = float(friction)
    if not (math.isfinite(friction) and friction >= 0):
        raise ValueError(f"method {method!r}: friction must be finite and >= 0, got {friction}")
    if opt["momenta"] not in ("random", "zero"):
        raise ValueError(
            f"method {method!r}: option 'momenta' must be 'random' or 'zero', got {opt['momenta']!r}"
        )
    mass = {k: 1.0 for k in FIELDS}
    mass.update(check_fields(method, "mass", opt["mass"], FIELDS))
    if any(v <= 0 for v in mass.values()):
        raise ValueError(f"method {method!r}: masses must be > 0, got {mass}")
    inv_m = {k: 1.0 / v for k, v in mass.items()}
    blocks = _blocks(opt)
    frames = bool(opt["update_frames"])
    K = cfg.K
    efn = energy_fn(cfg, backend, opt["energy"])
    numba = backend == "numba"
    dev = Device(K) if backend == "cuda" else None
    damp = math.exp(-0.5 * friction * dt)
    theta_names = tuple(f"theta_{s}" for _, s in blocks)
    p_names = _momentum_names(blocks, frames)
    aux_names = theta_names + p_names
    if riemann:
        tol, max_iter = float(opt["fixed_point_tol"]), int(opt["fixed_point_max_iter"])
        if not (tol > 0 and max_iter >= 1):
            raise ValueError(f"method {method!r}: need fixed_point_tol > 0 and fixed_point_max_iter >= 1")
    else:
        table = SCHEMES[method][1]

    def to_sigma(theta):
        if dev is not None:
            return dev.theta_to_sigma(dev.put(theta))
        if numba:
            from vfesim_kernels.update_cpu import theta_to_sigma_cpu

            out = np.empty(theta.shape[:1] + (K, K), theta.dtype)
            theta_to_sigma_cpu(np.ascontiguousarray(theta), K, out)
            return out
        return theta_to_sigma(theta, K)

    def kinetic(aux) -> float:
        if dev is not None and not dev.sim:  # one transfer for all momenta
            names = [k for k in aux if k.startswith("p_")]
            return dev.sum_squares([aux[k] for k in names], [0.5 * inv_m[k[2:]] for k in names])
        if not riemann:
            return _kinetic_const(aux, inv_m)
        return _kinetic_riemann(aux)

    # Riemannian kinetic energy: 1/2 p_mu^T Sigma p_mu / m_mu + 1/2 p_th^T g^-1 p_th / m_th + |p_phi|^2/2m.
    def _kinetic_riemann(aux) -> float:
        out = 0.0
        for m, s in blocks:
            L = theta_to_L(aux[f"theta_{s}"], K)
            S = L @ np.swapaxes(L, 1, 2)
            pm, pt = aux[f"p_{m}"], aux[f"p_{s}"]
            out += 0.5 * inv_m[m] * float(np.einsum("na,nab,nb->", pm, S, pm))
            v = np.linalg.solve(fisher_metric_theta(L), pt[..., None])[..., 0]
            out += 0.5 * inv_m[s] * float(np.einsum("na,na->", pt, v))
        if frames:
            out += 0.5 * inv_m["phi"] * _sq(aux["p_phi"])
        return out

    def _carry(state, step, aux, eterms, grads, rng_state):
        kin = kinetic(aux)
        terms = dict(eterms)
        terms["kinetic"] = kin
        terms["hamiltonian"] = eterms["total"] + kin
        c = Carry(state, step, aux, terms, rng_state)
        object.__setattr__(c, _CACHE, (eterms, grads))  # force at `state`, recomputed by restore
        return c

    restore = make_restore(method, cfg, aux_names, dev, efn, _carry)

    def init(state: xr.Dataset) -> Carry:
        validate_state(state, cfg)
        rng = np.random.default_rng(seed)
        aux, new = {}, {}
        dtype = state["mu_q"].dtype
        for _, s in blocks:
            th = sigma_to_theta(host_array(state[s].data))
            aux[f"theta_{s}"] = th
            new[s] = to_sigma(th)
        for name in p_names:
            field = name[2:]
            shape = aux[f"theta_{field}"].shape if field.startswith("sigma") else state[field].shape
            if opt["momenta"] == "zero":
                aux[name] = np.zeros(shape, dtype)
                continue
            z = rng.standard_normal(shape)
            if riemann and field.startswith("mu"):
                L = np.linalg.cholesky(np.asarray(state["sigma" + field[2:]].data, np.float64))
                z = np.linalg.solve(np.swapaxes(L, 1, 2), z[..., None])[..., 0]  # cov L^-T L^-1 = Sigma^-1
            elif riemann and field.startswith("sigma"):
                g = fisher_metric_theta(theta_to_L(aux[f"theta_{field}"].astype(np.float64), K))
                z = (np.linalg.cholesky(g) @ z[..., None])[..., 0]
            aux[name] = (math.sqrt(mass[field]) * z).astype(dtype)
        return restore(with_arrays(state, new), 0, aux, rng.bit_generator.state)

    def _eval(n, arrays, aux):
        if dev is not None:
            dev.prefetch()
            eterms, grads = efn(arrays)
            dev.check(n, arrays, cfg, aux, eterms)
            return eterms, grads
        guard_state(n, arrays, cfg, aux)
        eterms, grads = efn(arrays)
        guard_terms(n, eterms)
        return eterms, grads

    def _step_const(carry: Carry) -> Carry:
        cached = getattr(carry, _CACHE, None)
        arrays = state_arrays(carry.state)
        eterms, grads = cached if cached is not None else efn(arrays)
        n = carry.step + 1
        aux = {k: carry.aux[k].copy() for k in aux_names}
        x = {k: arrays[k].copy() for m, _ in blocks for k in (m,)}
        if frames:
            x["phi"] = arrays["phi"].copy()
        if damp != 1.0:
            for k in p_names:
                aux[k] *= damp
        if dev is not None:
            dev.reset()
        valid = True
        for kick, drift in table:
            if kick != 0.0 and not valid:
                eterms, grads = _eval(n, arrays, aux)
                valid = True
            for m, s in blocks:
                do_phi = frames and m == "mu_q"
                args = (
                    x[m], aux[f"theta_{s}"], aux[f"p_{m}"], aux[f"p_{s}"], grads[m], grads[s],
                    kick * dt, drift * dt, inv_m[m], inv_m[s],
                )  # fmt: skip
                phi_args = (
                    (x["phi"], aux["p_phi"], grads["phi"], inv_m["phi"], True)
                    if do_phi
                    else (None, None, None, 1.0, False)
                )
                if dev is not None:
                    S = dev.xp.empty_like(arrays[s]) if drift != 0.0 else arrays[s]
                    ph = phi_args if do_phi else dev.no_phi(x[m])
                    dev.kick_drift(*args, S, *ph)
                elif numba:
                    from vfesim_kernels.update_cpu import kick_drift_cpu

                    S = np.empty_like(arrays[s]) if drift != 0.0 else arrays[s]
                    ph = phi_args if do_phi else (x[m][:, :0], x[m][:, :0], x[m][:, :0], 1.0, False)
                    kick_drift_cpu(*args, S, *ph)
                else:
                    S = kick_drift(*args, *phi_args)
                if drift != 0.0:
                    arrays = dict(arrays)
                    arrays[m], arrays[s] = x[m], S
                    if do_phi:
                        arrays["phi"] = x["phi"]
                    x[m] = x[m].copy()  # the dict now owns the old buffer: later drifts write a new one
                    if do_phi:
                        x["phi"] = x["phi"].copy()
            if drift != 0.0:
                valid = False
        if not valid:
            eterms, grads = _eval(n, arrays, aux)
        if damp != 1.0:
            for k in p_names:
                aux[k] *= damp
        if dev is None:
            guard_state(n, arrays, cfg, aux)
        out = _carry(with_arrays(carry.state, arrays), n, aux, eterms, grads, carry.rng_state)
        if dev is not None:  # the last kick came after the last check: non-finite momenta show here
            dev.check(n, arrays, cfg, aux, out.terms)
        return out

    def step_riemann(carry: Carry) -> Carry:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the guard reports instead
            return _riemann_step(carry)

    def step_const(carry: Carry) -> Carry:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return _step_const(carry)

    def _dHdx_kin(aux_th, p_mu, p_th, s_block):
        """(dK/dtheta, velocity v_theta, Sigma) for one block at theta with momenta (p_mu, p_th)."""
        m, s = s_block
        L = theta_to_L(aux_th, K)
        g = fisher_metric_theta(L)
        v = np.linalg.solve(g, p_th[..., None])[..., 0] * inv_m[s]
        # K_mu = 1/2 p^T Sigma p / m: dK/dSigma = 1/2 p p^T / m; K_th = 1/2 m v^T g v at fixed p:
        # dK/dtheta = -1/2 m d(v^T g v)/dtheta at fixed v.
        Gk = 0.5 * inv_m[m] * p_mu[:, :, None] * p_mu[:, None, :]
        dk = theta_grad(Gk, L) - 0.5 * mass[s] * fisher_kinetic_theta_grad(L, v)
        return dk, v, L

    def _riemann_step(carry: Carry) -> Carry:
        cached = getattr(carry, _CACHE, None)
        arrays = dict(state_arrays(carry.state))
        _, grads = cached if cached is not None else efn(arrays)
        n = carry.step + 1
        h = dt
        aux = {k: carry.aux[k].copy() for k in aux_names}
        if damp != 1.0:
            for k in p_names:
                aux[k] *= damp

        def half_kick(grads):
            for m, s in blocks:
                th = aux[f"theta_{s}"]
                L = theta_to_L(th, K)
                aux[f"p_{m}"] = aux[f"p_{m}"] - 0.5 * h * grads[m]
                p0 = aux[f"p_{s}"] - 0.5 * h * theta_grad(grads[s], L)
                pt = aux[f"p_{s}"]
                for it in range(max_iter + 1):
                    dk, _, _ = _dHdx_kin(th, aux[f"p_{m}"], pt, (m, s))
                    new = p0 - 0.5 * h * dk
                    err = np.abs(new - pt).max()
                    pt = new
                    if err <= tol * (1.0 + np.abs(pt).max()):
                        break
                    if it == max_iter:
                        raise DynamicsError(
                            n,
                            f"p_{s}",
                            f"generalized leapfrog momentum fixed point not converged "
                            f"after {max_iter} iterations (change {err:.3g}, tol {tol:.3g}); reduce dt",
                        )
                aux[f"p_{s}"] = pt
            if frames:
                aux["p_phi"] = aux["p_phi"] - 0.5 * h * grads["phi"]

        def explicit_half_kick(grads):
            for m, s in blocks:
                th = aux[f"theta_{s}"]
                dk, _, L = _dHdx_kin(th, aux[f"p_{m}"], aux[f"p_{s}"], (m, s))
                aux[f"p_{m}"] = aux[f"p_{m}"] - 0.5 * h * grads[m]
                aux[f"p_{s}"] = aux[f"p_{s}"] - 0.5 * h * (theta_grad(grads[s], L) + dk)
            if frames:
                aux["p_phi"] = aux["p_phi"] - 0.5 * h * grads["phi"]

        half_kick(grads)
        for m, s in blocks:
            th0 = aux[f"theta_{s}"]
            pm, pt = aux[f"p_{m}"], aux[f"p_{s}"]
            _, v0, L0 = _dHdx_kin(th0, pm, pt, (m, s))
            th = th0 + h * v0
            for it in range(max_iter + 1):
                _, v1, _ = _dHdx_kin(th, pm, pt, (m, s))
                new = th0 + 0.5 * h * (v0 + v1)
                err = np.abs(new - th).max()
                th = new
                if err <= tol * (1.0 + np.abs(th).max()):
                    break
                if it == max_iter:
                    raise DynamicsError(
                        n,
                        f"theta_{s}",
                        f"generalized leapfrog position fixed point not converged "
                        f"after {max_iter} iterations (change {err:.3g}, tol {tol:.3g}); reduce dt",
                    )
            S0 = L0 @ np.swapaxes(L0, 1, 2)
            S1 = theta_to_sigma(th, K)
            arrays[m] = arrays[m] + (0.5 * h * inv_m[m]) * np.einsum("nab,nb->na", S0 + S1, pm)
            aux[f"theta_{s}"] = th
            arrays[s] = S1
        if frames:
            arrays["phi"] = arrays["phi"] + (h * inv_m["phi"]) * aux["p_phi"]
        eterms, grads = _eval(n, arrays, aux)
        explicit_half_kick(grads)
        if damp != 1.0:
            for k in p_names:
                aux[k] *= damp
        guard_state(n, arrays, cfg, aux)
        return _carry(with_arrays(carry.state, arrays), n, aux, eterms, grads, carry.rng_state)

    return Integrator(method, init, step_riemann if riemann else step_const, restore)
