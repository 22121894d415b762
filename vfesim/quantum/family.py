"""Density-matrix ("quantum") agents as an agent family (spec/quantum.md): the record the registry
hands out. Their motion is not a flow of the shared integrators (``geometry=None``): channels, unitary
steps and F-flows of :mod:`.evolve` (spec §3), reached through :func:`vfesim.run_dynamics`."""

from __future__ import annotations

from ..family import AgentFamily, RunSpec, register
from . import runs, state
from .config import QuantumConfig
from .energy import NUMPY_OPS, TERMS, attention, energy_and_gradient
from .evolve import QuantumDynamics, evolve

# run_dynamics methods of this family: the synchronous step of spec §3 (coupling channels, unitary step,
# dephasing, optional mirror-descent steps), and pure mirror descent on F (§3.4).
METHODS = ("channels", "mirror_descent")


def run_dynamics(state, cfg, method, dt, n_steps, *, record_every=1, backend="numpy", friction=0.0, seed=0,
                 observables=None, **options):  # fmt: skip
    """:func:`vfesim.run_dynamics` for density-matrix agents: ``options`` are the fields of
    :class:`.evolve.QuantumDynamics`; method "mirror_descent" means no coupling and ``mirror_steps``
    (default 1) Armijo mirror-descent steps per step. Backends "numpy" and "numba" run
    :func:`.evolve.evolve` (the per-agent stages in the backend's kernels); "cuda" and "dask" step the
    scenario runs' steppers (:mod:`.runs`: the state resident on the device, or chunked on the Dask
    workers) and record the same history, with ``system_mirror_eta`` NaN (those steppers do not report
    the accepted step) and, on dask, rho gathered to the client at every recorded step. The dynamics is
    deterministic: ``seed`` is unused. ``observables``: see :func:`vfesim.run_dynamics`."""
    from ..backends import get

    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not a density-matrix method; choose one of {list(METHODS)}")
    if friction != 0.0:
        raise ValueError("friction: density-matrix dynamics have no momenta (friction must be 0)")
    be = get(backend)
    if be.name not in runs.BACKENDS:
        raise ValueError(f"backend: density-matrix dynamics run on {list(runs.BACKENDS)}, got {be.name!r}")
    known = set(QuantumDynamics.__dataclass_fields__)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown option of density-matrix dynamics (known: {sorted(known)})")
    if method == "mirror_descent":
        options = {"coupling": "none", "mirror_steps": 1} | options
    dyn = QuantumDynamics(**options)
    if be.name in ("cuda", "dask"):
        return _stepped(state, cfg, dyn, dt, n_steps, record_every, be, observables)
    ops = be.agent_ops.get("quantum", NUMPY_OPS)
    return evolve(
        state, cfg, dyn, dt, n_steps, record_every=record_every, ops=ops, observables=observables
    )  # fmt: skip


def _stepped(qstate, cfg, dyn, dt, n_steps: int, record_every: int, be, observables):
    """:func:`run_dynamics` through the runs' stepper of backend ``be`` (cuda, dask)."""
    import math

    import numpy as np

    from ..arrays import host_array
    from ..config import _check_real
    from ..observables import Observables
    from ..schema import history
    from .evolve import _diagnostics, _with_rho

    dt = _check_real("dt", dt, positive=True)
    if dyn.neighbours is not None:
        raise ValueError(
            f"neighbours: a coupling window other than the config's runs on 'numpy' and 'numba', not "
            f"{be.name!r} (on {be.name!r} the channels couple the config's neighbours)"
        )
    obs = observables  # (the stepper's init validates the state: per chunk on dask)
    if not isinstance(obs, Observables):
        obs = Observables(obs, cfg, qstate.sizes["agent"], reserved=list(qstate.data_vars))
    integ = {**runs.INTEGRATOR, **{k: getattr(dyn, k) for k in runs.DYNAMICS}}
    integ.update(method="channels", dt=dt, observe="none")
    stepper = runs.make_integrator(cfg, integ, backend=be)
    on_host = all(isinstance(qstate[k].data, np.ndarray) for k in qstate.data_vars)
    host = host_array
    rows, steps, values = [], [], []

    def record(c) -> None:
        rho = host(c.state["rho"].data)
        row = _diagnostics(rho, c.terms)
        row["system_mirror_eta"] = math.nan
        rows.append(row)
        steps.append(c.step)
        if obs.entries:
            values.append(obs.evaluate(_with_rho(qstate, rho)))

    carry = stepper.init(qstate)
    record(carry)
    for k in range(1, n_steps + 1):
        carry = stepper.step(carry)
        if k % record_every == 0 or k == n_steps:
            record(carry)
    data = {}
    for key in rows[0]:
        data[key] = (("agent",) if key.startswith("agent_") else (), np.stack([host(r[key]) for r in rows]))
    data.update(obs.stack(values) if obs.entries else {})
    attrs = {"family": "quantum", "dt": dt, "dynamics": repr(dyn), "backend": be.name}
    final = carry.state
    if on_host and not all(isinstance(final[k].data, np.ndarray) for k in final.data_vars):
        final = final.as_numpy()
    return final, history(steps, dt, data, attrs, obs.var_attrs)


__all__ = ["QUANTUM"]

QUANTUM = register(
    AgentFamily(
        name="quantum",
        config_type=QuantumConfig,
        variables=state.VARIABLES,
        attributes=state.ATTRIBUTES,
        required=state.REQUIRED,
        terms=TERMS,
        trajectory=("rho", "phi"),
        make_state=state.make_state,
        random_state=state.random_state,
        validate_state=state.validate_state,
        energy_and_gradient=energy_and_gradient,
        attention=attention,
        geometry=None,
        dynamics=run_dynamics,
        runs=RunSpec(
            section=runs.SECTION,
            defaults=runs.DEFAULTS,
            validate=runs.validate,
            config_dict=runs.config_dict,
            initial_state=runs.initial_state,
            make_integrator=runs.make_integrator,
            dtypes=runs.RUN_DTYPES,
            backends=runs.BACKENDS,
            docs=runs.DOCS,
        ),
    )
)
