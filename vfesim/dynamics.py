"""In-memory dynamics runs (SPEC §1): ``run_dynamics(state, cfg, method, dt, n_steps)``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from .config import ModelConfig
from .family import family_of
from .integrators import is_hamiltonian, make_integrator
from .observables import Observables
from .schema import history, term_var
from .state import require_dataset

__all__ = ["run_dynamics"]

log = logging.getLogger("vfesim")


def run_dynamics(
    state: xr.Dataset,
    cfg: ModelConfig,
    method: str,
    dt: float,
    n_steps: int,
    friction: float = 0.0,
    record_every: int = 1,
    backend: str = "numpy",
    seed: int = 0,
    observables: Mapping[str, Any] | Sequence[str] | None = None,
    **options,
) -> tuple[xr.Dataset, xr.Dataset]:
    """Integrate ``n_steps`` steps of ``method`` and record energies every ``record_every`` steps.

    history: Dataset over dim ``time`` (coordinates ``step`` = 0, r, 2r, ..., and the last step, and
    ``time`` = step * dt) with ``energy_total`` (F), ``energy_<term>`` per energy term and, for
    Hamiltonian methods, ``energy_kinetic`` and ``energy_hamiltonian`` (names and units:
    docs/outputs.md). Raises DynamicsError (naming step, agent, variable) if a step leaves the state
    non-finite or a covariance non-SPD.

    observables: name -> function of the state Dataset returning a scalar or one value per agent (N,)
    (or a built-in name, or a :class:`vfesim.Observable`), or a list of built-in names
    (:data:`vfesim.observables.BUILTINS`); each is recorded as the history variable ``name``.

    backend "cuda": the state lives on the device for the whole run; the final state is returned on the
    host when ``state`` was given there (NumPy), else as device (CuPy) arrays.

    Density-matrix agents (a :class:`~vfesim.QuantumConfig`) run their own dynamics (spec/quantum.md §3):
    method "channels" (coupling channels, unitary step, dephasing; ``options`` are the fields of
    :class:`vfesim.quantum.QuantumDynamics`) or "mirror_descent"; their history adds purity, entropy and
    the trace, Hermiticity and positivity residuals (:func:`vfesim.quantum.evolve`); every backend
    (cuda and dask through the scenario runs' steppers, see :mod:`vfesim.quantum.family`).
    """
    for key, v in (("n_steps", n_steps), ("record_every", record_every)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (0 if key == "n_steps" else 1):
            raise ValueError(f"{key} must be an integer >= {0 if key == 'n_steps' else 1}, got {v!r}")
    require_dataset(state)
    family = family_of(cfg)
    obs = Observables(observables, cfg, state.sizes.get("agent", 0), reserved=list(state.data_vars))
    if family.geometry is None and family.dynamics is not None:  # the family's own dynamics
        return family.dynamics(
            state, cfg, method, dt, n_steps, record_every=record_every, backend=backend, friction=friction,
            seed=seed, observables=obs, **options,
        )  # fmt: skip
    integ = make_integrator(method, cfg, dt, backend=backend, friction=friction, seed=seed, **options)
    names = ["total", *family.terms] + (["kinetic", "hamiltonian"] if is_hamiltonian(method) else [])
    on_host = all(isinstance(state[k].data, np.ndarray) for k in state.data_vars)
    carry = integ.init(state)
    steps, rows, values = [], [], []

    def record(c):
        steps.append(c.step)
        rows.append([c.terms.get(k, np.nan) for k in names])
        values.append(obs.evaluate(c.state))

    record(carry)
    for i in range(n_steps):
        carry = integ.step(carry)
        if carry.step % record_every == 0 or i == n_steps - 1:
            record(carry)
            log.debug("step %d F=%.10g", carry.step, carry.terms["total"])
    table = np.asarray(rows, np.float64).reshape(len(rows), len(names))
    data = {term_var(k): ((), table[:, j]) for j, k in enumerate(names)}
    data.update(obs.stack(values))
    hist = history(steps, dt, data, {"method": method, "dt": float(dt)}, obs.var_attrs)
    final = carry.state
    if on_host and not all(isinstance(final[k].data, np.ndarray) for k in final.data_vars):
        final = final.as_numpy()
    return final, hist
