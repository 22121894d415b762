"""States of every agent family: the error type, checks shared by families, and dispatch on the config.

``make_state``, ``random_state`` and ``validate_state`` take any model config and hand over to its agent
family (:func:`vfesim.family.family_of`); the schemas live with the families (Gaussian agents:
:mod:`vfesim.gaussian.state`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

from .arrays import array_module

__all__ = [
    "StateError",
    "NonFiniteError",
    "ConditioningWarning",
    "COND_WARN",
    "COND_MAX",
    "precision_limit",
    "make_state",
    "random_state",
    "validate_state",
    "state_arrays",
    "state_dims",
    "state_dataset",
    "check_spd_batch",
    "device_checks",
    "check_conditioning",
    "cholesky_named",
    "linalg_named",
    "require_dataset",
    "BLOCK",
    "block_rng",
    "in_blocks",
]

# Random populations are drawn in blocks of BLOCK agents, each block from its own stream, so that blocks
# can be drawn in parallel and the population does not depend on how many threads drew it.
BLOCK = 1 << 20


def block_rng(seed: int | np.random.SeedSequence, block: int) -> np.random.Generator:
    """The stream of agents [block BLOCK, (block + 1) BLOCK): block 0 is ``default_rng(seed)`` itself
    (populations of up to BLOCK agents are those of one stream), block b the b-th spawned child of the
    seed's SeedSequence. StateError naming ``seed`` for anything but an integer >= 0 or a SeedSequence."""
    if isinstance(seed, np.random.SeedSequence):
        ss = seed
    elif isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0:
        ss = np.random.SeedSequence(int(seed))
    else:
        raise StateError("seed", f"must be an integer >= 0 or a numpy SeedSequence, got {seed!r}")
    if block == 0:
        return np.random.default_rng(ss)
    return np.random.default_rng(np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, block)))


def in_blocks(n_agents: int, draw, threads: int | None = None) -> None:
    """``draw(b, r0, r1)`` for every block b = [r0, r1) of ``n_agents``, on ``threads`` threads (default:
    one per core; NumPy's random generators and batched linear algebra release the GIL)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1
    ):
        raise StateError("threads", f"must be an integer >= 1 (or None: one per core), got {threads!r}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    bounds = [(b, r0, min(n_agents, r0 + BLOCK)) for b, r0 in enumerate(range(0, n_agents, BLOCK))]
    threads = min(len(bounds), threads or cores)
    if threads == 1:
        for b in bounds:
            draw(*b)
        return
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda b: draw(*b), bounds))  # list(): re-raises a block's exception


# Numerical limits per dtype (README, "Numerics"), measured: numba and numpy energies and gradients
# differ by about 0.25 eps cond(Sigma) (normwise), and by about 0.1-1 eps |phi| for frames far outside
# the principal ball. Up to COND_WARN (and the family's frame limit) they agree as SPEC §4 promises
# (1e-10 float64, 1e-4 float32); beyond, a ConditioningWarning. Beyond COND_MAX = precision_limit(dtype)
# they disagree by ~1e-2: such states are refused.
COND_WARN = {"float64": 1e6, "float32": 1e3}


def precision_limit(dtype) -> float:
    """0.01 / eps: the largest condition number (or |phi|) a state of ``dtype`` may have
    (4.5e13 float64, 8.4e4 float32); beyond it results are uncertain by ~1e-2 relative."""
    return float(0.01 / np.finfo(dtype).eps)


COND_MAX = {k: precision_limit(k) for k in COND_WARN}


class StateError(ValueError):
    """A state is malformed; the message names the variable (and agent where one is at fault)."""

    def __init__(self, variable: str, message: str, agent: int | None = None):
        self.variable = variable
        self.agent = agent
        where = variable if agent is None else f"{variable}[agent={agent}]"
        super().__init__(f"{where}: {message}")


def require_dataset(state: Any, name: str = "state") -> None:
    """TypeError naming the argument unless ``state`` is an xarray Dataset (e.g. a dict of arrays)."""
    if not isinstance(state, xr.Dataset):
        raise TypeError(
            f"{name}: expected an xarray.Dataset (make one with vfesim.make_state or "
            f"vfesim.random_state), got {type(state).__module__}.{type(state).__name__}"
        )


class NonFiniteError(StateError):
    """The energy or its gradient came out NaN or Inf from a finite state (an overflow); names the
    variable (a gradient's, or ``terms[...]``) and the agent where one is known."""


class ConditioningWarning(UserWarning):
    """A covariance is too ill-conditioned for the backend agreement of SPEC §4 (see :data:`COND_WARN`)."""


def _family(cfg):
    from .family import family_of

    return family_of(cfg)


def make_state(cfg, *arrays, validate: bool = True, **named) -> xr.Dataset:
    """Wrap arrays (NumPy or CuPy) into the state Dataset of ``cfg``'s agent family; attrs carry the
    family, config JSON, version and dtype (Gaussian: ``make_state(cfg, mu_q, sigma_q, mu_p, sigma_p,
    phi, obs=None)``)."""
    return _family(cfg).make_state(cfg, *arrays, validate=validate, **named)


def random_state(cfg, n_agents: int, seed: int = 0, dtype: str | None = None, **options) -> xr.Dataset:
    """A reproducible random population of ``cfg``'s agent family (options: see the family's
    ``random_state``, e.g. :func:`vfesim.gaussian.state.random_state`)."""
    return _family(cfg).random_state(cfg, n_agents, seed, dtype, **options)


def validate_state(
    state: xr.Dataset | Mapping, cfg, *, check_spd: bool = True, conditioning: str = "exact"
) -> None:
    """Raise :class:`StateError` naming the variable and agent for the first problem found.

    conditioning (with ``check_spd``): see :func:`check_conditioning` ("exact", "estimate" or "off").
    """
    _family(cfg).validate_state(state, cfg, check_spd=check_spd, conditioning=conditioning)


def state_dataset(
    family: str,
    variables: Mapping[str, tuple[str, ...]],
    data: Mapping[str, Any],
    cfg,
    dtype,
    attributes: Mapping[str, Mapping[str, str]] | None = None,
):
    """The state Dataset of a family: ``data`` (variable -> array) with the family's dims and
    ``attributes`` (variable -> long_name, units); every dim but ``agent`` gets an integer coordinate
    (:func:`vfesim.schema.dim_coords`); attrs carry the family, the config JSON, the package version and
    the dtype (families' ``make_state`` use this)."""
    from ._version import __version__
    from .schema import dim_coords

    attributes = attributes or {}
    sizes = {d: n for k, v in data.items() for d, n in zip(variables[k], v.shape, strict=False)}
    return xr.Dataset(
        {k: (variables[k], v, dict(attributes.get(k, {}))) for k, v in data.items()},
        coords=dim_coords(sizes),
        attrs={
            "agent_family": family,
            "model_config": cfg.to_json(neighbour_lists=False),
            "vfesim_version": __version__,
            "dtype": str(np.dtype(dtype)),
        },
    )


def state_dims(cfg) -> Mapping[str, tuple[str, ...]]:
    """Variable -> dims of ``cfg``'s family (optional variables included)."""
    return _family(cfg).variables


def state_arrays(state: xr.Dataset) -> dict[str, Any]:
    """The raw arrays (NumPy or CuPy) of a state Dataset, keyed by variable name."""
    return {k: state[k].data for k in state.data_vars}


def check_spd_batch(S, name: str, checked=None):
    """Symmetric to rounding and Cholesky-factorisable, per agent; raise naming the first failure.

    Returns (L, bounds, worst) for :func:`check_conditioning`. NumPy arrays are checked on the host: L is
    the Cholesky factor (N, K, K), bounds and worst None. Device (CuPy) arrays are checked by one kernel on
    the device (:mod:`vfesim_kernels.cuda.checks`), with only the first failing agent brought to the host:
    L is None, bounds the kernel's upper bounds of the condition numbers (N,) (device, float64) and worst
    their largest (host float). ``checked``: this covariance's entry of :func:`device_checks`, which ran
    the kernel already.
    """
    xp = array_module(S)
    tol = spd_tolerance(S.dtype)
    if xp is not np:
        first, bounds, worst = checked if checked is not None else device_checks({}, {name: S})[1][name]
        if first is not None:
            _raise_spd(S[first].get(), name, first, tol)
        return None, bounds, worst
    # The first agent failing either check is named (as on the device), whichever check it fails.
    scale = np.abs(S).reshape(S.shape[0], -1).max(axis=1)
    asym = np.abs(S - np.swapaxes(S, 1, 2)).reshape(S.shape[0], -1).max(axis=1)
    bad = asym > tol * scale
    first_asym = int(np.argmax(bad)) if bool(bad.any()) else S.shape[0]
    if S.shape[-1] > BATCH_CHOLESKY_MAX_K:
        L = _cholesky_or_raise(S[:first_asym], name)  # names an earlier indefinite agent
    else:
        L, i = batch_cholesky(S[:first_asym])
        if i is not None:
            _raise_spd(S[i], name, i, tol)
    if first_asym < S.shape[0]:
        _raise_spd(S[first_asym], name, first_asym, tol)
    return L, None, None


def spd_tolerance(dtype) -> float:
    """Relative asymmetry a covariance of ``dtype`` may have: 64 eps."""
    return 64 * float(np.finfo(dtype).eps)


def device_checks(arrays: Mapping[str, Any], covariances: Mapping[str, Any]) -> tuple[dict, dict]:
    """The first pass of validating device (CuPy) arrays: one kernel and one transfer to the host
    (:func:`vfesim_kernels.cuda.checks.state_checks`). Gives max |x| of each of ``arrays`` (+inf when an
    entry is not finite, as :func:`vfesim.arrays.max_abs`) and the SPD verdict on each of ``covariances``
    (at most two, each also in ``arrays`` when its peak is wanted; at most four other arrays).

    Returns (peaks {name: float}, {covariance name: (first failing agent or None, condition-number bounds
    (N,) on the device, their largest)}); callers raise in their own order (:func:`check_spd_batch`).
    """
    from vfesim_kernels.cuda.checks import FIRSTS, PEAKS, WORSTS, state_checks

    mats = list(covariances.values())
    if not 1 <= len(mats) <= 2:
        raise ValueError(f"device_checks: one or two covariances, got {len(mats)}")
    vectors = {k: a for k, a in arrays.items() if k not in covariances}
    out, _, bound = state_checks(list(vectors.values()), mats[0], mats[-1], spd_tolerance(mats[0].dtype))
    out = out.tolist()
    peaks = {k: out[PEAKS + v] for v, k in enumerate(vectors)}
    peaks |= {k: out[PEAKS + 4 + c] for c, k in enumerate(covariances)}
    spd = {
        k: (None if out[FIRSTS + c] == np.inf else int(out[FIRSTS + c]), bound[c], out[WORSTS + c])
        for c, k in enumerate(covariances)
    }
    return {k: peaks[k] for k in arrays}, spd


# Host SPD checks of matrices up to this size factorise the whole batch at once in array code (K (K + 1) / 2
# vectorised steps), larger ones by LAPACK per matrix: a LAPACK call per agent dominated a state's
# validation at small K, and took minutes for 4e7 agents when many threads shared a threaded LAPACK.
BATCH_CHOLESKY_MAX_K = 8


def batch_cholesky(S: np.ndarray) -> tuple[np.ndarray, int | None]:
    """(L, the first agent whose S is not positive definite, or None) for a batch S (n, K, K) of symmetric
    finite matrices: the Cholesky factors, column by column over every agent at once, in S's precision
    (the failing agents' columns hold placeholders)."""
    n, K = S.shape[:2]
    L = np.zeros_like(S)
    ok = np.ones(n, bool)
    for j in range(K):
        d = S[:, j, j] - np.einsum("nk,nk->n", L[:, j, :j], L[:, j, :j])
        ok &= d > 0
        L[:, j, j] = np.sqrt(np.where(d > 0, d, 1))
        for i in range(j + 1, K):
            L[:, i, j] = (S[:, i, j] - np.einsum("nk,nk->n", L[:, i, :j], L[:, j, :j])) / L[:, j, j]
    bad = np.flatnonzero(~ok)
    return L, (int(bad[0]) if bad.size else None)


def _raise_spd(Si: np.ndarray, name: str, i: int, tol: float):
    """The StateError for agent i's matrix Si (host), which failed a check."""
    if not np.isfinite(Si).all():
        raise StateError(name, "contains NaN or Inf", agent=i)
    asym = float(np.abs(Si - Si.T).max())
    if asym > tol * float(np.abs(Si).max()):
        raise StateError(name, f"is not symmetric (max |S - S^T| = {asym:.3g})", agent=i)
    w = np.linalg.eigvalsh(Si.astype(np.float64))
    raise StateError(name, f"is not positive definite (smallest eigenvalue {w[0]:.3g})", agent=i)


def check_conditioning(S, L, name: str, mode: str = "exact", bounds=None, worst=None) -> None:
    """Condition numbers of SPD covariances S (N, K, K) against the dtype's limits (README, "Numerics").

    mode "exact": cond = lambda_max / lambda_min (eigvalsh, float64); above ``COND_MAX`` raise
    :class:`StateError`, above ``COND_WARN`` warn (:class:`ConditioningWarning`), naming the worst agent.
    Given ``bounds``, upper bounds of the condition numbers (N,) (the device check of
    :func:`check_spd_batch`; on the host :func:`condition_bounds` of the Cholesky factor L), eigenvalues are
    computed only for agents whose bound exceeds ``COND_WARN``
    (the same verdicts, usually no eigensolver at all). ``worst``, the largest of ``bounds`` as a host
    float: when it is within the mode's limit, nothing is computed (no device round trip).
    mode "estimate" (cheap, for every integrator step): the lower bound (max L_kk / min L_kk)^2 from the
    Cholesky factor L (computed here when None); only ``COND_MAX`` is enforced. mode "off": nothing.
    """
    if mode == "off":
        return
    if mode not in ("exact", "estimate"):
        raise ValueError(f"conditioning must be 'exact', 'estimate' or 'off', got {mode!r}")
    xp = array_module(S)
    dtype = np.dtype(S.dtype).name
    if worst is not None and worst <= (COND_WARN if mode == "exact" else COND_MAX)[dtype]:
        return
    if mode == "exact" and bounds is None and L is not None and xp is np:
        # (exact eigenvalues then only where a bound is high; the factor 2 covers L's rounding, relative
        # O(eps cond): about 1e-4 at float32's warning level)
        bounds = 2.0 * condition_bounds(S, L)
    if mode == "exact" and bounds is not None:
        sel = xp.flatnonzero(~(bounds <= COND_WARN[dtype]))  # (a NaN bound: solved, not skipped)
        if sel.size == 0:
            return
        w = xp.linalg.eigvalsh(S[sel].astype(np.float64))
        cond = xp.zeros(S.shape[0])
        cond[sel] = w[:, -1] / w[:, 0]
    elif mode == "exact":
        w = xp.linalg.eigvalsh(S.astype(np.float64))
        cond = w[:, -1] / w[:, 0]
    else:
        L = xp.linalg.cholesky(S) if L is None else L
        d = xp.abs(xp.diagonal(L, axis1=1, axis2=2)).astype(np.float64)
        cond = (d.max(axis=1) / d.min(axis=1)) ** 2
    i = int(xp.argmax(cond))
    worst = float(cond[i])
    if not worst > COND_WARN[dtype]:  # a non-positive or NaN eigenvalue was reported by the SPD check
        return
    if worst > COND_MAX[dtype]:
        what = "condition number" if mode == "exact" else "condition number (at least)"
        raise StateError(
            name,
            f"{what} {worst:.3g} exceeds {COND_MAX[dtype]:.3g}, the most {dtype} supports "
            "(backends disagree beyond it; README, Numerics)",
            agent=i,
        )
    if mode == "exact":
        n_bad = int((cond > COND_WARN[dtype]).sum())
        err = 0.25 * worst * np.finfo(dtype).eps
        warnings.warn(
            f"{name}[agent={i}]: condition number {worst:.3g} (worst of {n_bad} agent(s) above "
            f"{COND_WARN[dtype]:.0e}): {dtype} backends agree only to about {err:.1g} relative here, "
            "not to the promised 1e-10 (float64) / 1e-4 (float32) (README, Numerics)",
            ConditioningWarning,
            stacklevel=2,
        )


def condition_bounds(S: np.ndarray, L: np.ndarray) -> np.ndarray:
    """Bounds ||S||_F ||L^-1||_F^2 >= ||S|| ||S^-1|| (float64, (N,)) of the 2-norm condition numbers of
    S = L L^T (N, K, K) on the host: the device check's bound (:mod:`vfesim_kernels.cuda.checks`), up to the
    rounding of L (relative O(eps cond) in S's precision). Each agent's S and L are scaled to max |S| = 1
    first (the bound does not depend on the scale; its squares would underflow or overflow for entries
    below ~1e-154 or above ~1e154).
    """
    n = S.shape[0]
    peak = np.abs(S).reshape(n, -1).max(axis=1).astype(np.float64)
    peak = np.where(peak > 0, peak, 1.0)
    S = S.astype(np.float64) / peak[:, None, None]
    Linv = np.linalg.inv(L.astype(np.float64) / np.sqrt(peak)[:, None, None])
    return np.sqrt(np.einsum("nij,nij->n", S, S)) * np.einsum("nij,nij->n", Linv, Linv)


def cholesky_named(S, name: str):
    """Batched Cholesky factor of S (N, K, K); on failure a StateError naming the agent and ``name``.

    NumPy raises on a non-SPD matrix; CuPy returns NaN instead, which the energy's finiteness checks
    catch downstream.
    """
    if array_module(S) is not np:
        return array_module(S).linalg.cholesky(S)
    return _cholesky_or_raise(S, name)


def _cholesky_or_raise(S: np.ndarray, name: str) -> np.ndarray:
    try:
        return np.linalg.cholesky(S)
    except np.linalg.LinAlgError:
        for i in range(S.shape[0]):
            try:
                np.linalg.cholesky(S[i])
            except np.linalg.LinAlgError:
                w = np.linalg.eigvalsh(S[i].astype(np.float64))
                raise StateError(
                    name, f"is not positive definite (smallest eigenvalue {w[0]:.3g})", agent=i
                ) from None
        raise


def linalg_named(name: str, what: str, fn, *batches, labels: tuple[str, ...] = ()):
    """``fn(*batches)`` over NumPy batches (N, ...); a ``numpy.linalg.LinAlgError`` becomes a
    :class:`StateError` naming ``name`` and the first agent whose slice fails on its own. ``what`` names
    the operation and ``labels`` the batches, for the message."""
    try:
        return fn(*batches)
    except np.linalg.LinAlgError as e:
        for i in range(batches[0].shape[0]):
            try:
                fn(*(b[i : i + 1] for b in batches))
            except np.linalg.LinAlgError:
                bad = [j for j, b in enumerate(batches) if not bool(np.isfinite(b[i]).all())]
                if bad:
                    what_bad = labels[bad[0]] if bad[0] < len(labels) else f"input {bad[0]}"
                    why = f"{what_bad} contains NaN or Inf"
                else:
                    why = str(e)
                raise StateError(name, f"{what} failed: {why}", agent=i) from None
        raise StateError(name, f"{what} failed: {e}") from None
