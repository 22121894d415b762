"""Fitting parameters of density-matrix agents to rollout losses (spec/quantum.md §4; issue 13 "training
through rollouts"): ``fit(qstate, qcfg, schedule, params=("hamiltonian",), method="adam" | "lbfgs")``.

Every fitted parameter is mapped to unconstrained real coordinates theta, so any theta is a valid model:

    hamiltonian          theta = hvec(H_i)  (d^2 per agent; tr(H_bar dH) = hvec(H_bar) . hvec(dH))
    rho                  theta = hvec(A_i), rho_i = exp(A_i)/tr exp(A_i)  ((P1) of §1.2, rule R8:
                         A_bar = V (K o V^dag G V) V^dag - tr(rho G) rho, K = exp^[1]); A_i starts at
                         log x_i (the floored state, §2.3)
    temperature          theta = log T_i               dephasing_rate, thermal_rate   theta = log gamma
    coupling_length      theta = log ell               gate_width                     theta = log tau
    coupling_strength    theta = logit eps0            gate_threshold                 theta = theta_g
    phi                  theta = phi_i                 dt                             theta = log dt_t

(a rate given as a number is one shared parameter, an array one per agent; log/logit coordinates need
values strictly inside their domain: 0 raises, naming the key). ``shared`` names state parameters
(hamiltonian, temperature, phi) with one value for all agents, as the seed's per-block Hamiltonian is
shared by every token: it starts at the agents' mean coordinates and its gradient is the sum over agents.
The loss and its exact gradient come
from :func:`.rollout.rollout` (no autograd library); the chain rule through the maps above is written
here.

Methods: "adam" (Kingma & Ba, bias-corrected first and second moments; lr, betas, eps; stops after
``n_iter`` steps or when |grad theta|_inf <= gtol) and "lbfgs" (``scipy.optimize.minimize`` with method
"L-BFGS-B", the exact gradient as ``jac``; ``n_iter`` iterations at most, ``gtol``). L-BFGS-B's first
step has unit length in its coordinates, which jumps across the oscillatory Born likelihood of a rollout
into another basin; it therefore works in theta / ``step_scale`` (default 0.05: a first move of 0.05 in
theta).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from ..arrays import array_module as _xp
from ..arrays import host_array
from ..config import ConfigError
from .config import QuantumConfig
from .energy import NUMPY_OPS, QuantumOps, floor_eps
from .linalg import dd_exp, dk, eigh, from_eig, herm, hmat, hvec
from .rollout import Schedule, rollout

__all__ = ["PARAMETERS", "SHAREABLE", "METHODS", "Objective", "FitResult", "objective", "fit"]

METHODS = ("adam", "lbfgs")


class _Model(NamedTuple):
    arrays: dict
    dyn: Any
    dts: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Param:
    """get(model) -> theta (host float64, 1-D); put(model, theta) -> model;
    chain(model, grads) -> dL/dtheta."""

    get: Callable
    put: Callable
    chain: Callable


def _positive(key: str, v) -> np.ndarray:
    a = np.asarray(host_array(v), dtype=np.float64)
    if not (np.isfinite(a) & (a > 0)).all():
        raise ConfigError(key, f"must be > 0 to be fitted (log coordinates), got {a}")
    return a


def _state_param(key: str, to, frm, chain) -> _Param:
    def get(m):
        return to(m.arrays[key]).ravel()

    def put(m, th):
        old = m.arrays[key]
        return m._replace(arrays={**m.arrays, key: frm(th.reshape(to(old).shape), old)})

    return _Param(get, put, lambda m, g: chain(m, g[key]).ravel())


def _shared(spec: _Param, n: int) -> _Param:
    """One value for every agent: theta = the agents' mean coordinates, dL/dtheta = the sum over agents."""
    return _Param(
        lambda m: spec.get(m).reshape(n, -1).mean(axis=0),
        lambda m, th: spec.put(m, np.tile(th, n)),
        lambda m, g: spec.chain(m, g).reshape(n, -1).sum(axis=0),
    )


def _dyn_param(key: str, log: bool) -> _Param:
    def get(m):
        v = getattr(m.dyn, key)
        return np.log(_positive(key, v)).ravel() if log else np.atleast_1d(np.asarray(v, np.float64))

    def put(m, th):
        v = np.exp(th) if log else th
        scalar = np.ndim(getattr(m.dyn, key)) == 0
        return m._replace(dyn=m.dyn.replace(**{key: float(v[0]) if scalar else v}))

    def chain(m, g):
        gv = np.atleast_1d(np.asarray(host_array(g[key]), np.float64))
        return gv * np.exp(get(m)) if log else gv

    return _Param(get, put, chain)


def _rho_to(rho):
    xp = _xp(rho)
    e = floor_eps(rho.dtype)
    d = rho.shape[-1]
    s, W = eigh((1.0 - e) * herm(rho) + (e / d) * xp.eye(d, dtype=rho.dtype))
    return host_array(hvec(from_eig(W, xp.log(s))))


def _rho_from(th, old):
    xp = _xp(old)
    a, W = eigh(hmat(xp.asarray(th), old.shape[-1]).astype(old.dtype))
    p = xp.exp(a - a.max(axis=1, keepdims=True))
    return herm(from_eig(W, p / p.sum(axis=1, keepdims=True))).astype(old.dtype)


def _rho_chain(m, G):
    """Rule R8 (P1): A_bar from the traceless cotangent G of rho = exp(A)/tr exp(A)."""
    xp = _xp(G)
    A = hmat(xp.asarray(_rho_to(m.arrays["rho"])), G.shape[-1]).astype(G.dtype)
    a, W = eigh(A)
    l = a - a.max(axis=1, keepdims=True)
    l = l - xp.log(xp.exp(l).sum(axis=1, keepdims=True))
    p = xp.exp(l)
    rho = from_eig(W, p)
    A_bar = dk(W, dd_exp(l, p).astype(W.dtype), G) - xp.einsum("nkl,nlk->n", rho, G).real[:, None, None] * rho
    return host_array(hvec(herm(A_bar)))


def _dt_param() -> _Param:
    return _Param(
        lambda m: np.log(m.dts),
        lambda m, th: m._replace(dts=np.exp(th)),
        lambda m, g: np.asarray(g["dt"]) * m.dts,
    )


def _logit_param(key: str) -> _Param:
    def get(m):
        v = float(getattr(m.dyn, key))
        if not 0 < v < 1:
            raise ConfigError(key, f"must be in (0, 1) to be fitted (logit coordinates), got {v}")
        return np.array([np.log(v / (1 - v))])

    def chain(m, g):
        v = float(getattr(m.dyn, key))
        return np.array([g[key] * v * (1 - v)])

    return _Param(
        get, lambda m, th: m._replace(dyn=m.dyn.replace(**{key: float(1 / (1 + np.exp(-th[0])))})), chain
    )


PARAMETERS: dict[str, _Param] = {
    "hamiltonian": _state_param(
        "hamiltonian",
        lambda H: host_array(hvec(H)),
        lambda th, old: hmat(_xp(old).asarray(th), old.shape[-1]).astype(old.dtype),
        lambda m, Hb: host_array(hvec(Hb)),
    ),
    "rho": _state_param("rho", _rho_to, _rho_from, _rho_chain),
    "temperature": _state_param(
        "temperature",
        lambda T: np.log(_positive("temperature", T)),
        lambda th, old: _xp(old).asarray(np.exp(th), dtype=old.dtype),
        lambda m, Tb: host_array(Tb) * host_array(m.arrays["temperature"]),
    ),
    "phi": _state_param(
        "phi",
        lambda p: host_array(p).astype(np.float64),
        lambda th, old: _xp(old).asarray(th, dtype=old.dtype),
        lambda m, pb: host_array(pb),
    ),
    "dephasing_rate": _dyn_param("dephasing_rate", log=True),
    "thermal_rate": _dyn_param("thermal_rate", log=True),
    "coupling_length": _dyn_param("coupling_length", log=True),
    "gate_width": _dyn_param("gate_width", log=True),
    "gate_threshold": _dyn_param("gate_threshold", log=False),
    "coupling_strength": _logit_param("coupling_strength"),
    "dt": _dt_param(),
}


SHAREABLE = ("hamiltonian", "temperature", "phi")


class FitResult(NamedTuple):
    """state: the fitted state Dataset; schedule: the fitted Schedule (dynamics and dt); loss: the final
    loss; history: Dataset over ``evaluation`` (``loss``, ``grad_norm`` = ``|dL/dtheta|_inf``) of every
    rollout evaluated; n_iter: iterations taken; converged: gtol reached; message."""

    state: xr.Dataset
    schedule: Schedule
    loss: float
    history: xr.Dataset
    n_iter: int
    converged: bool
    message: str


class Objective(NamedTuple):
    """theta0: the starting coordinates; fun(theta) -> (loss, dL/dtheta) (host float64); unpack(theta) ->
    (state Dataset, Schedule) of a point; history: (loss, |dL/dtheta|_inf) of every evaluation."""

    theta0: np.ndarray
    fun: Callable
    unpack: Callable
    history: list


def objective(
    qstate: xr.Dataset,
    qcfg: QuantumConfig,
    schedule: Schedule,
    params: Sequence[str] = ("hamiltonian",),
    *,
    shared: Sequence[str] = (),
    loss: str | Mapping[str, float] = "born",
    checkpoints: int | None = None,
    ops: QuantumOps = NUMPY_OPS,
) -> Objective:
    """The rollout loss as a function of the unconstrained coordinates of ``params`` (module docstring)."""
    if isinstance(params, str):
        params = (params,)
    unknown = [p for p in params if p not in PARAMETERS]
    if unknown or not params or len(set(params)) != len(params):
        raise ConfigError("params", f"must be distinct names from {tuple(PARAMETERS)}, got {tuple(params)}")
    if isinstance(shared, str):
        shared = (shared,)
    bad = [p for p in shared if p not in params or p not in SHAREABLE]
    if bad:
        raise ConfigError("shared", f"must be fitted parameters among {SHAREABLE}, got {tuple(shared)}")
    model0 = _Model({k: qstate[k].data for k in qstate.data_vars}, schedule.dynamics, np.array(schedule.dt))
    n = qstate.sizes["agent"]
    specs = [_shared(PARAMETERS[p], n) if p in shared else PARAMETERS[p] for p in params]
    theta0 = np.concatenate([spec.get(model0) for spec in specs])
    cuts = np.cumsum([spec.get(model0).size for spec in specs])[:-1]
    history: list = []

    def model(theta):
        m = model0
        for spec, th in zip(specs, np.split(np.asarray(theta, np.float64), cuts), strict=True):
            m = spec.put(m, th)
        return m

    def unpack(theta, m=None):
        m = model(theta) if m is None else m
        out = qstate.copy()
        for k, v in m.arrays.items():
            out[k] = (qstate[k].dims, v)
        return out, Schedule(m.dyn, m.dts, schedule.n_steps, schedule.outcomes)

    def fun(theta):
        m = model(theta)
        state, sched = unpack(theta, m)
        res = rollout(state, qcfg, sched, loss=loss, checkpoints=checkpoints, ops=ops)
        g = np.concatenate([spec.chain(m, res.grads) for spec in specs])
        if not np.isfinite(res.loss) or not np.isfinite(g).all():
            raise FloatingPointError(f"fit: non-finite loss or gradient at evaluation {len(history)}")
        history.append((res.loss, float(np.abs(g).max())))
        return res.loss, g

    return Objective(theta0, fun, unpack, history)


def fit(
    qstate: xr.Dataset,
    qcfg: QuantumConfig,
    schedule: Schedule,
    params: Sequence[str] = ("hamiltonian",),
    method: str = "adam",
    *,
    shared: Sequence[str] = (),
    loss: str | Mapping[str, float] = "born",
    n_iter: int = 200,
    lr: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    gtol: float = 1e-6,
    step_scale: float = 0.05,
    checkpoints: int | None = None,
    ops: QuantumOps = NUMPY_OPS,
) -> FitResult:
    """Minimise the rollout loss over ``params`` (module docstring) from the values in ``qstate`` and
    ``schedule``. shared, loss, checkpoints, ops: as for :func:`objective` / :func:`.rollout.rollout`."""
    if method not in METHODS:
        raise ConfigError("method", f"must be one of {METHODS}, got {method!r}")
    if isinstance(n_iter, bool) or not isinstance(n_iter, (int, np.integer)) or n_iter < 1:
        raise ConfigError("n_iter", f"must be an integer >= 1, got {n_iter!r}")
    if not lr > 0:
        raise ConfigError("lr", f"must be > 0, got {lr}")
    if not step_scale > 0:
        raise ConfigError("step_scale", f"must be > 0, got {step_scale}")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ConfigError("betas", f"must be in [0, 1), got {betas}")
    obj = objective(
        qstate, qcfg, schedule, params, shared=shared, loss=loss, checkpoints=checkpoints, ops=ops
    )
    evaluate = obj.fun
    theta = obj.theta0
    if method == "adam":
        b1, b2 = betas
        mom, vel = np.zeros_like(theta), np.zeros_like(theta)
        converged, k = False, 0
        for k in range(1, n_iter + 1):
            _, g = evaluate(theta)
            if np.abs(g).max() <= gtol:
                converged = True
                break
            mom = b1 * mom + (1 - b1) * g
            vel = b2 * vel + (1 - b2) * g * g
            theta = theta - lr * (mom / (1 - b1**k)) / (np.sqrt(vel / (1 - b2**k)) + eps)
        n_done = k
        message = "gradient below gtol" if converged else "n_iter reached"
    else:
        # L-BFGS-B's first step has unit length in its coordinates: work in theta / step_scale.
        scaled = lambda u: tuple(
            v * f for v, f in zip(evaluate(u * step_scale), (1.0, step_scale), strict=True)
        )
        import scipy.optimize  # here: ~0.4 s of import that only L-BFGS fits need

        res = scipy.optimize.minimize(
            scaled,
            theta / step_scale,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": n_iter, "gtol": gtol * step_scale},
        )
        theta = res.x * step_scale
        n_done, converged, message = int(res.nit), bool(res.success), str(res.message)
    final_loss, _ = evaluate(theta)
    state, sched = obj.unpack(theta)
    h = np.array(obj.history)
    history = xr.Dataset(
        {"loss": ("evaluation", h[:, 0]), "grad_norm": ("evaluation", h[:, 1])},
        attrs={"method": method, "params": ",".join([params] if isinstance(params, str) else params)},
    )
    return FitResult(state, sched, final_loss, history, n_done, converged, message)
