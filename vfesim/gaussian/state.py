"""The Gaussian state Dataset (SPEC §1.1): schema, constructors and validation.

Dims: ``agent``, ``latent``, ``latent_b``, ``gauge`` (= 3), ``obs_dim``.
Variables: ``mu_q, mu_p`` (agent, latent); ``sigma_q, sigma_p`` (agent, latent, latent_b);
``phi`` (agent, gauge); optional ``obs`` (agent, obs_dim).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import xarray as xr

from ..arrays import array_module, max_abs
from ..config import ModelConfig
from ..state import (
    COND_WARN,
    ConditioningWarning,
    StateError,
    block_rng,
    check_conditioning,
    check_spd_batch,
    device_checks,
    in_blocks,
    precision_limit,
    state_dataset,
)

__all__ = [
    "VARIABLES",
    "ATTRIBUTES",
    "REQUIRED",
    "COVARIANCES",
    "value_limit",
    "phi_limit",
    "PHI_WARN",
    "make_state",
    "random_state",
    "validate_state",
]

VARIABLES = {
    "mu_q": ("agent", "latent"),
    "sigma_q": ("agent", "latent", "latent_b"),
    "mu_p": ("agent", "latent"),
    "sigma_p": ("agent", "latent", "latent_b"),
    "phi": ("agent", "gauge"),
    "obs": ("agent", "obs_dim"),
}
# CF attributes of each variable (docs/outputs.md): the latent space is dimensionless; frames in radians.
ATTRIBUTES = {
    "mu_q": {"long_name": "belief mean mu_q", "units": "1"},
    "sigma_q": {"long_name": "belief covariance Sigma_q", "units": "1"},
    "mu_p": {"long_name": "prior mean mu_p", "units": "1"},
    "sigma_p": {"long_name": "prior covariance Sigma_p", "units": "1"},
    "phi": {"long_name": "gauge frame phi (rotation exp(phi . G))", "units": "rad"},
    "obs": {"long_name": "observation o_i", "units": "1"},
}
REQUIRED = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
COVARIANCES = ("sigma_q", "sigma_p")


def value_limit(dtype) -> float:
    """Largest |entry| a state may hold: sqrt of the dtype's largest value, so squares do not overflow
    (1.3e154 float64, 1.8e19 float32)."""
    return float(np.sqrt(np.finfo(dtype).max))


# |phi| up to which the backends agree to SPEC §4's tolerance (measured; see vfesim.state.COND_WARN).
PHI_WARN = {"float64": 1e5, "float32": 1e2}


def phi_limit(dtype) -> float:
    """Largest |phi| a state may hold: ``precision_limit`` (0.01 / eps; 4.5e13 float64, 8.4e4 float32),
    beyond which the dtype resolves the rotation angle to worse than 0.01 rad (the integrators'
    wrap_phi reduces up to the float64 value)."""
    return precision_limit(dtype)


def make_state(
    cfg: ModelConfig,
    mu_q,
    sigma_q,
    mu_p,
    sigma_p,
    phi,
    obs=None,
    *,
    validate: bool = True,
) -> xr.Dataset:
    """Wrap arrays (NumPy or CuPy) into the state Dataset; attrs carry config JSON, version, dtype; every
    variable its ``long_name`` and ``units``, the dims ``latent``, ``latent_b``, ``gauge`` (and ``obs_dim``)
    integer coordinates."""
    data = {"mu_q": mu_q, "sigma_q": sigma_q, "mu_p": mu_p, "sigma_p": sigma_p, "phi": phi}
    if obs is not None:
        data["obs"] = obs
    ds = state_dataset("gaussian", VARIABLES, data, cfg, mu_q.dtype, ATTRIBUTES)
    if validate:
        validate_state(ds, cfg)
    return ds


# Agents per pass of _random_spd: its temporaries stay small (in cache, off the allocator's mmap path).
SPD_ROWS = 8192


def _random_spd(rng: np.random.Generator, n: int, K: int, eig_range: tuple[float, float]) -> np.ndarray:
    """n covariances Q diag(e) Q^T: eigenvalues log-uniform in ``eig_range``, Q Haar-random (the QR of a
    Gaussian matrix, signs fixed by R's diagonal). Draws the whole block's numbers first, then transforms
    them SPD_ROWS agents at a time (the same numbers as in one pass). The products are einsums, not
    ``@``: NumPy's matmul hands each K x K product to OpenBLAS, whose calls from the drawing threads
    contend with one another (an H100 host's 16 cores, 1.6e7 agents: 47 s on one thread, 29 s on 16 with
    ``@``, 5.4 s with einsum; a 4e7-agent population took about 100 s on a 64-core host)."""
    lo, hi = eig_range
    eig = np.exp(rng.uniform(np.log(lo), np.log(hi), size=(n, K)))
    G = rng.standard_normal((n, K, K))
    S = np.empty_like(G)
    for a in range(0, n, SPD_ROWS):
        b = min(n, a + SPD_ROWS)
        Q, Rr = np.linalg.qr(G[a:b])
        Q *= np.sign(np.diagonal(Rr, axis1=1, axis2=2))[:, None, :]
        P = np.einsum("nij,nkj->nik", Q * eig[a:b, None, :], Q)
        S[a:b] = 0.5 * (P + np.swapaxes(P, 1, 2))
    return S


def random_state(
    cfg: ModelConfig,
    n_agents: int,
    seed: int = 0,
    dtype: str | None = None,
    *,
    mu_scale: float = 1.0,
    prior_mu_scale: float | None = None,
    eig_range: tuple[float, float] = (0.5, 2.0),
    prior_eig_range: tuple[float, float] | None = None,
    phi_radius: float = 1.0,
    obs_scale: float = 1.0,
    threads: int | None = None,
) -> xr.Dataset:
    """A reproducible random population.

    Means ~ N(0, mu_scale^2); covariances Q diag(e) Q^T with eigenvalues log-uniform in ``eig_range``
    and Haar-random Q; frames uniform in the ball |phi| <= phi_radius (< pi: the principal ball);
    observations ~ N(0, obs_scale^2) when the config has an observation model. Agents are drawn in
    blocks of :data:`vfesim.state.BLOCK` (2^20), each from its own stream (:func:`vfesim.state.block_rng`),
    on ``threads`` threads (default: one per core): the population does not depend on their number.
    """
    dtype = dtype or cfg.dtype or "float64"
    if dtype not in ("float32", "float64"):
        raise StateError("dtype", f"must be 'float32' or 'float64', got {dtype!r}")
    if isinstance(n_agents, bool) or not isinstance(n_agents, (int, np.integer)) or n_agents < 1:
        raise StateError("n_agents", f"must be a positive integer, got {n_agents!r}")
    if not 0 <= phi_radius < np.pi:
        raise StateError("phi", f"phi_radius must be in [0, pi), got {phi_radius}")
    for name, er in (("eig_range", eig_range), ("prior_eig_range", prior_eig_range)):
        if er is not None and not (0 < er[0] <= er[1] < np.inf):
            raise StateError("sigma_q", f"{name} must satisfy 0 < lo <= hi, got {er}")
    if nbrs := (None if cfg.dense else cfg.neighbours):
        if nbrs.n_agents != n_agents:
            raise StateError(
                "agent", f"config has sparse neighbours for {nbrs.n_agents} agents, not {n_agents}"
            )
    K, pms = cfg.K, (mu_scale if prior_mu_scale is None else prior_mu_scale)
    shapes = {"mu_q": (K,), "sigma_q": (K, K), "mu_p": (K,), "sigma_p": (K, K), "phi": (3,)}
    if cfg.obs_dim:
        shapes["obs"] = (cfg.obs_dim,)
    out = {k: np.empty((n_agents, *s), dtype) for k, s in shapes.items()}
    # Blocks are checked in their threads, without an eigensolver, when no check can warn (a warning would
    # name an agent of its block): condition numbers <= hi/lo well below COND_WARN, |phi| <= phi_radius < pi.
    ratio = max(hi / lo for lo, hi in (eig_range, prior_eig_range or eig_range))
    block_checks = ratio <= COND_WARN[np.dtype(dtype).name] / 4
    block_cfg = cfg.replace(neighbours="dense") if block_checks else None

    def check(r0: int, r1: int) -> None:
        # Condition numbers are at most hi/lo by construction (<= COND_WARN / 4 here): no eigensolver.
        try:
            validate_state({k: v[r0:r1] for k, v in out.items()}, block_cfg, conditioning="off")
        except StateError as e:
            message = str(e).split(": ", 1)[-1]
            raise StateError(e.variable, message, agent=None if e.agent is None else e.agent + r0) from None

    def draw(b: int, r0: int, r1: int) -> None:
        """Agents [r0, r1) (block b) from the block's own stream, into ``out``."""
        n, rng = r1 - r0, block_rng(seed, b)
        out["mu_q"][r0:r1] = mu_scale * rng.standard_normal((n, K))
        out["mu_p"][r0:r1] = pms * rng.standard_normal((n, K))
        out["sigma_q"][r0:r1] = _random_spd(rng, n, K, eig_range)
        out["sigma_p"][r0:r1] = _random_spd(rng, n, K, prior_eig_range or eig_range)
        direction = rng.standard_normal((n, 3))
        direction /= np.linalg.norm(direction, axis=1, keepdims=True)
        out["phi"][r0:r1] = direction * (phi_radius * rng.uniform(size=(n, 1)) ** (1 / 3))
        if cfg.obs_dim:
            out["obs"][r0:r1] = obs_scale * rng.standard_normal((n, cfg.obs_dim))
        if block_checks:
            check(r0, r1)

    in_blocks(n_agents, draw, threads)
    arrays = (out["mu_q"], out["sigma_q"], out["mu_p"], out["sigma_p"], out["phi"], out.get("obs"))
    return make_state(cfg, *arrays, validate=not block_checks)


def validate_state(
    state: xr.Dataset | Mapping, cfg: ModelConfig, *, check_spd: bool = True, conditioning: str = "exact"
) -> None:
    """Raise :class:`StateError` naming the variable and agent for the first problem found.

    Checks presence, dims and shapes, one float dtype, finiteness, magnitudes (|entry| <= value_limit,
    |phi| <= phi_limit), symmetry and SPD (Cholesky) and the covariances' condition numbers
    (``conditioning``: see :func:`vfesim.state.check_conditioning`).
    """
    # A Dataset's variables, not its DataArrays (each of those is a construction).
    variables = state.variables if isinstance(state, xr.Dataset) else state
    get = (lambda k: variables[k].data) if isinstance(state, xr.Dataset) else (lambda k: state[k])
    names = set(state.data_vars) if isinstance(state, xr.Dataset) else set(state)
    for k in REQUIRED:
        if k not in names:
            raise StateError(k, "missing from the state")
    unknown = names - set(VARIABLES)
    if unknown:
        raise StateError(sorted(unknown)[0], f"unknown state variable (known: {list(VARIABLES)})")
    if cfg.obs_dim and "obs" not in names:
        raise StateError("obs", "the config has an observation model but the state has no obs")
    n = get("mu_q").shape[0] if get("mu_q").ndim else 0
    if n == 0:
        raise StateError("agent", "the state has no agents")
    K = cfg.K
    expect = {
        "mu_q": (n, K),
        "mu_p": (n, K),
        "sigma_q": (n, K, K),
        "sigma_p": (n, K, K),
        "phi": (n, 3),
        "obs": (n, cfg.obs_dim),
    }
    dtype = np.dtype(get("mu_q").dtype)
    if dtype not in (np.float32, np.float64):
        raise StateError("mu_q", f"dtype must be float32 or float64, got {dtype}")
    if cfg.dtype is not None and dtype != cfg.dtype:
        raise StateError(
            "mu_q",
            f"dtype {dtype} differs from the config's dtype {cfg.dtype} (cast the state with "
            f".astype('{cfg.dtype}'), or use a config with dtype={dtype.name!r} or None)",
        )
    big = value_limit(dtype)
    ordered = sorted(names, key=list(VARIABLES).index)
    for k in ordered:
        a = get(k)
        if isinstance(state, xr.Dataset) and variables[k].dims != VARIABLES[k]:
            raise StateError(k, f"dims must be {VARIABLES[k]}, got {variables[k].dims}")
        if tuple(a.shape) != expect[k]:
            raise StateError(k, f"shape must be {expect[k]} (agents={n}, K={K}), got {tuple(a.shape)}")
        if np.dtype(a.dtype) != dtype:
            raise StateError(k, f"dtype {a.dtype} differs from mu_q's {dtype}")
    # One pass per variable and one transfer (on a device, with the SPD kernel's verdicts): the per-agent
    # search below runs only for a failing variable.
    checked = {}
    if array_module(get("mu_q")) is np:
        peaks = dict(zip(ordered, max_abs(get(k) for k in ordered), strict=True))
    else:
        peaks, checked = device_checks({k: get(k) for k in ordered}, {k: get(k) for k in COVARIANCES})
    for k in ordered:
        if peaks[k] <= big:
            continue
        a = get(k)
        xp = array_module(a)
        amax = xp.abs(a).reshape(n, -1).max(axis=1)
        bad = ~(amax <= big)  # NaN compares False: one pass finds NaN, Inf and overflowing entries
        if bool(bad.any()):
            i = int(xp.argmax(bad))
            if not bool(xp.isfinite(a[i]).all()):
                raise StateError(k, "contains NaN or Inf", agent=i)
            raise StateError(
                k, f"has |entry| {float(amax[i]):.3g}, above {big:.3g}: its square overflows {dtype}", agent=i
            )
    # |phi_i| <= sqrt(3) max |phi entry|: the exact check only when that bound reaches a threshold.
    if np.sqrt(3.0) * peaks["phi"] > min(phi_limit(dtype), PHI_WARN[dtype.name]):
        _check_phi(get("phi"), dtype, conditioning)
    if not cfg.dense and cfg.neighbours.n_agents != n:
        raise StateError(
            "agent",
            f"config has sparse neighbours for {cfg.neighbours.n_agents} agents but the state has {n}",
        )
    if check_spd:
        for k in COVARIANCES:
            S = get(k)
            L, bounds, worst = check_spd_batch(S, k, checked.get(k))
            if cfg.jitter != 0.0 and conditioning != "off":  # the energy sees S + jitter I
                xp = array_module(S)
                S = S + cfg.jitter * xp.eye(K, dtype=S.dtype)
                L, bounds, worst = xp.linalg.cholesky(S), None, None
            check_conditioning(S, L, k, conditioning, bounds=bounds, worst=worst)


def _check_phi(phi, dtype, conditioning: str) -> None:
    """|phi| <= phi_limit (else StateError); with ``conditioning="exact"`` a ConditioningWarning above
    PHI_WARN (the backends' agreement degrades with |phi|: wrap frames into the principal ball)."""
    xp = array_module(phi)
    t = xp.sqrt((phi.astype(np.float64) ** 2).sum(axis=1))
    i = int(xp.argmax(t))
    worst = float(t[i])
    if worst > phi_limit(dtype):
        raise StateError(
            "phi",
            f"|phi| = {worst:.3g} exceeds {phi_limit(dtype):.3g}, beyond which {dtype} does not resolve "
            "the rotation angle (phi - 2 pi k phi/|phi| is the same rotation)",
            agent=i,
        )
    if conditioning == "exact" and worst > PHI_WARN[dtype.name]:
        warnings.warn(
            f"phi[agent={i}]: |phi| = {worst:.3g} is above {PHI_WARN[dtype.name]:.0e}: {dtype} backends "
            f"agree only to about {worst * np.finfo(dtype).eps:.1g} relative here; phi - 2 pi k phi/|phi| "
            "is the same rotation (README, Numerics)",
            ConditioningWarning,
            stacklevel=3,
        )
