"""In-memory dynamics runs (SPEC §1): ``run_dynamics(state, cfg, method, dt, n_steps)``."""

from __future__ import annotations

import logging

import numpy as np
import xarray as xr

from .config import ModelConfig
from .family import family_of
from .integrators import is_hamiltonian, make_integrator
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
    **options,
) -> tuple[xr.Dataset, xr.Dataset]:
    """Integrate ``n_steps`` steps of ``method`` and record energies every ``record_every`` steps.

    history: Dataset over dim ``step`` (coordinate: step numbers 0, r, 2r, ..., and the last step) with
    ``system_free_energy``, ``system_<term>`` per energy term and, for Hamiltonian methods,
    ``system_kinetic`` and ``system_hamiltonian``. Raises DynamicsError (naming step, agent, variable) if
    a step leaves the state non-finite or a covariance non-SPD.

    backend "cuda": the state lives on the device for the whole run; the final state is returned on the
    host when ``state`` was given there (NumPy), else as device (CuPy) arrays.

    Density-matrix agents (a :class:`~vfesim.QuantumConfig`) run their own dynamics (spec/quantum.md §3):
    method "channels" (coupling channels, unitary step, dephasing; ``options`` are the fields of
    :class:`vfesim.quantum.QuantumDynamics`) or "mirror_descent"; their history adds purity, entropy and
    the trace, Hermiticity and positivity residuals (:func:`vfesim.quantum.evolve`).
    """
    for key, v in (("n_steps", n_steps), ("record_every", record_every)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (0 if key == "n_steps" else 1):
            raise ValueError(f"{key} must be an integer >= {0 if key == 'n_steps' else 1}, got {v!r}")
    require_dataset(state)
    family = family_of(cfg)
    if family.geometry is None and family.dynamics is not None:  # the family's own dynamics
        return family.dynamics(
            state, cfg, method, dt, n_steps, record_every=record_every, backend=backend, friction=friction,
            seed=seed, **options,
        )  # fmt: skip
    integ = make_integrator(method, cfg, dt, backend=backend, friction=friction, seed=seed, **options)
    names = ["total", *family_of(cfg).terms] + (["kinetic", "hamiltonian"] if is_hamiltonian(method) else [])
    on_host = all(isinstance(state[k].data, np.ndarray) for k in state.data_vars)
    carry = integ.init(state)
    steps, rows = [], []

    def record(c):
        steps.append(c.step)
        rows.append([c.terms.get(k, np.nan) for k in names])

    record(carry)
    for i in range(n_steps):
        carry = integ.step(carry)
        if carry.step % record_every == 0 or i == n_steps - 1:
            record(carry)
            log.debug("step %d F=%.10g", carry.step, carry.terms["total"])
    table = np.asarray(rows, np.float64).reshape(len(rows), len(names))
    out = {
        ("system_free_energy" if k == "total" else f"system_{k}"): ("step", table[:, j])
        for j, k in enumerate(names)
    }
    hist = xr.Dataset(
        out, coords={"step": np.asarray(steps, np.int64)}, attrs={"method": method, "dt": float(dt)}
    )
    final = carry.state
    if on_host and not all(isinstance(final[k].data, np.ndarray) for k in final.data_vars):
        final = final.as_numpy()
    return final, hist
