"""Backend registry: one place that maps a backend name to its capabilities and detects devices.

A backend is a :class:`Backend` record (each backend module defines ``BACKEND``): where arrays live
(array module, transfers), the family-free pairwise kernels, per-agent kernels per agent family, and the
integrator update operations. A family's energy assembly (:attr:`vfesim.family.AgentFamily.
energy_and_gradient`) executes with these capabilities; integrators and the run loop ask the record,
never the name.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from ..arrays import array_module as _xp
from ..arrays import max_abs
from ..family import family_of
from ..state import NonFiniteError, require_dataset, validate_state

__all__ = [
    "Backend",
    "BACKENDS",
    "names",
    "cuda_available",
    "resolve",
    "get",
    "energy_and_gradient_arrays",
    "energy_and_gradient",
    "check_outputs",
    "gradient_dataset",
]

log = logging.getLogger("vfesim")

BACKENDS = {
    "numpy": "vfesim.backends.numpy_backend",
    "numba": "vfesim.backends.numba_backend",
    "cuda": "vfesim.backends.cuda_backend",
    "dask": "vfesim.backends.dask_backend",
}


@dataclass(frozen=True)
class Backend:
    """What a backend offers the model and the integrators.

    array_module(): the array module of its arrays (NumPy, or CuPy on a GPU).
    to_device(arrays) / to_host(arrays): dicts of arrays onto the backend's device and back to NumPy.
    pairwise_dense(A, B, c, kappa, aggregator) -> (E, gA, gB, gc); pairwise_sparse(A, B, c, index, mask,
        kappa, aggregator) -> the same (the contract of :mod:`vfesim.pairwise.reference`, except that E
        may be a 0-d float64 device array: a device backend's energy left unsynchronised, brought home
        with the other terms by :func:`vfesim.arrays.host_floats`).
    pairwise_points(A, B, c, u, v, offsets, lists, rowmap, index, mask, kappa, aggregator) -> (E, gA, gB,
        gc, gu, gv): weighted pairs batched over grid points (field agents; the contract of
        :func:`vfesim.pairwise.weighted.pairwise_points_weighted`), None where the backend has none.
    agent_ops: family name -> that family's per-agent stages in this backend's kernels, for the family's
        one assembly (Gaussian: an :class:`~vfesim.gaussian.energy.AgentOps`, or a factory of fused
        stages); a family uses its array-generic stages where none is given.
    updates(K) -> the integrator update operations (gradient-flow step, kick/drift, chart maps).
    on_device: state and integrator arrays live on an accelerator (integrators then keep them there).
    dataset_energy_and_gradient(state, cfg, validate=..., **options) -> (terms, grads Dataset): set by a
        backend that runs whole state Datasets itself (dask: chunked states stay chunked); it takes the
        backend's keyword options of :func:`energy_and_gradient`.
    prepare(arrays, cfg): get ready what a first evaluation of ``cfg`` on ``arrays`` (on this backend's
        device) needs, before the state checks run (cuda: compile the missing kernels in parallel
        processes); None where there is nothing to prepare.
    """

    name: str
    array_module: Callable[[], Any]
    to_device: Callable[[dict], dict]
    to_host: Callable[[dict], dict]
    pairwise_dense: Callable
    pairwise_sparse: Callable
    updates: Callable[[int], Any]
    agent_ops: Mapping[str, Any] = field(default_factory=dict)
    on_device: bool = False
    dataset_energy_and_gradient: Callable | None = None
    pairwise_points: Callable | None = None
    prepare: Callable[[dict, Any], None] | None = None

    def energy_and_gradient(self, arrays: dict[str, Any], cfg) -> tuple[dict[str, float], dict[str, Any]]:
        """Terms and exact gradient of ``cfg``'s family for raw arrays on this backend's device (no
        validation, no output check: :func:`energy_and_gradient` does both)."""
        return family_of(cfg).energy_and_gradient(arrays, cfg, self)


def check_outputs(terms: Mapping[str, float], grads: Mapping[str, Any]) -> None:
    """Raise :class:`~vfesim.state.NonFiniteError` naming the first gradient (and agent) or energy term
    that is NaN or Inf. The gradients are reduced on their device: one small transfer."""
    names = list(grads)
    ok = [np.isfinite(m) for m in max_abs(grads[k] for k in names)]  # one transfer for all gradients
    bad_terms = [k for k, v in terms.items() if not np.isfinite(v)]
    if all(ok) and not bad_terms:
        return
    dtype = np.dtype(grads[names[0]].dtype).name if names else "the dtype"
    why = f"an overflow: the state's values are too large for {dtype} (or too ill-conditioned)"
    listed = ", ".join(f"{k}={terms[k]}" for k in bad_terms if k != "total")
    if not all(ok):
        k = names[ok.index(False)]
        g = grads[k]
        xp = _xp(g)
        bad = ~xp.isfinite(g).reshape(g.shape[0], -1).all(axis=1)
        n_bad = int(bad.sum())
        also = f"; non-finite terms: {listed}" if listed else ""
        raise NonFiniteError(
            k,
            f"the gradient is NaN or Inf ({n_bad} agent(s), the first named){also}: {why}",
            agent=int(xp.argmax(bad)),
        )
    k = next((k for k in bad_terms if k != "total"), bad_terms[0])
    raise NonFiniteError(f"terms[{k!r}]", f"the energy term is {terms[k]} (gradients finite): {why}")


def names() -> tuple[str, ...]:
    """Registered backend names ("auto" resolves to one of them)."""
    return tuple(BACKENDS)


def cuda_available() -> bool:
    """True when CuPy imports and sees a CUDA device (or the Numba CUDA simulator is on)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True  # the simulator stands in for the device, with NumPy arrays
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - any import/driver failure means "no GPU"
        return False


def resolve(name: str) -> str:
    """Validate a backend name; "auto" picks "cuda" when a GPU is present, else "numba" (logged)."""
    if name == "auto":
        chosen = "cuda" if cuda_available() else "numba"
        log.info("backend 'auto' resolved to %r", chosen)
        return chosen
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown {name!r}; choose one of {sorted(BACKENDS)} or 'auto'")
    if name == "dask" and importlib.util.find_spec("dask") is None:
        raise RuntimeError("backend 'dask' needs dask[array] and distributed (install the 'dask' extra)")
    if name == "cuda" and not cuda_available():
        raise RuntimeError(
            "backend 'cuda' needs CuPy and a CUDA GPU, and none was found "
            "(install the 'gpu' extra, or use backend='numba' or 'auto')"
        )
    return name


def get(name: str | Backend) -> Backend:
    """The :class:`Backend` of a name ("auto" resolved; a Backend is returned as it is)."""
    if isinstance(name, Backend):
        return name
    return importlib.import_module(BACKENDS[resolve(name)]).BACKEND


def energy_and_gradient_arrays(
    arrays: dict[str, Any], cfg, backend: str = "numpy"
) -> tuple[dict[str, float], dict[str, Any]]:
    """Energy terms and exact gradient for raw arrays already on the backend's device."""
    return get(backend).energy_and_gradient(arrays, cfg)


def energy_and_gradient(
    state: xr.Dataset, cfg, backend: str = "numpy", *, validate: bool = True, **options
) -> tuple[dict[str, float], xr.Dataset]:
    """Free-energy terms (dict of floats) and the exact gradient Dataset (SPEC §1, §2.2–2.3).

    Any agent family: the config's type selects it. Gaussian terms: "self", "belief_align",
    "prior_align", "observation", "total". grads: same variables, dims and dtype as ``state``;
    covariance gradients are symmetric. A term or gradient that is NaN or Inf raises
    :class:`~vfesim.state.NonFiniteError` naming the variable and agent, on every backend.

    options: keyword options of the backend; "dask" takes ``chunks`` (agents per chunk or chunk sizes,
    for an in-memory state; a Dask-backed state keeps its own) and ``inner`` ("numba"), see
    :func:`vfesim.backends.dask_backend.energy_and_gradient_dataset`. Other backends take none.
    """
    require_dataset(state)
    be = get(backend)
    if be.dataset_energy_and_gradient is not None:
        return be.dataset_energy_and_gradient(state, cfg, validate=validate, **options)
    if options:
        raise TypeError(
            f"energy_and_gradient: option(s) {sorted(options)} are not options of backend {be.name!r} "
            "(chunks= and inner= are the dask backend's)"
        )
    given = {k: state.variables[k].data for k in state.data_vars}
    arrays = be.to_device(given)
    if be.prepare is not None:
        be.prepare(arrays, cfg)
    if validate:
        # Where the arrays will be used: on a GPU, one transfer and device-side checks.
        on_device = any(a is not given[k] for k, a in arrays.items())
        validate_state(state.copy(data=arrays) if on_device else state, cfg)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # check_outputs reports
        terms, grads = be.energy_and_gradient(arrays, cfg)
    check_outputs(terms, grads)
    grads = be.to_host(grads) if isinstance(next(iter(given.values())), np.ndarray) else grads
    return terms, gradient_dataset(state, grads)


def gradient_dataset(state: xr.Dataset, grads: Mapping[str, Any]) -> xr.Dataset:
    """The gradient Dataset of ``state``: its dims, coordinates and attrs; each variable's attributes say
    it is dF/dx (:func:`vfesim.schema.gradient_attrs`)."""
    from ..schema import gradient_attrs

    # copy(data=...) shares the dims and coordinates (a fraction of a new Dataset's construction cost).
    # drop_vars, not state[list(grads)]: a coordinate of a dim only a dropped variable has stays.
    missing = [k for k in state.data_vars if k not in grads]
    out = (state.drop_vars(missing) if missing else state).copy(data=dict(grads))
    out.encoding = {}  # a state opened from a store names it: the gradient was not read from there
    for k in grads:
        v = out.variables[k]
        v.attrs, v.encoding = gradient_attrs(state.variables[k].attrs), {}
    return out
