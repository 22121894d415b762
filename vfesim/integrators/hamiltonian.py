"""Hamiltonian dynamics on the free energy (SPEC §2.5): symplectic composition schemes and a Riemannian
(Fisher-mass) generalized leapfrog.

Phase space: unconstrained coordinates x = (mu_q, theta_q, phi[, mu_p, theta_p]) where theta is the
log-Cholesky vector of Sigma = L L^T (T = K(K+1)/2 entries, row-major lower triangle, diagonal stored as
log L_kk; the chart and the Fisher metric are the family's geometry, :mod:`vfesim.gaussian.geometry`),
momenta p of the same shapes. ``H = 1/2 p^T M^-1 p + F(x)``.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from ..config import ModelConfig
from ..family import family_of
from ..gaussian.geometry import (
    fisher_kinetic_theta_grad,
    fisher_metric_theta,
    sigma_to_theta,
    theta_grad,
    theta_to_L,
    theta_to_sigma,
)
from ..state import linalg_named, validate_state
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
    update_ops,
    with_arrays,
)
from .device import host_array

__all__ = ["SCHEMES", "make_hamiltonian", "kick_drift_pair"]

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
DEFAULTS = {
    "mass": None,
    "momenta": "random",
    "update_priors": False,
    "update_frames": True,
    "energy": None,
}
RIEMANN_DEFAULTS = {**DEFAULTS, "fixed_point_tol": 1e-12, "fixed_point_max_iter": 100}
_CACHE = "_vfesim_force"


# --- set-up shared by every scheme ----------------------------------------------------------------
@dataclass(frozen=True)
class _Setup:
    """Validated options and derived quantities of one Hamiltonian integrator."""

    method: str
    cfg: ModelConfig
    dt: float
    opt: dict
    mass: dict
    inv_m: dict
    blocks: tuple  # (mean, covariance) pairs in the phase space; the frame moves with the first
    frame: str | None  # the frame variable when frames move
    efn: Any
    ops: Any  # the backend's update operations
    dev: Any  # ops when the backend keeps arrays on a device, else None
    damp: float  # exp(-gamma dt / 2)
    theta_names: tuple
    p_names: tuple

    @property
    def aux_names(self) -> tuple:
        return self.theta_names + self.p_names

    @property
    def K(self) -> int:
        return self.cfg.K

    def frame_of(self, m: str) -> bool:
        """Whether the frame moves with the block whose mean is ``m``."""
        return self.frame is not None and m == self.blocks[0][0]


def _setup(method: str, cfg: ModelConfig, dt: float, backend, friction: float, options) -> _Setup:
    riemann = method == "riemannian_leapfrog"
    opt = check_options(method, options, RIEMANN_DEFAULTS if riemann else DEFAULTS)
    if riemann and backend.on_device:
        raise ValueError(
            f"method 'riemannian_leapfrog' runs on the 'numpy' and 'numba' backends only, not "
            f"{backend.name!r} (use a constant-mass scheme: symplectic_euler, verlet, ruth3, pefrl)"
        )
    friction = float(friction)
    if not (math.isfinite(friction) and friction >= 0):
        raise ValueError(f"method {method!r}: friction must be finite and >= 0, got {friction}")
    if opt["momenta"] not in ("random", "zero"):
        raise ValueError(
            f"method {method!r}: option 'momenta' must be 'random' or 'zero', got {opt['momenta']!r}"
        )
    geo = family_of(cfg).geometry
    mass = {k: 1.0 for k in geo.MOVABLE}
    mass.update(check_fields(method, "mass", opt["mass"], geo.MOVABLE))
    if any(v <= 0 for v in mass.values()):
        raise ValueError(f"method {method!r}: masses must be > 0, got {mass}")
    if riemann:
        tol, max_iter = float(opt["fixed_point_tol"]), int(opt["fixed_point_max_iter"])
        if not (tol > 0 and max_iter >= 1):
            raise ValueError(f"method {method!r}: need fixed_point_tol > 0 and fixed_point_max_iter >= 1")
    blocks = geo.BLOCKS if opt["update_priors"] else geo.BLOCKS[:1]
    frame = geo.FRAME if opt["update_frames"] else None
    p_names = []
    for m, s in blocks:
        p_names += [f"p_{m}", f"p_{s}"]
        if frame is not None and m == blocks[0][0]:
            p_names.append(f"p_{frame}")
    ops = update_ops(cfg, backend)
    return _Setup(
        method=method,
        cfg=cfg,
        dt=dt,
        opt=opt,
        mass=mass,
        inv_m={k: 1.0 / v for k, v in mass.items()},
        blocks=blocks,
        frame=frame,
        efn=energy_fn(cfg, backend, opt["energy"]),
        ops=ops,
        dev=ops if backend.on_device else None,
        damp=math.exp(-0.5 * friction * dt),
        theta_names=tuple(f"theta_{s}" for _, s in blocks),
        p_names=tuple(p_names),
    )


def _sq(a: np.ndarray) -> float:
    # einsum, not vdot: a BLAS dot wakes BLAS threads, which costs milliseconds on a busy machine.
    a = a.reshape(-1)
    return float(np.einsum("i,i->", a, a))


def _kinetic_const(c: _Setup, aux) -> float:
    return sum(0.5 * c.inv_m[k[2:]] * _sq(aux[k]) for k in aux if k.startswith("p_"))


def _kinetic_riemann(c: _Setup, aux) -> float:
    """1/2 p_mu^T Sigma p_mu / m_mu + 1/2 p_th^T g^-1 p_th / m_th + |p_phi|^2 / 2 m_phi."""
    out = 0.0
    for m, s in c.blocks:
        L = theta_to_L(aux[f"theta_{s}"], c.K)
        S = L @ np.swapaxes(L, -1, -2)
        pm, pt = aux[f"p_{m}"], aux[f"p_{s}"]
        K, T = c.K, pt.shape[-1]  # batch dims (agent, ...) flattened: field agents have grid dims
        pm2, S2 = pm.reshape(-1, K), S.reshape(-1, K, K)
        out += 0.5 * c.inv_m[m] * float(np.einsum("na,nab,nb->", pm2, S2, pm2))
        solve = lambda L, pt: np.linalg.solve(fisher_metric_theta(L), pt[..., None])[..., 0]
        v = linalg_named(
            f"theta_{s}", "the Fisher-metric solve", solve, L, pt, labels=(f"theta_{s}", f"p_{s}")
        )
        out += 0.5 * c.inv_m[s] * float(np.einsum("na,na->", pt.reshape(-1, T), v.reshape(-1, T)))
    if c.frame is not None:
        out += 0.5 * c.inv_m[c.frame] * _sq(aux[f"p_{c.frame}"])
    return out


def _make_init(c: _Setup, seed: int, restore, riemann: bool):
    """``init(state)``: log-Cholesky coordinates and initial momenta (p ~ N(0, M), or zero)."""
    role = {}  # momentum name -> (variable, "mean" | "cov" | "frame", the block's covariance)
    for m, s in c.blocks:
        role[f"p_{m}"] = (m, "mean", s)
        role[f"p_{s}"] = (s, "cov", s)
    if c.frame is not None:
        role[f"p_{c.frame}"] = (c.frame, "frame", None)

    # Points the family's geometry keeps still (field agents: outside the supports) start at rest.
    still = getattr(family_of(c.cfg).geometry, "frozen", None)

    def init(state: xr.Dataset) -> Carry:
        if c.dev is not None:  # checked where it will live (the device checks); restore keeps it there
            state = c.dev.put_state(state)
            c.dev.prepare(state, c.cfg)
        validate_state(state, c.cfg)
        rng = np.random.default_rng(seed)
        rest = None if still is None else host_array(still(state))
        aux, new = {}, {}
        dtype = state[c.blocks[0][0]].dtype
        for _, s in c.blocks:
            th = sigma_to_theta(host_array(state[s].data))
            aux[f"theta_{s}"] = th
            new[s] = c.ops.theta_to_sigma(c.dev.put(th) if c.dev is not None else th)
        for name in c.p_names:
            field, kind, cov = role[name]
            shape = aux[f"theta_{field}"].shape if kind == "cov" else state[field].shape
            if c.opt["momenta"] == "zero":
                aux[name] = np.zeros(shape, dtype)
                continue
            z = rng.standard_normal(shape)
            if riemann and kind == "mean":
                L = np.linalg.cholesky(host_array(state[cov].data).astype(np.float64))
                z = np.linalg.solve(np.swapaxes(L, -1, -2), z[..., None])[..., 0]  # cov L^-T L^-1 = Sigma^-1
            elif riemann and kind == "cov":
                g = fisher_metric_theta(theta_to_L(aux[f"theta_{field}"].astype(np.float64), c.K))
                z = (np.linalg.cholesky(g) @ z[..., None])[..., 0]
            if rest is not None:
                z[rest] = 0.0
            aux[name] = (math.sqrt(c.mass[field]) * z).astype(dtype)
        # Validated above, where it lives; the covariances are theta_to_sigma of their own factors.
        return restore(with_arrays(state, new), 0, aux, rng.bit_generator.state, validate=False)

    return init


def _evaluate(c: _Setup, n: int, arrays, aux):
    """Energy and force at ``arrays`` with the guard of SPEC §5 (on the device without a round trip)."""
    if c.dev is not None:
        c.dev.prefetch()
        eterms, grads = c.efn(arrays)
        c.dev.check(n, arrays, c.cfg, aux, eterms)
        return eterms, grads
    guard_state(n, arrays, c.cfg, aux)
    eterms, grads = c.efn(arrays)
    guard_terms(n, eterms)
    return eterms, grads


# --- constant mass: composition schemes -----------------------------------------------------------
def kick_drift_pair(c: _Setup, kick: float, drift: float, arrays: dict, x: dict, aux: dict, grads) -> dict:
    """One (kick, drift) pair of a composition, every block: momenta in ``aux`` and positions in ``x``
    (own buffers, equal to ``arrays``' means and frame) change in place, ``p -= kick dt dF/dx`` then
    ``x += drift dt M^-1 p``; returns the state arrays after it (a new dict when drift != 0; ``x`` then
    holds fresh copies). Per agent only: the dask backend runs it per chunk."""
    dt, fr = c.dt, c.frame
    for m, s in c.blocks:
        do_phi = c.frame_of(m)
        args = (
            x[m], aux[f"theta_{s}"], aux[f"p_{m}"], aux[f"p_{s}"], grads[m], grads[s],
            kick * dt, drift * dt, c.inv_m[m], c.inv_m[s],
        )  # fmt: skip
        no_phi = (None, None, None, 1.0, False)
        phi_args = (x[fr], aux[f"p_{fr}"], grads[fr], c.inv_m[fr], True) if do_phi else no_phi
        S = c.ops.kick_drift(args, arrays[s], phi_args)
        if drift != 0.0:
            arrays = dict(arrays)
            arrays[m], arrays[s] = x[m], S
            if do_phi:
                arrays[fr] = x[fr]
            x[m] = x[m].copy()  # the dict now owns the old buffer: later drifts write a new one
            if do_phi:
                x[fr] = x[fr].copy()
    return arrays


def _make_const_step(c: _Setup, table, make_carry):
    """One step of a (kick b_i, drift a_i) composition with conformal friction around it."""
    fr = c.frame

    def _step(carry: Carry) -> Carry:
        cached = getattr(carry, _CACHE, None)
        arrays = state_arrays(carry.state)
        eterms, grads = cached if cached is not None else c.efn(arrays)
        n = carry.step + 1
        aux = {k: carry.aux[k].copy() for k in c.aux_names}
        x = {m: arrays[m].copy() for m, _ in c.blocks}
        if fr is not None:
            x[fr] = arrays[fr].copy()
        if c.damp != 1.0:
            for k in c.p_names:
                aux[k] *= c.damp
        if c.dev is not None:
            c.dev.reset()
        valid = True
        for kick, drift in table:
            if kick != 0.0 and not valid:
                eterms, grads = _evaluate(c, n, arrays, aux)
                valid = True
            arrays = kick_drift_pair(c, kick, drift, arrays, x, aux, grads)
            if drift != 0.0:
                valid = False
        if not valid:
            eterms, grads = _evaluate(c, n, arrays, aux)
        if c.damp != 1.0:
            for k in c.p_names:
                aux[k] *= c.damp
        if c.dev is None:
            guard_state(n, arrays, c.cfg, aux)
        out = make_carry(with_arrays(carry.state, arrays), n, aux, eterms, grads, carry.rng_state)
        if c.dev is not None:  # the last kick came after the last check: non-finite momenta show here
            c.dev.check(n, arrays, c.cfg, aux, out.terms)
        return out

    def step(carry: Carry) -> Carry:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the guard reports instead
            return _step(carry)

    return step


# --- Riemannian (Fisher) mass: generalized leapfrog ----------------------------------------------
def _make_riemann_step(c: _Setup, make_carry):
    """One generalized-leapfrog step (Girolami & Calderhead 2011, eq. 16-18) with friction around it."""
    h, K, fr = c.dt, c.K, c.frame
    inv_m, mass = c.inv_m, c.mass
    tol, max_iter = float(c.opt["fixed_point_tol"]), int(c.opt["fixed_point_max_iter"])

    def _dHdx_kin(aux_th, p_mu, p_th, s_block):
        """(dK/dtheta, velocity v_theta, L) for one block at theta with momenta (p_mu, p_th); a failed
        linear solve (e.g. a singular metric after theta overflowed) names the agent."""
        s = s_block[1]
        return linalg_named(
            f"theta_{s}",
            "the Fisher-metric solve",
            lambda th, pm, pt: _dHdx_kin_raw(th, pm, pt, s_block),
            aux_th, p_mu, p_th,
            labels=(f"theta_{s}", f"p_{s_block[0]}", f"p_{s}"),
        )  # fmt: skip

    def _dHdx_kin_raw(aux_th, p_mu, p_th, s_block):
        m, s = s_block
        L = theta_to_L(aux_th, K)
        g = fisher_metric_theta(L)
        v = np.linalg.solve(g, p_th[..., None])[..., 0] * inv_m[s]
        # K_mu = 1/2 p^T Sigma p / m: dK/dSigma = 1/2 p p^T / m; K_th = 1/2 m v^T g v at fixed p:
        # dK/dtheta = -1/2 m d(v^T g v)/dtheta at fixed v.
        Gk = 0.5 * inv_m[m] * p_mu[..., :, None] * p_mu[..., None, :]
        dk = theta_grad(Gk, L) - 0.5 * mass[s] * fisher_kinetic_theta_grad(L, v)
        return dk, v, L

    def _not_converged(n, name, what, err, change):
        """The error of a fixed point that did not converge, naming the agent that changed most (or the
        first whose change is NaN)."""
        d = change.reshape(change.shape[0], -1).max(axis=1)
        nan = ~np.isfinite(d)
        agent = int(np.argmax(nan)) if nan.any() else int(np.argmax(d))
        return DynamicsError(
            n,
            name,
            f"generalized leapfrog {what} fixed point not converged "
            f"after {max_iter} iterations (change {err:.3g}, tol {tol:.3g}); reduce dt",
            agent=agent,
        )

    def _step(carry: Carry) -> Carry:
        cached = getattr(carry, _CACHE, None)
        arrays = dict(state_arrays(carry.state))
        _, grads = cached if cached is not None else c.efn(arrays)
        n = carry.step + 1
        aux = {k: carry.aux[k].copy() for k in c.aux_names}
        if c.damp != 1.0:
            for k in c.p_names:
                aux[k] *= c.damp

        def half_kick(grads):
            for m, s in c.blocks:
                th = aux[f"theta_{s}"]
                L = theta_to_L(th, K)
                aux[f"p_{m}"] = aux[f"p_{m}"] - 0.5 * h * grads[m]
                p0 = aux[f"p_{s}"] - 0.5 * h * theta_grad(grads[s], L)
                pt = aux[f"p_{s}"]
                for it in range(max_iter + 1):
                    dk, _, _ = _dHdx_kin(th, aux[f"p_{m}"], pt, (m, s))
                    new = p0 - 0.5 * h * dk
                    change = np.abs(new - pt)
                    err = change.max()
                    pt = new
                    if err <= tol * (1.0 + np.abs(pt).max()):
                        break
                    if it == max_iter:
                        raise _not_converged(n, f"p_{s}", "momentum", err, change)
                aux[f"p_{s}"] = pt
            if fr is not None:
                aux[f"p_{fr}"] = aux[f"p_{fr}"] - 0.5 * h * grads[fr]

        def explicit_half_kick(grads):
            for m, s in c.blocks:
                th = aux[f"theta_{s}"]
                dk, _, L = _dHdx_kin(th, aux[f"p_{m}"], aux[f"p_{s}"], (m, s))
                aux[f"p_{m}"] = aux[f"p_{m}"] - 0.5 * h * grads[m]
                aux[f"p_{s}"] = aux[f"p_{s}"] - 0.5 * h * (theta_grad(grads[s], L) + dk)
            if fr is not None:
                aux[f"p_{fr}"] = aux[f"p_{fr}"] - 0.5 * h * grads[fr]

        half_kick(grads)
        for m, s in c.blocks:
            th0 = aux[f"theta_{s}"]
            pm, pt = aux[f"p_{m}"], aux[f"p_{s}"]
            _, v0, L0 = _dHdx_kin(th0, pm, pt, (m, s))
            th = th0 + h * v0
            for it in range(max_iter + 1):
                _, v1, _ = _dHdx_kin(th, pm, pt, (m, s))
                new = th0 + 0.5 * h * (v0 + v1)
                change = np.abs(new - th)
                err = change.max()
                th = new
                if err <= tol * (1.0 + np.abs(th).max()):
                    break
                if it == max_iter:
                    raise _not_converged(n, f"theta_{s}", "position", err, change)
            S0 = L0 @ np.swapaxes(L0, -1, -2)
            S1 = theta_to_sigma(th, K)
            arrays[m] = arrays[m] + (0.5 * h * inv_m[m]) * np.einsum("...ab,...b->...a", S0 + S1, pm)
            aux[f"theta_{s}"] = th
            arrays[s] = S1
        if fr is not None:
            arrays[fr] = arrays[fr] + (h * inv_m[fr]) * aux[f"p_{fr}"]
        eterms, grads = _evaluate(c, n, arrays, aux)
        explicit_half_kick(grads)
        if c.damp != 1.0:
            for k in c.p_names:
                aux[k] *= c.damp
        guard_state(n, arrays, c.cfg, aux)
        return make_carry(with_arrays(carry.state, arrays), n, aux, eterms, grads, carry.rng_state)

    def step(carry: Carry) -> Carry:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the guard reports instead
            return _step(carry)

    return step


def make_hamiltonian(
    method: str,
    cfg: ModelConfig,
    dt: float,
    *,
    backend,
    friction: float = 0.0,
    seed: int = 0,
    **options,
) -> Integrator:
    """Build a Hamiltonian integrator (a scheme of :data:`SCHEMES` or ``"riemannian_leapfrog"``) on a
    :class:`vfesim.backends.Backend`."""
    riemann = method == "riemannian_leapfrog"
    c = _setup(method, cfg, dt, backend, friction, options)

    def kinetic(aux) -> float:
        if c.dev is not None and not c.dev.sim:  # one transfer for all momenta
            names = [k for k in aux if k.startswith("p_")]
            return c.dev.sum_squares([aux[k] for k in names], [0.5 * c.inv_m[k[2:]] for k in names])
        return _kinetic_riemann(c, aux) if riemann else _kinetic_const(c, aux)

    def make_carry(state, step, aux, eterms, grads, rng_state):
        kin = kinetic(aux)
        terms = dict(eterms)
        terms["kinetic"] = kin
        terms["hamiltonian"] = eterms["total"] + kin
        carry = Carry(state, step, aux, terms, rng_state)
        object.__setattr__(carry, _CACHE, (eterms, grads))  # force at `state`, recomputed by restore
        return carry

    restore = make_restore(method, cfg, c.aux_names, c.dev, c.efn, make_carry)
    init = _make_init(c, seed, restore, riemann)
    if riemann:
        step = _make_riemann_step(c, make_carry)
    else:
        step = _make_const_step(c, SCHEMES[method][1], make_carry)
    return Integrator(method, init, step, restore)
