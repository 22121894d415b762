"""States of every agent family: the error type, checks shared by families, and dispatch on the config.

``make_state``, ``random_state`` and ``validate_state`` take any model config and hand over to its agent
family (:func:`vfesim.family.family_of`); the schemas live with the families (Gaussian agents:
:mod:`vfesim.gaussian.state`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

from .arrays import array_module

__all__ = [
    "StateError",
    "make_state",
    "random_state",
    "validate_state",
    "state_arrays",
    "state_dims",
    "check_spd_batch",
    "cholesky_named",
    "require_dataset",
]


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


def validate_state(state: xr.Dataset | Mapping, cfg, *, check_spd: bool = True) -> None:
    """Raise :class:`StateError` naming the variable and agent for the first problem found."""
    _family(cfg).validate_state(state, cfg, check_spd=check_spd)


def state_dims(cfg) -> Mapping[str, tuple[str, ...]]:
    """Variable -> dims of ``cfg``'s family (optional variables included)."""
    return _family(cfg).variables


def state_arrays(state: xr.Dataset) -> dict[str, Any]:
    """The raw arrays (NumPy or CuPy) of a state Dataset, keyed by variable name."""
    return {k: state[k].data for k in state.data_vars}


def check_spd_batch(S, name: str) -> None:
    """Symmetric to rounding and Cholesky-factorisable, per agent; raise naming the first failure.

    NumPy arrays are checked on the host; device (CuPy) arrays by one kernel on the device
    (:mod:`vfesim_kernels.cuda.checks`), with only the first failing agent brought to the host.
    """
    xp = array_module(S)
    tol = 64 * np.finfo(S.dtype).eps
    if xp is not np:
        _check_spd_device(S, name, tol)
        return
    scale = np.abs(S).reshape(S.shape[0], -1).max(axis=1)
    asym = np.abs(S - np.swapaxes(S, 1, 2)).reshape(S.shape[0], -1).max(axis=1)
    bad = asym > tol * scale
    if bool(bad.any()):
        _raise_spd(S[int(np.argmax(bad))], name, int(np.argmax(bad)), tol)
    _cholesky_or_raise(S, name)


def _check_spd_device(S, name: str, tol: float) -> None:
    from vfesim_kernels.cuda.checks import spd_codes

    code = spd_codes(S, tol)
    bad = code != 0
    if bool(bad.any()):
        i = int(bad.argmax())
        _raise_spd(S[i].get(), name, i, tol)


def _raise_spd(Si: np.ndarray, name: str, i: int, tol: float):
    """The StateError for agent i's matrix Si (host), which failed a check."""
    if not np.isfinite(Si).all():
        raise StateError(name, "contains NaN or Inf", agent=i)
    asym = float(np.abs(Si - Si.T).max())
    if asym > tol * float(np.abs(Si).max()):
        raise StateError(name, f"is not symmetric (max |S - S^T| = {asym:.3g})", agent=i)
    w = np.linalg.eigvalsh(Si.astype(np.float64))
    raise StateError(name, f"is not positive definite (smallest eigenvalue {w[0]:.3g})", agent=i)


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
