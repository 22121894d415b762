"""Observables: quantities computed from the state at every recorded step (like QuTiP's ``e_ops``), and
the attention weights of a state Dataset.

An observable is a function of the state Dataset (NumPy-backed, on the host) returning a scalar or one
value per agent (N,); :func:`vfesim.run_dynamics` and :func:`vfesim.simulate` take
``observables={name: function}`` and save each as the variable ``name``, over ``time`` (and ``agent``).
Built-ins, by name (also from a scenario's ``[output] observables``): :data:`BUILTINS`.

Runs of up to :data:`ATTENTION_ENTROPY_AUTO` agents save ``attention_entropy`` by default, and of up to
:data:`ATTENTION_FULL_AUTO` agents the full ``attention`` (:func:`default_observables`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from .family import family_of
from .schema import DIMS, ENERGY_PREFIX, OUTPUTS, RESERVED, dim_coords
from .state import require_dataset, validate_state

__all__ = [
    "Observable",
    "Observables",
    "BUILTINS",
    "ATTENTION_FULL_AUTO",
    "ATTENTION_ENTROPY_AUTO",
    "ATTENTION_FULL_MAX",
    "attention",
    "attention_entropy",
    "rotation_angle",
    "default_observables",
    "unknown_builtin",
]

# Runs save the full belief attention by default up to this many agents (N^2 values per frame) ...
ATTENTION_FULL_AUTO = 256
# ... and the attention entropy per agent up to this many (one attention pass per saved frame).
ATTENTION_ENTROPY_AUTO = 1024
# The full attention is saved on request up to this many agents (128 MiB per frame in float64).
ATTENTION_FULL_MAX = 4096


@dataclass(frozen=True)
class Observable:
    """A user observable with its attributes: ``fn(state) -> scalar or (N,)``; ``long_name`` (default:
    the observable's name) and ``units`` (CF; default ``"1"``, dimensionless)."""

    fn: Callable[[xr.Dataset], Any]
    long_name: str | None = None
    units: str = "1"


def rotation_angle(phi: np.ndarray) -> np.ndarray:
    """Rotation angle in [0, pi] of the frames ``exp(phi . G)``: phi (..., 3) -> (...).

    exp(t n . G) is the rotation by t about n, and t + 2 pi k about n, or 2 pi - t about -n, is the
    same rotation; so the angle is |t - 2 pi round(t / 2 pi)| (closed form, no loop).
    """
    t = np.linalg.norm(np.asarray(phi, dtype=np.float64), axis=-1)
    return np.abs(t - 2 * np.pi * np.round(t / (2 * np.pi)))


def attention_entropy(beta: np.ndarray) -> np.ndarray:
    """Shannon entropy (nats) of each row of attention weights: ``-sum_j beta_ij log beta_ij``; beta (N, N)
    or (N, k), zeros (the diagonal, unused slots) contribute nothing. Divide by log(number of neighbours)
    for a value in [0, 1]."""
    beta = np.asarray(beta, np.float64)
    return -np.sum(beta * np.log(np.where(beta > 0, beta, 1.0)), axis=1)


def _beta(arrays: Mapping[str, np.ndarray], cfg, which: str = "belief") -> np.ndarray:
    """Attention (N, N), or (N, k) for sparse neighbours with 0 in unused slots (field agents: (N, *grid,
    k) over their neighbour lists, 0 in unused slots and where the receiver or sender is absent)."""
    beta = np.asarray(family_of(cfg).attention(dict(arrays), cfg, which), np.float64)
    if cfg.dense:
        return beta
    mask = cfg.neighbours.mask
    return np.where(mask.reshape(mask.shape[0], *[1] * (beta.ndim - 2), mask.shape[1]), beta, 0.0)


def _dense(beta: np.ndarray, cfg) -> np.ndarray:
    """Attention (N, N) of a sparse config's (N, k) weights: zero for pairs that are not neighbours."""
    if cfg.dense:
        return beta
    n, nb = beta.shape[0], cfg.neighbours
    out = np.zeros((n, n))
    rows = np.broadcast_to(np.arange(n)[:, None], nb.index.shape)
    out[rows[nb.mask], nb.index[nb.mask]] = beta[nb.mask]
    return out


def _host(state: xr.Dataset) -> xr.Dataset:
    if all(isinstance(state[k].data, np.ndarray) for k in state.data_vars):
        return state
    return state.as_numpy()


def attention(state: xr.Dataset, cfg, which: str = "belief", *, validate: bool = True) -> xr.DataArray:
    """Attention weights of a state (SPEC §2.2): beta_ij (``which="belief"``) or gamma_ij (``"prior"``).

    Dense neighbours: a DataArray (agent, agent_j), rows summing to 1, zero diagonal. Sparse: (agent,
    neighbour) aligned with the neighbour lists, with the coordinate ``sender`` (agent, neighbour) (-1 and
    weight 0 in unused slots). Field agents: (agent, x[, y], neighbour) at every grid point over their
    neighbour lists, with ``sender``. Any agent family; computed with NumPy on the host.
    """
    require_dataset(state)
    if which not in ("belief", "prior"):
        raise ValueError(f"which: must be 'belief' or 'prior', got {which!r}")
    state = _host(state)
    if validate:
        validate_state(state, cfg)
    beta = _beta({k: state[k].values for k in state.data_vars}, cfg, which)
    n = beta.shape[0]
    name = "attention" if which == "belief" else "prior_attention"
    if family_of(cfg).name == "field":
        return _field_attention_array(state, cfg, beta, name)
    if cfg.dense:
        return xr.DataArray(
            beta, dims=("agent", "agent_j"), coords=dim_coords({"agent_j": n}), name=name, attrs=OUTPUTS[name]
        )
    nb = cfg.neighbours
    sender = np.where(nb.mask, nb.index, -1)
    coords = {
        "sender": (("agent", "neighbour"), sender, OUTPUTS["sender"]),
        **dim_coords({"neighbour": beta.shape[1]}),
    }
    return xr.DataArray(
        np.where(nb.mask, beta, 0.0),
        dims=("agent", "neighbour"),
        coords=coords,
        name=name,
        attrs=OUTPUTS[name],
    )


def _field_attention_array(state: xr.Dataset, cfg, beta: np.ndarray, name: str) -> xr.DataArray:
    """Field agents' attention per grid point, (agent, *grid, neighbour), over their neighbour lists."""
    from .fields.supports import neighbour_lists

    index, mask = neighbour_lists(state["support"].values, cfg)
    grid = cfg.grid_dims
    coords = {
        "sender": (("agent", "neighbour"), np.where(mask, index, -1), OUTPUTS["sender"]),
        **dim_coords({"neighbour": beta.shape[-1]}),
        **{d: state.coords[d] for d in grid if d in state.coords},
    }
    attrs = {**OUTPUTS[name], "long_name": OUTPUTS[name]["long_name"] + " at each grid point"}
    return xr.DataArray(beta, dims=("agent", *grid, "neighbour"), coords=coords, name=name, attrs=attrs)


# --- built-ins ----------------------------------------------------------------------------------


class _Frame:
    """One state seen by the observables of a step: host arrays, the config, belief attention (cached)."""

    def __init__(self, state: xr.Dataset, cfg):
        self.state = state
        self.cfg = cfg
        self.arrays = {k: state[k].values for k in state.data_vars}
        self._beta = None

    @property
    def beta(self) -> np.ndarray:
        if self._beta is None:
            self._beta = _beta(self.arrays, self.cfg)
        return self._beta


def _belief_spread(f: _Frame) -> float:
    """RMS distance of the beliefs from their population mean: means mu_q (Gaussian) or density matrices
    rho in the Frobenius norm (density-matrix agents)."""
    x = f.arrays["mu_q"] if "mu_q" in f.arrays else f.arrays["rho"]
    x = x.reshape(x.shape[0], -1)
    return float(np.sqrt(np.mean(np.sum(np.abs(x - x.mean(axis=0)) ** 2, axis=1))))


def _mean_frame_angle(f: _Frame) -> float:
    return float(np.mean(rotation_angle(f.arrays["phi"])))


def _attention(f: _Frame) -> np.ndarray:
    return _dense(f.beta, f.cfg)


@dataclass(frozen=True)
class _Builtin:
    fn: Callable[[_Frame], Any]
    dims: tuple[str, ...]
    doc: str
    attrs: dict | None = None  # None: OUTPUTS[name]


# Built-in observables: name -> function of a frame, dims per frame (after time).
BUILTINS = {
    "belief_spread": _Builtin(
        _belief_spread, (), "RMS distance of beliefs (mu_q; rho, Frobenius) from their population mean"
    ),
    "mean_frame_angle": _Builtin(
        _mean_frame_angle, (), "mean frame rotation angle, |phi| reduced to [0, pi]"
    ),
    "attention_entropy": _Builtin(
        lambda f: attention_entropy(f.beta), ("agent",), "entropy of each agent's belief attention row"
    ),
    "attention": _Builtin(_attention, ("agent", "agent_j"), "full belief attention beta (agent, agent_j)"),
}


# Field agents (vfesim.fields): the built-ins as support-weighted sums over the grid. With chi_i(c) the
# supports: belief_spread is the RMS distance of mu_i(c) from the chi-weighted mean of the agents at c
# (local disagreement, over every covered (agent, point)); mean_frame_angle the chi-weighted mean angle;
# attention_entropy and attention the chi_i-weighted means over the grid of agent i's attention row.
def _field_weights(f: _Frame) -> np.ndarray:
    chi = np.asarray(f.arrays["support"], np.float64)
    return chi.reshape(chi.shape[0], -1)


def _field_belief_spread(f: _Frame) -> float:
    w = _field_weights(f)
    mu = np.asarray(f.arrays["mu_q"], np.float64).reshape(*w.shape, -1)
    tot = w.sum(axis=0)
    local = np.einsum("np,npk->pk", w, mu) / np.where(tot > 0, tot, 1.0)[:, None]
    return float(np.sqrt(np.sum(w * np.sum((mu - local) ** 2, axis=-1)) / w.sum()))


def _field_mean_frame_angle(f: _Frame) -> float:
    w = _field_weights(f)
    return float(np.sum(w * rotation_angle(f.arrays["phi"]).reshape(w.shape)) / w.sum())


def _field_attention_entropy(f: _Frame) -> np.ndarray:
    w = _field_weights(f)
    beta = f.beta.reshape(*w.shape, -1)
    H = -np.sum(beta * np.log(np.where(beta > 0, beta, 1.0)), axis=-1)
    return np.sum(w * H, axis=1) / w.sum(axis=1)


def _field_attention(f: _Frame) -> np.ndarray:
    from .fields.supports import neighbour_lists

    w = _field_weights(f)
    mean = np.einsum("np,npk->nk", w, f.beta.reshape(*w.shape, -1)) / w.sum(axis=1)[:, None]
    index, mask = neighbour_lists(f.arrays["support"], f.cfg)
    n = w.shape[0]
    out = np.zeros((n, n))
    rows = np.broadcast_to(np.arange(n)[:, None], index.shape)
    out[rows[mask], index[mask]] = mean[mask]
    return out


_WEIGHTED = " (field agents: support-weighted over the grid)"
FAMILY_BUILTINS = {
    "field": {
        "belief_spread": _Builtin(
            _field_belief_spread,
            (),
            "RMS distance of mu_i(c) from the support-weighted mean of the agents at c",
            {
                "long_name": "local spread of beliefs (RMS distance from the support-weighted mean at each "
                "grid point)",
                "units": "1",
            },
        ),  # fmt: skip
        "mean_frame_angle": _Builtin(
            _field_mean_frame_angle,
            (),
            "support-weighted mean frame rotation angle",
            {
                **OUTPUTS["mean_frame_angle"],
                "long_name": OUTPUTS["mean_frame_angle"]["long_name"] + _WEIGHTED,
            },
        ),
        "attention_entropy": _Builtin(
            _field_attention_entropy,
            ("agent",),
            "support-weighted mean over the grid of each agent's attention entropy",
            {
                **OUTPUTS["attention_entropy"],
                "long_name": OUTPUTS["attention_entropy"]["long_name"] + _WEIGHTED,
            },
        ),
        "attention": _Builtin(
            _field_attention,
            ("agent", "agent_j"),
            "support-weighted mean over the grid of the belief attention (agent, agent_j)",
            {**OUTPUTS["attention"], "long_name": OUTPUTS["attention"]["long_name"] + _WEIGHTED},
        ),
    }
}


def default_observables(n_agents: int) -> list[str]:
    """The observables a run saves when its scenario names none: ``attention_entropy`` up to
    :data:`ATTENTION_ENTROPY_AUTO` agents, and ``attention`` up to :data:`ATTENTION_FULL_AUTO`."""
    out = []
    if n_agents <= ATTENTION_ENTROPY_AUTO:
        out.append("attention_entropy")
    if n_agents <= ATTENTION_FULL_AUTO:
        out.append("attention")
    return out


def unknown_builtin(name: Any) -> str | None:
    """The problem with a built-in observable's name (did-you-mean included), or None if it is one."""
    if not isinstance(name, str):
        return f"must be a name (string), got {type(name).__name__} {name!r}"
    if name in BUILTINS:
        return None
    close = difflib.get_close_matches(name, list(BUILTINS), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown observable {name!r}{hint} (built-ins: {list(BUILTINS)})"


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class _Entry:
    fn: Callable[[_Frame], Any]
    dims: tuple[str, ...] | None  # None: from the first value
    attrs: dict[str, str]


class Observables:
    """The observables of one run: name -> function, checked once; :meth:`evaluate` gives one step's values.

    spec: None, a sequence of built-in names, or a mapping name -> built-in name | function | Observable.
    reserved: names taken by other variables of the output (a clash is a ValueError naming it).
    """

    def __init__(self, spec, cfg, n_agents: int, reserved: Sequence[str] = ()):
        self.cfg, self.n_agents = cfg, int(n_agents)
        self.entries: dict[str, _Entry] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        if spec is None:
            spec = {}
        elif isinstance(spec, str) or not isinstance(spec, (Mapping, Sequence)):
            raise TypeError(
                "observables: expected a mapping name -> function (or built-in name) or a list of built-in "
                f"names, got {type(spec).__name__}"
            )
        items = spec.items() if isinstance(spec, Mapping) else ((name, name) for name in spec)
        taken = set(reserved) | set(DIMS) | RESERVED | {"agent"}
        for name, what in items:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"observables: name {name!r} must be an identifier (letters, digits, _)")
            if name in self.entries:
                raise ValueError(f"observables.{name}: given twice")
            if name in taken or name.startswith(ENERGY_PREFIX):
                raise ValueError(f"observables.{name}: the name is taken by another variable of the output")
            self.entries[name] = self._entry(name, what)

    def _entry(self, name: str, what) -> _Entry:
        if isinstance(what, str):
            problem = unknown_builtin(what)
            if problem:
                raise ValueError(f"observables.{name}: {problem}")
            b = FAMILY_BUILTINS.get(family_of(self.cfg).name, {}).get(what, BUILTINS[what])
            if what == "attention" and self.n_agents > ATTENTION_FULL_MAX:
                raise ValueError(
                    f"observables.{name}: the full attention of {self.n_agents} agents is N^2 values per "
                    f"frame; at most {ATTENTION_FULL_MAX} agents (attention_entropy summarises it for any N)"
                )
            return _Entry(b.fn, b.dims, dict(b.attrs or OUTPUTS[what]))
        if isinstance(what, Observable):
            fn, attrs = what.fn, {"long_name": what.long_name or name, "units": what.units}
        else:
            fn, attrs = what, {"long_name": name, "units": "1"}
        if not callable(fn):
            raise TypeError(
                f"observables.{name}: expected a function of the state Dataset, a built-in name or a "
                f"vfesim.Observable, got {type(fn).__name__}"
            )
        return _Entry(lambda f, fn=fn: fn(f.state), None, attrs)

    @property
    def names(self) -> list[str]:
        return list(self.entries)

    @property
    def var_attrs(self) -> dict[str, dict[str, str]]:
        """name -> its attributes (long_name, units)."""
        return {k: dict(e.attrs) for k, e in self.entries.items()}

    def stack(self, values: list[dict[str, np.ndarray]]) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
        """Recorded values (one :meth:`evaluate` per step) as name -> (dims after ``time``, (T, ...))."""
        return {k: (self.dims(k, values[0][k]), np.stack([v[k] for v in values])) for k in self.entries}

    def dims(self, name: str, value: np.ndarray) -> tuple[str, ...]:
        """Dims (after ``time``) of an observable, given one of its values."""
        e = self.entries[name]
        return e.dims if e.dims is not None else (() if value.ndim == 0 else ("agent",))

    def evaluate(self, state: xr.Dataset) -> dict[str, np.ndarray]:
        """Every observable of ``state`` (any array type; observables see it on the host) as float64:
        a scalar () or one value per agent (N,) (built-ins: their documented dims)."""
        if not self.entries:
            return {}
        frame = _Frame(_host(state), self.cfg)
        out = {}
        for name, e in self.entries.items():
            try:
                v = np.asarray(e.fn(frame))
            except Exception as err:
                err.add_note(f"(in observable {name!r})")
                raise
            if np.iscomplexobj(v) or not (np.issubdtype(v.dtype, np.number) or v.dtype == np.bool_):
                raise TypeError(f"observables.{name}: must return real numbers, got dtype {v.dtype}")
            if e.dims is None and v.shape not in ((), (self.n_agents,)):
                raise ValueError(
                    f"observables.{name}: must return a scalar or one value per agent ({self.n_agents},), "
                    f"got shape {v.shape}"
                )
            if self._shapes.setdefault(name, v.shape) != v.shape:
                raise ValueError(
                    f"observables.{name}: returned shape {v.shape}, its first value had {self._shapes[name]}"
                )
            out[name] = v.astype(np.float64)
        return out
