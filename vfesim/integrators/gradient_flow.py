"""Natural-gradient flow on the free energy (SPEC §2.5), method ``"gradient_flow"``.

Fisher–Rao directions: d mu = -Sigma dF/dmu, d Sigma = -2 Sigma (dF/dSigma) Sigma, d phi = -dF/dphi.
Covariances are retracted with the affine-invariant exponential map
``Sigma <- Sigma^1/2 expm(eta Sigma^-1/2 dSigma Sigma^-1/2) Sigma^1/2`` (stays SPD); frames are kept in the
principal ball |phi| <= pi (``phi - 2 pi phi/|phi|`` is the same rotation for every integer-spin irrep).

Options (unknown ones raise ValueError):
  rule: "natural" (default), "euclidean" (d x = -dF/dx; covariances still retracted by the exponential
      map, so they stay SPD) or "adam" (Adam moments of the Euclidean gradient; direction
      -m_hat/(sqrt(v_hat)+eps), retracted the same way).
  step_scale: dict field -> multiplier of dt (fields mu_q, sigma_q, mu_p, sigma_p, phi; 0 freezes).
  update_priors (True), update_frames (True): move mu_p/sigma_p and phi at all.
  adam_beta1 (0.9), adam_beta2 (0.999), adam_eps (1e-8).
  energy: a callable (arrays) -> (terms, grads) replacing the model energy (custom potentials, tests).

Backend "cuda": state and Adam moments stay on the device; one fused kernel per step
(``vfesim_kernels.update_cuda``, plus one elementwise Adam kernel per moving field), the guard of
:mod:`vfesim.integrators.device`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import xarray as xr

from ..config import ModelConfig
from ..family import family_of
from .base import (
    Carry,
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

__all__ = ["make_gradient_flow", "FlowRule", "flow_update", "flow_update_device"]

MODES = {"natural": 0, "euclidean": 1, "adam": 2}
DEFAULTS = {
    "rule": "natural",
    "step_scale": None,
    "update_priors": True,
    "update_frames": True,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_eps": 1e-8,
    "energy": None,
}
_CACHE = "_vfesim_grads"


@dataclasses.dataclass(frozen=True)
class FlowRule:
    """The per-agent update of one gradient-flow integrator: host update operations ``ops``, step
    sizes ``eta`` (5,) float64, ``mode`` (MODES), the moving fields and the Adam constants."""

    ops: Any
    eta: np.ndarray
    mode: int
    moving: tuple[str, ...]
    b1: float
    b2: float
    eps: float


def flow_update(rule: FlowRule, arrays, grads, aux, n: int) -> tuple[dict, dict]:
    """Step ``n`` of the flow on host arrays: (the state arrays after it, the new aux). Per agent only
    (Adam moments elementwise, the fused update per agent), so a chunk of agents updates on its own: the
    dask backend runs this per chunk. ``arrays``, ``grads`` and ``aux`` are not modified."""
    direc = grads
    if rule.mode == 2:
        b1, b2, old = rule.b1, rule.b2, aux
        aux, direc = {}, dict(grads)
        for k in rule.moving:
            g = grads[k]
            m = b1 * old[f"adam_m_{k}"] + (1 - b1) * g
            v = b2 * old[f"adam_v_{k}"] + (1 - b2) * g * g
            aux[f"adam_m_{k}"], aux[f"adam_v_{k}"] = m, v
            direc[k] = -(m / (1 - b1**n)) / (np.sqrt(v / (1 - b2**n)) + rule.eps)
    new = dict(arrays)
    new.update(rule.ops.gradient_flow(arrays, direc, rule.eta, rule.mode))
    return new, aux


def flow_update_device(rule: FlowRule, dev, arrays, grads, aux, n: int, eta_dev, fields) -> tuple[dict, dict]:
    """:func:`flow_update` on the device: Adam moments and the fused update in the kernels of ``dev``
    (a :class:`~vfesim.integrators.device.Device`, or its family adaptation), eta_dev the step sizes on
    the device; returns (the arrays of ``fields`` after the step, the new aux). Raises ``dev``'s guard
    flag on non-finite outputs."""
    direc = grads
    if rule.mode == 2:
        old, aux, direc = aux, {}, dict(grads)
        for k in rule.moving:
            m, v, direc[k] = dev.adam(
                grads[k], old[f"adam_m_{k}"], old[f"adam_v_{k}"], rule.b1, rule.b2, n, rule.eps
            )
            aux[f"adam_m_{k}"], aux[f"adam_v_{k}"] = m, v
    return dev.gradient_flow(arrays, direc, eta_dev, rule.mode, fields), aux


def flow_settings(cfg: ModelConfig, dt: float, friction: float, options: dict):
    """Validated settings of a gradient-flow run, shared by every backend's integrator:
    (options with defaults, movable fields, per-field step sizes eta (float64), moving fields, rule code,
    adam_beta1, adam_beta2, adam_eps)."""
    opt = check_options("gradient_flow", options, DEFAULTS)
    if opt["rule"] not in MODES:
        raise ValueError(
            f"method 'gradient_flow': option 'rule' must be one of {list(MODES)}, got {opt['rule']!r}"
        )
    if friction != 0.0:
        raise ValueError("method 'gradient_flow': friction applies to Hamiltonian methods only")
    geo = family_of(cfg).geometry
    fields = geo.MOVABLE
    scale = {k: 1.0 for k in fields}
    scale.update(check_fields("gradient_flow", "step_scale", opt["step_scale"], fields))
    if not opt["update_priors"]:
        for k in geo.PRIORS:
            scale[k] = 0.0
    if not opt["update_frames"]:
        scale[geo.FRAME] = 0.0
    eta = np.array([dt * scale[k] for k in fields], np.float64)
    moving = tuple(k for k in fields if scale[k] != 0.0)
    mode = MODES[opt["rule"]]
    b1, b2, eps = float(opt["adam_beta1"]), float(opt["adam_beta2"]), float(opt["adam_eps"])
    if mode == 2 and not (0 <= b1 < 1 and 0 <= b2 < 1 and eps > 0):
        raise ValueError(
            "method 'gradient_flow': adam needs 0 <= adam_beta1, adam_beta2 < 1 and adam_eps > 0"
        )
    return opt, fields, eta, moving, mode, b1, b2, eps


def make_gradient_flow(
    cfg: ModelConfig, dt: float, *, backend, friction: float = 0.0, seed: int = 0, **options
) -> Integrator:
    """Build the ``"gradient_flow"`` integrator on a :class:`vfesim.backends.Backend`; ``dt`` is the step
    size eta."""
    opt, fields, eta, moving, mode, b1, b2, eps = flow_settings(cfg, dt, friction, options)
    efn = energy_fn(cfg, backend, opt["energy"])
    ops = update_ops(cfg, backend)
    dev = ops if backend.on_device else None
    eta_dev = dev.put(eta) if dev is not None else None
    aux_names = tuple(f"adam_{w}_{k}" for k in moving for w in ("m", "v")) if mode == 2 else ()

    rule = FlowRule(ops, eta, mode, moving, b1, b2, eps)

    def _carry(state, step, aux, terms, grads, rng_state=None):
        c = Carry(state, step, aux, terms, rng_state)
        object.__setattr__(c, _CACHE, grads)  # force at `state`, recomputable from it (not checkpointed)
        return c

    restore = make_restore("gradient_flow", cfg, aux_names, dev, efn, _carry)

    def init(state: xr.Dataset) -> Carry:
        aux = {}
        for k in moving if mode == 2 else ():
            aux[f"adam_m_{k}"] = np.zeros_like(state[k].data)
            aux[f"adam_v_{k}"] = np.zeros_like(state[k].data)
        return restore(state, 0, aux, None)

    def step(carry: Carry) -> Carry:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the guard reports instead
            return _step(carry) if dev is None else _step_device(carry)

    def _step_device(carry: Carry) -> Carry:
        grads = getattr(carry, _CACHE, None)
        arrays = state_arrays(carry.state)
        if grads is None:
            grads = efn(arrays)[1]
        n = carry.step + 1
        dev.reset()
        moved, aux = flow_update_device(rule, dev, arrays, grads, carry.aux, n, eta_dev, fields)
        new = {**arrays, **moved}
        dev.prefetch()
        terms, grads = efn(new)
        dev.check(n, new, cfg, aux, terms)
        return _carry(with_arrays(carry.state, new), n, aux, terms, grads)

    def _step(carry: Carry) -> Carry:
        grads = getattr(carry, _CACHE, None)
        arrays = state_arrays(carry.state)
        if grads is None:
            grads = efn(arrays)[1]
        n = carry.step + 1
        new, aux = flow_update(rule, arrays, grads, carry.aux, n)
        guard_state(n, new, cfg, aux)
        terms, grads = efn(new)
        guard_terms(n, terms)
        return _carry(with_arrays(carry.state, new), n, aux, terms, grads)

    return Integrator("gradient_flow", init, step, restore)
