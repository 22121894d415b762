"""Geometry of field agents for the integrators (SPEC §2.5): every (agent, grid point) is a point agent.

Field agents move with the point-agent geometry (:mod:`vfesim.gaussian.geometry`: the Fisher–Rao flow
with the exponential-map retraction, the log-Cholesky chart and its Fisher metric, frames kept in the
principal ball) and the same variables (:data:`MOVABLE`, :data:`BLOCKS`). :class:`FieldUpdates` flattens
(agent, *grid) into the batch axis of a backend's point-agent update operations and reshapes back; the
chart maps and the Fisher metric take the grid dims as batch dims as they are. Integrator arrays
(momenta, log-Cholesky coordinates, Adam moments) keep the state's dims: (agent, *grid, ...).

The support chi is fixed: no integrator moves it. Points outside an agent's support (chi = 0) carry no
energy and get a zero gradient, and the updates leave them bitwise unchanged: the gradient flow updates
the covered points only (the retraction at a zero force is the identity only up to rounding), a
kick/drift with zero force and zero momentum adds exact zeros, and Hamiltonian methods start their
momenta at 0 there (:func:`frozen`). Hamiltonian methods re-express every covariance through its
Cholesky chart once, at init (a rounding-level change, as for point agents).
"""

from __future__ import annotations

from typing import Any

from ..arrays import array_module
from ..gaussian.geometry import BLOCKS, FRAME, MOVABLE, PRIORS

__all__ = ["MOVABLE", "BLOCKS", "FRAME", "PRIORS", "FieldUpdates", "adapt_updates", "frozen"]


def frozen(state) -> Any:
    """Points no integrator moves: chi_i(c) == 0, a bool array (agent, *grid) (the state's array type)."""
    return state["support"].data == 0


def adapt_updates(ops: Any, cfg) -> FieldUpdates:
    """The point-agent update operations ``ops`` of a backend (``backend.updates(K)``) for field agents."""
    return FieldUpdates(ops)


def _batch(a, tail: int, view: bool = False):
    """``a`` (agent, *grid, *tail) as (rows, *tail); ``view``: a view, which the kick/drift writes
    through (the integrators pass their own C-contiguous copies)."""
    if view and not a.flags.c_contiguous:
        raise ValueError(f"field integrator arrays written in place must be C-contiguous, got {a.strides}")
    return a.reshape(-1, *a.shape[a.ndim - tail :])


class FieldUpdates:
    """A backend's point-agent update operations over the (agent, *grid) batch of field agents.

    ``gradient_flow`` runs on the covered points (chi > 0) and scatters the results into copies of
    the state's arrays; ``kick_drift`` and ``theta_to_sigma`` run on every point through reshaped views.
    Anything else (device placement, the guard, Adam moments: elementwise) is the wrapped operations'.
    """

    def __init__(self, ops: Any):
        self.ops = ops

    def __getattr__(self, name: str) -> Any:
        if name == "ops":  # not set yet (e.g. during copy): no recursion
            raise AttributeError(name)
        return getattr(self.ops, name)

    def gradient_flow(self, arrays, direc, eta, mode: int, *fields) -> dict:
        """One fused gradient-flow step of the covered points (the wrapped ``gradient_flow``, whose extra
        arguments ``fields`` are passed on); points outside the supports are returned as they were."""
        xp = array_module(arrays["support"])
        lead = arrays["support"].ndim
        rows = xp.flatnonzero(arrays["support"].reshape(-1) > 0)
        take = lambda a: a.reshape(-1, *a.shape[lead:])[rows]
        sub = {k: take(arrays[k]) for k in MOVABLE}
        new = self.ops.gradient_flow(sub, {k: take(direc[k]) for k in MOVABLE}, eta, mode, *fields)
        out = {}
        for k, v in new.items():
            if v is sub[k]:  # not moved (a step size of 0)
                out[k] = arrays[k]
                continue
            full = xp.array(arrays[k], order="C", copy=True)
            full.reshape(-1, *v.shape[1:])[rows] = v
            out[k] = full
        return out

    def kick_drift(self, args, sigma, phi_args):
        """The wrapped ``kick_drift`` in place on (agent, *grid) arrays; returns the new covariance
        (``sigma`` itself when the drift is 0)."""
        x_mu, x_th, p_mu, p_th, g_mu, g_sigma, *scalars = args
        flat = (
            _batch(x_mu, 1, True), _batch(x_th, 1, True), _batch(p_mu, 1, True), _batch(p_th, 1, True),
            _batch(g_mu, 1), _batch(g_sigma, 2), *scalars,
        )  # fmt: skip
        if phi_args[4]:
            x_phi, p_phi, g_phi, *rest = phi_args
            phi_args = (_batch(x_phi, 1, True), _batch(p_phi, 1, True), _batch(g_phi, 1), *rest)
        S = self.ops.kick_drift(flat, _batch(sigma, 2), phi_args)
        return S.reshape(sigma.shape)

    def theta_to_sigma(self, theta):
        """Sigma (agent, *grid, K, K) of log-Cholesky coordinates theta (agent, *grid, T)."""
        S = self.ops.theta_to_sigma(_batch(theta, 1))
        return S.reshape(*theta.shape[:-1], *S.shape[-2:])
