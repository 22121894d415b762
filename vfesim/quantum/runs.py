"""Density-matrix runs from scenario files (issue 13 "Runs"): the family's scenario sections and the
steppers the run loop (:mod:`vfesim.simulate`) drives, checkpoints and resumes.

Sections of a density-matrix scenario (the ``[quantum]`` section selects the family; every key is
optional except ``quantum.d``, ``population.n_agents`` and ``integrator.dt``)::

    [quantum]      QuantumConfig fields: d, lambda_self, lambda_belief, lambda_prior, lambda_obs,
                   kappa_beta, kappa_gamma, aggregator
    [population]   n_agents, seed, spectrum_spread, hamiltonian ("random": one random H_i per agent,
                   "shared": one random H for all, "zero"), hamiltonian_scale, temperature_range,
                   phi_radius, neighbours ("dense" | "ring" with half_width | "causal" with window:
                   the senders j in [i - window, i)); the neighbours serve the alignment terms of F
                   and the coupling channels alike
    [integrator]   method, dt, observe, and the QuantumDynamics fields (coupling, coupling_strength,
                   coupling_length, positions, order, dephasing_rate, dephasing_basis, thermal_rate,
                   gate, gate_threshold, gate_width, mirror_steps, mirror_eta, armijo_c,
                   max_backtracks; rates may be one number or a list with one per agent);
                   method "fit" adds horizon, lr, perturbation, shared
    [run]          as for every run; dtype "complex128" (default) or "complex64"; backend "numpy",
                   "numba", "cuda" ("channels" and "mirror_descent"; "fit" on numpy or numba)
                   or "dask" (agent chunks, `run.chunks`; "channels" and "mirror_descent":
                   :mod:`.chunked`)

Methods (one run step each):

- "channels": one synchronous step of :mod:`.evolve` (coupling channels, unitary step, dephasing,
  thermalising channel), then ``mirror_steps`` Armijo mirror-descent steps on F. With
  ``observe = "born"`` each agent's outcome y_i ~ <k|rho_i|k> is drawn after the channels (before the
  mirror steps, which then see it through the lambda_obs term) from the run's RNG (seeded by
  ``run.seed``; its state is in every checkpoint), and ``outcome`` is saved per frame.
- "mirror_descent": the same with coupling "none" and one mirror step by default (as
  :func:`vfesim.run_dynamics`).
- "fit": Hamiltonian learning (:mod:`.fit`). The population is the truth. At init, ``horizon`` steps
  of its dynamics are rolled out and one Born outcome per agent and step is drawn from the states (run
  RNG); the estimate starts at H_true + a random traceless Hermitian perturbation of Frobenius norm
  ``perturbation`` per agent (one for all with ``shared``, which needs population.hamiltonian =
  "shared" and fits one H for every agent). Each run step is one Adam step (learning rate ``lr``,
  betas (0.9, 0.999), eps 1e-8, exactly :func:`.fit.fit`'s) on the exact gradient of the rollout's Born
  loss; frames hold the estimate ``hamiltonian``, terms are ``born_loss``, ``grad_norm``
  (|dL/dtheta|_inf) and ``hamiltonian_error`` (root mean square over agents of the Frobenius norm of
  the traceless part of H_i - H_true,i: the trace of H is not identifiable). The store's ``time`` is
  iteration * dt there.

Terms of "channels" / "mirror_descent" frames: F and its terms (:data:`.energy.TERMS`). After every
step rho is checked: non-finite values, loss of positivity or a trace drift beyond 1000 u d stop the run
with a DynamicsError naming the step, agent and variable.

Backends: the channel step runs in the backend's kernels (``QuantumOps.channel_step``; the array code on
numpy), F in its per-agent stages and pair kernels (:func:`.energy.energy_and_gradient`). On "cuda" the
state and the per-run caches (:func:`.evolve.prepare`, with the kernels' constants made on the device
once) stay on the device between steps; per step the host receives the energy terms (floats), the
guard's verdicts and, with ``observe = "born"``, the diagonals (N, d) the outcomes are drawn from (on the
host, from the run's RNG: the same draws as on numpy for the same probabilities); frames and checkpoints
are copied by the run loop when saved.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import xarray as xr

from ..arrays import array_module as _xp
from ..arrays import host_array
from ..config import ConfigError, SparseNeighbours, scenario_bool, scenario_range, scenario_real
from ..integrators.base import Carry, DynamicsError, with_arrays
from .channels import causal_window
from .config import AGGREGATORS, QuantumConfig
from .energy import NUMPY_OPS, energy_and_gradient
from .evolve import COUPLINGS, DEPHASING_BASES, GATES, ORDERS, QuantumDynamics, _check, prepare, step
from .fit import objective
from .flows import mirror_descent_step
from .linalg import traceless
from .rollout import Schedule
from .state import random_state, validate_state

__all__ = ["METHODS", "SECTION", "QuantumIntegrator", "validate", "initial_state", "make_integrator"]

SECTION = "quantum"
METHODS = ("channels", "mirror_descent", "fit")
OBSERVE = ("none", "born")
HAMILTONIANS = ("random", "shared", "zero")
NEIGHBOURS = ("dense", "ring", "causal")
BACKENDS = ("numpy", "numba", "cuda", "dask")

CONFIG = {
    f.name: f.default for f in dataclasses.fields(QuantumConfig) if f.name not in ("dtype", "neighbours")
}
POPULATION = {
    "n_agents": None,
    "seed": 0,
    "spectrum_spread": 3.0,
    "hamiltonian": "random",
    "hamiltonian_scale": 1.0,
    "temperature_range": (0.5, 2.0),
    "phi_radius": 1.0,
    "neighbours": "dense",
    "half_width": None,
    "window": None,
}
DYNAMICS = {f.name: f.default for f in dataclasses.fields(QuantumDynamics) if f.name != "neighbours"}
CHOICES = {"coupling": COUPLINGS, "order": ORDERS, "gate": GATES, "dephasing_basis": DEPHASING_BASES}
PER_AGENT = ("dephasing_rate", "thermal_rate")
FIT = {"horizon": None, "lr": 0.05, "perturbation": 0.4, "shared": True}
INTEGRATOR = {"method": "channels", "dt": None, "observe": "none", **DYNAMICS, **FIT}
# Defaults that depend on the method (as vfesim.run_dynamics).
METHOD_DEFAULTS = {"mirror_descent": {"coupling": "none", "mirror_steps": 1}}

# Every key of the sections above: key -> (type, one-line description); the scenario-key reference of the
# docs is generated from these (RunSpec.docs, vfesim.scenario.key_reference).
DOCS = {
    SECTION: {
        "d": ("int >= 2", "Hilbert dimension of every agent. Required"),
        "lambda_self": ("float >= 0", "weight of the self term sum_i D(rho_i || sigma_i)"),
        "lambda_belief": ("float >= 0", "weight of belief alignment of the pulled-back states"),
        "lambda_prior": ("float >= 0", "weight of prior alignment of the pulled-back Gibbs priors"),
        "lambda_obs": ("float >= 0", "weight of the Born term -log <y_i|rho_i|y_i> (0 with method 'fit')"),
        "kappa_beta": ("float > 0", "temperature of the belief-alignment aggregator"),
        "kappa_gamma": ("float > 0", "temperature of the prior-alignment aggregator"),
        "aggregator": ('"softmin" | "expected"', "how an agent aggregates its divergences to the neighbours"),
    },
    "population": {
        "n_agents": ("int >= 1", "number of agents. Required"),
        "seed": ("int >= 0", "seed of the initial population"),
        "spectrum_spread": ("float >= 0", "rho_i eigenvalues ~ exp(U[0, spread]), normalised (full rank)"),
        "hamiltonian": ('"random" | "shared" | "zero"', "one random H_i per agent, one H for all, or H = 0"),
        "hamiltonian_scale": ("float >= 0", "scale of the random Hermitian H (divided by sqrt(d))"),
        "temperature_range": ("[float, float]", "temperatures T_i log-uniform in [lo, hi]"),
        "phi_radius": ("float >= 0", "frames uniform in the ball |phi| <= phi_radius"),
        "neighbours": (
            '"dense" | "ring" | "causal"',
            "senders of each agent, for the alignment terms and the coupling channels",
        ),
        "half_width": ("int >= 1", 'neighbours on each side with neighbours = "ring" (then required)'),
        "window": ("int >= 1", 'senders j in [i - window, i) with neighbours = "causal" (then required)'),
    },
    "integrator": {
        "method": (
            '"channels" | "mirror_descent" | "fit"',
            "one step of the dynamics, or Hamiltonian learning",
        ),
        "dt": ("float > 0", "time step. Required"),
        "observe": ('"none" | "born"', "draw a Born outcome per agent after the channels (saved per frame)"),
        "coupling": (
            '"C1" | "C2" | "none"',
            "partial replacement, neighbour-basis dephasing, or no coupling",
        ),
        "coupling_strength": ("float in [0, 1]", "eps0 of the coupling eps_ij = eps0 exp(-dist(i, j)/ell)"),
        "coupling_length": ("float > 0", "ell of the coupling eps_ij = eps0 exp(-dist(i, j)/ell)"),
        "positions": ("list[list[float]]", "agent positions (N, p) for dist(i, j); default: dist = |i - j|"),
        "order": (
            '"jacobi" | "gauss_seidel"',
            "agents coupled to the old states, or to those already updated",
        ),
        "dephasing_rate": ("float | list[float]", "dephasing rate gamma_i >= 0 (one, or one per agent)"),
        "dephasing_basis": ('"computational" | "energy"', "basis of the dephasing channel"),
        "thermal_rate": ("float | list[float]", "rate >= 0 of the thermalising channel towards sigma_i"),
        "gate": ('"none" | "soft" | "hard"', "gate of the coupling by D(rho_i || sigma_i)"),
        "gate_threshold": ("float", "threshold of the gate"),
        "gate_width": ("float > 0", "width of the soft gate's sigmoid"),
        "mirror_steps": ("int >= 0", "Armijo mirror-descent steps on F per step (mirror_descent: 1)"),
        "mirror_eta": ("float > 0", "initial step of the mirror-descent line search"),
        "armijo_c": ("float in (0, 1)", "sufficient-decrease constant of the line search"),
        "max_backtracks": ("int >= 0", "halvings of the line search before giving up"),
        "horizon": ("int >= 1", "method 'fit': rollout steps of the observed sequence (then required)"),
        "lr": ("float > 0", "method 'fit': Adam learning rate"),
        "perturbation": (
            "float >= 0",
            "method 'fit': Frobenius norm of the initial error of each H estimate",
        ),
        "shared": ("bool", "method 'fit': fit one H for all agents (needs hamiltonian = 'shared')"),
    },
}
ADAM = (0.9, 0.999, 1e-8)


def _int(key: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ConfigError(key, f"must be an integer, got {type(v).__name__} {v!r}")
    if v < lo:
        raise ConfigError(key, f"must be >= {lo}, got {v}")
    return int(v)


_real, _bool, _range = scenario_real, scenario_bool, scenario_range


def _plain(v: Any) -> Any:
    """A validated value as stored with the run (JSON): arrays as lists."""
    return np.asarray(v).tolist() if isinstance(v, (np.ndarray, list, tuple)) else v


def _config(d: dict, pr, nb: Any, dtype: Any) -> Any:
    """The QuantumConfig of ``[quantum]`` (neighbours ``nb`` from the population); BAD on a problem."""
    sec = {**CONFIG, **pr.unknown(SECTION, d, CONFIG)}
    n_bad = len(pr.errors)
    if sec["d"] is None:
        pr.add(f"{SECTION}.d", "is required (the Hilbert dimension, an integer >= 2)")
    sec["aggregator"] = pr.choice(f"{SECTION}.aggregator", sec["aggregator"], AGGREGATORS)
    for k, v in sec.items():  # every key on its own: all problems at once
        if k != "aggregator" and v is not None:
            pr.get(f"{SECTION}.{k}", _config_key, k, v)
    if len(pr.errors) > n_bad or pr.BAD in (dtype, nb):
        return pr.BAD
    return QuantumConfig(**sec, neighbours=nb, dtype=dtype)


def _config_key(key: str, k: str, v: Any) -> None:
    try:
        QuantumConfig(**{"d": 2, k: v})
    except ConfigError as e:
        raise ConfigError(key, str(e).split(": ", 1)[1]) from None


def _population(d: dict, pr) -> dict:
    p = {**POPULATION, **pr.unknown("population", d, POPULATION)}
    if p["n_agents"] is None:
        p["n_agents"] = pr.add("population.n_agents", "is required")
    else:
        p["n_agents"] = pr.get("population.n_agents", _int, p["n_agents"], 1)
    n = p["n_agents"]
    p["seed"] = pr.get("population.seed", _int, p["seed"], 0)
    p["spectrum_spread"] = pr.get("population.spectrum_spread", _real, p["spectrum_spread"], 0.0)
    p["hamiltonian"] = pr.choice("population.hamiltonian", p["hamiltonian"], HAMILTONIANS)
    p["hamiltonian_scale"] = pr.get("population.hamiltonian_scale", _real, p["hamiltonian_scale"], 0.0)
    p["temperature_range"] = pr.get("population.temperature_range", _range, p["temperature_range"])
    p["phi_radius"] = pr.get("population.phi_radius", _real, p["phi_radius"], 0.0)
    kind = p["neighbours"] = pr.choice("population.neighbours", p["neighbours"], NEIGHBOURS)
    for key, needs, lo in (("half_width", "ring", 1), ("window", "causal", 1)):
        if p[key] is None:
            if kind == needs:
                p[key] = pr.add(f"population.{key}", f"is required with neighbours = {needs!r}")
            continue
        if kind != needs:
            if kind is not pr.BAD:
                p[key] = pr.add(f"population.{key}", f"only valid with neighbours = {needs!r}")
            continue
        p[key] = pr.get(f"population.{key}", _int, p[key], lo)
    if kind == "ring" and pr.BAD not in (n, p["half_width"]) and 2 * p["half_width"] > n - 1:
        p["half_width"] = pr.add(
            "population.half_width", f"2*half_width must be <= n_agents-1 = {n - 1}, got {p['half_width']}"
        )
    return p


def neighbours(pop: dict) -> Any:
    """The population's neighbours: "dense" or a SparseNeighbours (ring, causal window)."""
    n = pop["n_agents"]
    if pop["neighbours"] == "ring":
        return SparseNeighbours.ring(n, pop["half_width"])
    if pop["neighbours"] == "causal":
        return causal_window(n, pop["window"])
    return "dense"


def _per_agent(key: str, v: Any, n: Any) -> Any:
    if isinstance(v, list) and n is not None and len(v) != n:
        raise ConfigError(key, f"has {len(v)} values for {n} agents (give one number, or one per agent)")
    return v


def _dynamics_key(key: str, k: str, v: Any) -> None:
    try:
        QuantumDynamics(**{k: v})
    except ConfigError as e:
        raise ConfigError(key, str(e).split(": ", 1)[1]) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(key, f"invalid value {v!r} ({e})") from None


def _integrator(d: dict, pr, n: Any) -> dict:
    given = pr.unknown("integrator", d, INTEGRATOR)
    method = pr.choice("integrator.method", given.get("method", "channels"), METHODS)
    p = {**INTEGRATOR, **METHOD_DEFAULTS.get(method, {}), **given, "method": method}
    if p["dt"] is None:
        p["dt"] = pr.add("integrator.dt", "is required")
    else:
        p["dt"] = pr.get("integrator.dt", _real, p["dt"], 0.0, strict=True)
    p["observe"] = pr.choice("integrator.observe", p["observe"], OBSERVE)
    n = None if n is pr.BAD else n
    for k in DYNAMICS:
        v = p[k]
        if k in CHOICES:
            p[k] = v = pr.choice(f"integrator.{k}", v, CHOICES[k])
            if v is pr.BAD:
                continue
        if k in PER_AGENT and pr.get(f"integrator.{k}", _per_agent, v, n) is pr.BAD:
            p[k] = pr.BAD
            continue
        if k == "positions" and v is not None:
            if not isinstance(v, list) or (n is not None and len(v) != n):
                p[k] = pr.add(f"integrator.{k}", f"must be a list of one position per agent ({n}), got {v!r}")
                continue
        if pr.get(f"integrator.{k}", _dynamics_key, k, v) is pr.BAD:
            p[k] = pr.BAD
        else:
            p[k] = _plain(v) if k in (*PER_AGENT, "positions") else getattr(QuantumDynamics(**{k: v}), k)
    if method == "fit":
        if p["horizon"] is None:
            p["horizon"] = pr.add("integrator.horizon", "is required with method = 'fit' (rollout steps)")
        else:
            p["horizon"] = pr.get("integrator.horizon", _int, p["horizon"], 1)
        p["lr"] = pr.get("integrator.lr", _real, p["lr"], 0.0, strict=True)
        p["perturbation"] = pr.get("integrator.perturbation", _real, p["perturbation"], 0.0)
        p["shared"] = pr.get("integrator.shared", _bool, p["shared"])
        for k, bad in (("mirror_steps", 0), ("observe", "none")):
            if p[k] not in (bad, pr.BAD):
                p[k] = pr.add(f"integrator.{k}", f"must be {bad!r} with method = 'fit'")
    else:
        for k in FIT:
            if k in given and method is not pr.BAD:
                pr.add(f"integrator.{k}", "only valid with method = 'fit'")
            p.pop(k)
    return p


def validate(sections: dict, dtype: Any, pr) -> tuple[Any, Any, Any]:
    """The family's sections (RunSpec.validate): (QuantumConfig, population, integrator)."""
    pop = _population(sections["population"], pr)
    integ = _integrator(sections["integrator"], pr, pop["n_agents"])
    bad_nb = pr.BAD in (pop["n_agents"], pop["neighbours"], pop["half_width"], pop["window"])
    cfg = _config(sections[SECTION], pr, pr.BAD if bad_nb else neighbours(pop), dtype)
    if (
        integ["method"] == "fit"
        and integ.get("shared") is True
        and pop["hamiltonian"] not in ("shared", pr.BAD)
    ):
        pr.add("integrator.shared", "fits one H for all agents: needs population.hamiltonian = 'shared'")
    if cfg is not pr.BAD and cfg.lambda_obs > 0 and integ["method"] == "fit":
        pr.add(f"{SECTION}.lambda_obs", "must be 0 with method = 'fit' (the rollout loss is the Born loss)")
    return cfg, pop, integ


def config_dict(cfg: QuantumConfig) -> dict:
    d = cfg.to_dict(neighbour_lists=False)
    return {k: v for k, v in d.items() if k in CONFIG}


def initial_state(cfg: QuantumConfig, pop: dict, integ: dict, dtype: str) -> xr.Dataset:
    """The population (:func:`.state.random_state` with the population keys); outcomes are drawn when
    lambda_obs > 0 or the run observes."""
    st = random_state(
        cfg,
        pop["n_agents"],
        seed=pop["seed"],
        dtype=dtype,
        spectrum_spread=pop["spectrum_spread"],
        hamiltonian_scale=pop["hamiltonian_scale"],
        temperature_range=tuple(pop["temperature_range"]),
        phi_radius=pop["phi_radius"],
        outcome=cfg.lambda_obs > 0 or integ["observe"] == "born",
    )
    H = st["hamiltonian"].values
    if pop["hamiltonian"] == "zero":
        H = np.zeros_like(H)
    elif pop["hamiltonian"] == "shared":
        H = np.broadcast_to(H[0], H.shape).copy()
    return st.assign(hamiltonian=(st["hamiltonian"].dims, H))


def dynamics(integ: dict) -> QuantumDynamics:
    """The QuantumDynamics of a validated integrator section."""
    return QuantumDynamics(**{k: integ[k] for k in DYNAMICS})


# --------------------------------------------------------------------------------------------- steppers


class QuantumIntegrator(NamedTuple):
    """init/step/restore of a density-matrix run (as :class:`~vfesim.integrators.Integrator`);
    trajectory: the variables saved per frame."""

    name: str
    init: Callable[[xr.Dataset], Carry]
    step: Callable[[Carry], Carry]
    restore: Callable[..., Carry]
    trajectory: tuple[str, ...]


_CACHE = "_quantum_cache"  # per-carry caches (recomputable from the state: never checkpointed)


def _with_cache(carry: Carry, cache: Any) -> Carry:
    object.__setattr__(carry, _CACHE, cache)
    return carry


def _arrays(state: xr.Dataset) -> dict[str, Any]:
    return {k: state[k].data for k in state.data_vars}


def _born_sample(rng: np.random.Generator, rho) -> np.ndarray:
    """One computational-basis outcome per agent, y_i ~ <k|rho_i|k> (inverse CDF of one uniform each),
    drawn on the host: only the diagonals (N, d) of device states are copied."""
    return born_outcomes(rho, rng.random(rho.shape[0]))


def born_outcomes(rho, u: np.ndarray) -> np.ndarray:
    """The outcomes of :func:`_born_sample` from the agents' uniforms u (N,) in [0, 1): per agent."""
    xp = _xp(rho)
    p = np.maximum(host_array(xp.ascontiguousarray(rho.diagonal(axis1=1, axis2=2).real)), 0.0)
    cdf = np.cumsum(p, axis=1)
    u = u * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(axis=1), p.shape[1] - 1).astype(np.int64)


def _channels(cfg: QuantumConfig, integ: dict, be, seed: int) -> QuantumIntegrator:
    """The stepper of "channels" / "mirror_descent" on backend ``be``; on a device backend (cuda) the state
    and the per-run caches stay on the device, the host sees the energy terms (floats), the diagonals for
    Born draws and the guard's verdicts; frames are copied by the run loop when saved."""
    dyn = dynamics(integ)
    dt = integ["dt"]
    observe = integ["observe"] == "born"
    ops = be.agent_ops.get("quantum", NUMPY_OPS)

    def energy(arrays):  # F with the backend's per-agent stages and pair kernels
        return energy_and_gradient(arrays, cfg, be)

    def terms_of(arrays) -> dict[str, float]:
        return {k: float(v) for k, v in energy(arrays)[0].items()}

    def placed(state: xr.Dataset) -> xr.Dataset:  # checkpoints and initial states arrive on the host
        return with_arrays(state, be.to_device(_arrays(state))) if be.on_device else state

    def restore(state: xr.Dataset, step_no: int, aux: dict, rng_state: dict | None = None) -> Carry:
        if aux:
            raise ValueError(f"{integ['method']} restore: no aux arrays expected, got {sorted(aux)}")
        if observe and rng_state is None:
            raise ValueError("observe = 'born' needs the run's RNG state")
        state = placed(state)
        validate_state(state, cfg)
        arrays = _arrays(state)
        P = prepare(arrays, cfg, dyn)
        return _with_cache(Carry(state, int(step_no), {}, terms_of(arrays), rng_state), P)

    def init(state: xr.Dataset) -> Carry:
        rng = np.random.default_rng(seed) if observe else None
        return restore(state, 0, {}, rng.bit_generator.state if observe else None)

    def step_fn(carry: Carry) -> Carry:
        P = getattr(carry, _CACHE, None)
        arrays = _arrays(carry.state)
        if P is None:
            P = prepare(arrays, cfg, dyn)
        k = carry.step + 1
        rng_state = carry.rng_state
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the guard reports instead
            rho = _kernel_guard(k, lambda: step(P, arrays["rho"], dt, dyn, ops=ops)[0])
            if observe or dyn.mirror_steps:
                _check(rho, k)  # sampling and mirror steps need a valid state
            if observe:
                rng = np.random.Generator(np.random.PCG64())  # the run's generator (default_rng's)
                rng.bit_generator.state = rng_state
                y = _born_sample(rng, rho)
                arrays["outcome"] = be.to_device({"y": y})["y"] if be.on_device else y
                rng_state = rng.bit_generator.state
            for _ in range(dyn.mirror_steps):
                rho, _ = mirror_descent_step(
                    {**arrays, "rho": rho},
                    cfg,
                    eta0=dyn.mirror_eta,
                    armijo_c=dyn.armijo_c,
                    max_backtracks=dyn.max_backtracks,
                    energy=energy,
                )
        _check(rho, k)
        arrays["rho"] = rho
        state = with_arrays(carry.state, arrays)
        terms = terms_of(arrays)
        bad = [t for t, v in terms.items() if not np.isfinite(v)]
        if bad:
            raise DynamicsError(k, f"terms[{bad[0]!r}]", f"energy term is {terms[bad[0]]}")
        return _with_cache(Carry(state, k, {}, terms, rng_state), P)

    traj = ("rho", "outcome") if observe else ("rho",)
    return QuantumIntegrator(integ["method"], init, step_fn, restore, traj)


def _kernel_guard(step_no: int, fn: Callable):
    """``fn()``; a state the kernels refuse (ValueError "var[agent=i]: ...", e.g. a coupled state the gate's
    relative entropy cannot take, where the array code gives NaN) stops the run as the guard does."""
    try:
        return fn()
    except ValueError as e:
        m = re.fullmatch(r"(\w+)\[agent=(\d+)\]: (.*)", str(e), re.S)
        if m is None:
            raise
        raise DynamicsError(step_no, m[1], m[3], int(m[2])) from None


def _hamiltonian_error(H, H_true) -> float:
    """Root mean square over agents of |traceless(H_i - H_true,i)|_F."""
    E = traceless(np.asarray(H) - np.asarray(H_true))
    return float(np.sqrt(np.mean(np.sum(np.abs(E) ** 2, axis=(1, 2)))))


def _synthetic_outcomes(state: xr.Dataset, cfg, dyn, dt, T: int, rng) -> np.ndarray:
    """(T, N) Born outcomes of the true dynamics: one per agent after every step."""
    P = prepare(_arrays(state), cfg, dyn)
    rho, ys = state["rho"].values, []
    for _ in range(T):
        rho = step(P, rho, dt, dyn)[0]
        ys.append(_born_sample(rng, rho))
    return np.stack(ys)


def _perturbation(rng, n: int, d: int, size: float, shared: bool) -> np.ndarray:
    """Random traceless Hermitian (n, d, d) matrices of Frobenius norm ``size`` (one for all if shared)."""
    m = 1 if shared else n
    Z = rng.standard_normal((m, d, d)) + 1j * rng.standard_normal((m, d, d))
    E = traceless(0.5 * (Z + Z.conj().swapaxes(1, 2)))
    E *= size / np.linalg.norm(E, axis=(1, 2))[:, None, None]
    return np.broadcast_to(E, (n, d, d)).copy()


def _fit(cfg: QuantumConfig, integ: dict, ops, seed: int) -> QuantumIntegrator:
    dyn = dynamics(integ)
    dt, T, lr = integ["dt"], integ["horizon"], integ["lr"]
    shared = ("hamiltonian",) if integ["shared"] else ()
    b1, b2, eps = ADAM
    aux_names = ("theta", "adam_m", "adam_v", "outcomes", "hamiltonian_true")

    def restore(state: xr.Dataset, step_no: int, aux: dict, rng_state: dict | None = None) -> Carry:
        if set(aux) != set(aux_names):
            raise ValueError(f"fit restore: aux keys {sorted(aux)} != expected {sorted(aux_names)}")
        validate_state(state, cfg)
        aux = {k: np.asarray(v) for k, v in aux.items()}
        sched = Schedule(dyn, dt, T, aux["outcomes"])
        obj = objective(state, cfg, sched, ("hamiltonian",), shared=shared, ops=ops)
        state = obj.unpack(aux["theta"])[0]
        return _evaluate(obj, state, int(step_no), aux, rng_state)

    def _evaluate(obj, state, k: int, aux, rng_state) -> Carry:
        try:
            loss, g = obj.fun(aux["theta"])
        except FloatingPointError as e:
            raise DynamicsError(k, "hamiltonian", str(e)) from None
        obj.history.clear()
        H = state["hamiltonian"].values
        terms = {
            "born_loss": float(loss),
            "grad_norm": float(np.abs(g).max()),
            "hamiltonian_error": _hamiltonian_error(H, aux["hamiltonian_true"]),
        }
        return _with_cache(Carry(state, k, aux, terms, rng_state), (obj, g))

    def init(state: xr.Dataset) -> Carry:
        validate_state(state, cfg)
        rng = np.random.default_rng(seed)
        ys = _synthetic_outcomes(state, cfg, dyn, dt, T, rng)
        H_true = state["hamiltonian"].values
        n, d = H_true.shape[:2]
        H0 = (H_true + _perturbation(rng, n, d, integ["perturbation"], bool(shared))).astype(H_true.dtype)
        start = state.assign(hamiltonian=(state["hamiltonian"].dims, H0))
        obj = objective(start, cfg, Schedule(dyn, dt, T, ys), ("hamiltonian",), shared=shared, ops=ops)
        th = obj.theta0
        aux = {
            "theta": th,
            "adam_m": np.zeros_like(th),
            "adam_v": np.zeros_like(th),
            "outcomes": ys,
            "hamiltonian_true": H_true,
        }
        return restore(start, 0, aux, rng.bit_generator.state)

    def step_fn(carry: Carry) -> Carry:
        cache = getattr(carry, _CACHE, None)
        if cache is None:
            carry = restore(carry.state, carry.step, carry.aux, carry.rng_state)
            cache = getattr(carry, _CACHE)
        obj, g = cache
        k = carry.step + 1
        a = carry.aux
        m = b1 * a["adam_m"] + (1 - b1) * g
        v = b2 * a["adam_v"] + (1 - b2) * g * g
        th = a["theta"] - lr * (m / (1 - b1**k)) / (np.sqrt(v / (1 - b2**k)) + eps)
        aux = {**a, "theta": th, "adam_m": m, "adam_v": v}
        return _evaluate(obj, obj.unpack(th)[0], k, aux, carry.rng_state)

    return QuantumIntegrator("fit", init, step_fn, restore, ("hamiltonian",))


def make_integrator(cfg: QuantumConfig, integ: dict, *, backend: str = "numpy", seed: int = 0):
    """The stepper of a validated integrator section (RunSpec.make_integrator)."""
    from ..backends import get

    be = get(backend)
    if be.name not in BACKENDS:
        raise ValueError(f"backend: density-matrix runs take {list(BACKENDS)}, got {be.name!r}")
    if be.name == "dask":  # agent chunks on the workers (vfesim.quantum.chunked)
        from .chunked import make_chunked

        return make_chunked(cfg, integ, be, seed)
    if integ["method"] != "fit":
        return _channels(cfg, integ, be, seed)
    if be.on_device:
        raise ValueError(f"backend: method 'fit' runs on 'numpy' or 'numba', got {be.name!r}")
    return _fit(cfg, integ, be.agent_ops.get("quantum", NUMPY_OPS), seed)


DEFAULTS = {SECTION: CONFIG, "population": POPULATION, "integrator": INTEGRATOR}
RUN_DTYPES = ("complex128", "complex64")
