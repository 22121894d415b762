"""Model configuration (SPEC §2.2): a frozen, validated dataclass.

Every impossible value is rejected at construction with a :class:`ConfigError` that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "ConfigError",
    "JsonConfig",
    "ModelConfig",
    "SparseNeighbours",
    "resolve_neighbours",
    "scenario_bool",
    "scenario_range",
    "scenario_real",
]

AGGREGATORS = ("expected", "softmin")
DTYPES = ("float32", "float64")


class ConfigError(ValueError):
    """A configuration value is impossible; the message names the key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


# Ring lists alive somewhere, by (n_agents, half_width): read-only, so shared (freed with their last user).
_RINGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class SparseNeighbours:
    """Fixed-width neighbour lists: ``index[i, k]`` is the k-th sender of receiver i where ``mask[i, k]``.

    index: (N, k) integer; mask: (N, k) bool. Entries under ``mask == False`` are ignored.
    Self-loops and repeated senders within a row are rejected.
    """

    index: np.ndarray
    mask: np.ndarray

    def __post_init__(self) -> None:
        index = np.asarray(self.index)
        mask = np.ones(index.shape, bool) if self.mask is None else np.asarray(self.mask)
        if index.ndim != 2:
            raise ConfigError("neighbours.index", f"must be 2-D (agent, k), got shape {index.shape}")
        if not np.issubdtype(index.dtype, np.integer):
            raise ConfigError("neighbours.index", f"must be integer, got dtype {index.dtype}")
        if mask.shape != index.shape or mask.dtype != np.bool_:
            raise ConfigError(
                "neighbours.mask",
                f"must be bool with shape {index.shape}, got {mask.dtype} {mask.shape}",
            )
        n = index.shape[0]
        bad = mask & ((index < 0) | (index >= n))
        if bad.any():
            i, k = np.argwhere(bad)[0]
            raise ConfigError(
                "neighbours.index",
                f"agent {i} slot {k} names sender {index[i, k]}, outside 0..{n - 1}",
            )
        self_loop = mask & (index == np.arange(n)[:, None])
        if self_loop.any():
            i = int(np.argwhere(self_loop)[0][0])
            raise ConfigError("neighbours.index", f"agent {i} lists itself (the diagonal is excluded)")
        masked = np.where(mask, index, -1 - np.arange(index.shape[1])[None, :])
        srt = np.sort(masked, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            i, k = np.argwhere(dup)[0]
            raise ConfigError("neighbours.index", f"agent {i} lists sender {srt[i, k]} twice")
        object.__setattr__(self, "index", _readonly(index.astype(np.int64)))
        object.__setattr__(self, "mask", _readonly(mask))

    @property
    def n_agents(self) -> int:
        return self.index.shape[0]

    @property
    def width(self) -> int:
        return self.index.shape[1]

    @classmethod
    def ring(cls, n_agents: int, half_width: int) -> SparseNeighbours:
        """Each agent listens to the ``half_width`` agents on each side of it on a ring."""
        if n_agents < 2 or half_width < 1 or 2 * half_width > n_agents - 1:
            raise ConfigError(
                "neighbours",
                f"ring needs 1 <= 2*half_width <= n_agents-1, got "
                f"n_agents={n_agents}, half_width={half_width}",
            )
        key = (int(n_agents), int(half_width))
        hit = _RINGS.get(key)  # one config, validated again (Scenario.replace), reuses its lists
        if hit is not None:
            return hit
        offs = np.concatenate([np.arange(-half_width, 0), np.arange(1, half_width + 1)])
        idx = np.arange(n_agents, dtype=np.int64)[:, None] + offs[None, :]
        idx[:half_width] %= n_agents  # only the first and last half_width rows wrap around
        idx[-half_width:] %= n_agents
        # In range, no self-loops, no repeats (2 half_width < n_agents): the checks of the constructor,
        # which sort every row (~30 s for 4e7 agents), are not needed.
        ring = _RINGS[key] = cls._valid(idx, np.ones(idx.shape, bool))
        return ring

    @classmethod
    def _valid(cls, index: np.ndarray, mask: np.ndarray) -> SparseNeighbours:
        """Lists valid by construction (int64 index, bool mask of its shape), taken without the checks and
        without a copy (made read-only)."""
        obj = object.__new__(cls)
        for name, a in (("index", index), ("mask", mask)):
            a.setflags(write=False)
            object.__setattr__(obj, name, a)
        return obj

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence[int]]) -> SparseNeighbours:
        """Pad ragged neighbour lists to fixed width with a mask."""
        width = max((len(x) for x in lists), default=0)
        idx = np.zeros((len(lists), max(width, 1)), np.int64)
        mask = np.zeros(idx.shape, bool)
        for i, row in enumerate(lists):
            idx[i, : len(row)] = row
            mask[i, : len(row)] = True
        return cls(idx, mask)

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index.tolist(), "mask": self.mask.tolist()}

    def summary(self) -> dict[str, Any]:
        """The shape of the lists without them (what a run's metadata records: a ring of 4e7 agents
        has 1.3e9 entries)."""
        return {"sparse": {"n_agents": self.n_agents, "width": self.width}}

    def __eq__(self, other: object) -> bool:
        # Entries under mask == False are ignored, as everywhere; the slot order is part of the lists.
        return (
            isinstance(other, SparseNeighbours)
            and np.array_equal(self.mask, other.mask)
            and np.array_equal(np.where(self.mask, self.index, -1), np.where(other.mask, other.index, -1))
        )

    __hash__ = None  # type: ignore[assignment]


def _check_real(
    key: str, value: Any, *, positive: bool = False, nonneg: bool = False, error: type = ConfigError
) -> float:
    """A finite real number (optionally > 0 or >= 0); otherwise ``error(key, message)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(key, f"must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise error(key, f"must be finite, got {v}")
    if positive and v <= 0:
        raise error(key, f"must be > 0, got {v}")
    if nonneg and v < 0:
        raise error(key, f"must be >= 0, got {v}")
    return v


def resolve_neighbours(nb: Any) -> str | SparseNeighbours:
    """The ``neighbours`` field of a model config: ``"dense"``, a :class:`SparseNeighbours`, or a dict
    ``{"index": ..., "mask": ...}`` (as in JSON) turned into one; anything else is a ConfigError."""
    if isinstance(nb, str):
        if nb != "dense":
            raise ConfigError("neighbours", f"must be 'dense' or SparseNeighbours, got {nb!r}")
        return nb
    if isinstance(nb, dict):
        if set(nb) == {"sparse"}:
            raise ConfigError(
                "neighbours",
                f"only the shape of sparse neighbour lists is recorded here ({nb['sparse']}), not the lists: "
                "give the config the lists (SparseNeighbours), or for a run store rebuild it from the run's "
                "scenario (vfesim.plots.run_config)",
            )
        if "index" not in nb or set(nb) - {"index", "mask"}:
            raise ConfigError("neighbours", f"a dict needs 'index' and optionally 'mask', got {sorted(nb)}")
        mask = None if nb.get("mask") is None else np.asarray(nb["mask"])
        return SparseNeighbours(np.asarray(nb["index"]), mask)
    if not isinstance(nb, SparseNeighbours):
        raise ConfigError("neighbours", f"must be 'dense' or SparseNeighbours, got {type(nb)}")
    return nb


class JsonConfig:
    """Mixin of the frozen model configs: dict/JSON round trip (unknown keys are ConfigErrors naming the
    key), ``replace``, equality by JSON. Subclasses are frozen dataclasses; ``_from_dict_fields`` may
    adapt JSON values (lists back to tuples) before construction."""

    def to_dict(self, neighbour_lists: bool = True) -> dict[str, Any]:
        """The fields as JSON-able data; ``neighbour_lists=False``: sparse neighbours by their shape only
        (:meth:`SparseNeighbours.summary`; such a dict does not load back)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                v = v.tolist()
            elif isinstance(v, SparseNeighbours):
                v = v.to_dict() if neighbour_lists else v.summary()
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def to_json(self, neighbour_lists: bool = True) -> str:
        return json.dumps(self.to_dict(neighbour_lists), sort_keys=True)

    @classmethod
    def _from_dict_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(unknown[0], f"unknown model key (known: {sorted(names)})")
        return cls(**cls._from_dict_fields(dict(d)))

    @classmethod
    def from_json(cls, s: str):
        return cls.from_dict(json.loads(s))

    def replace(self, **changes: Any):
        """A new config with some fields changed (validated again)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        d.update(changes)
        return type(self)(**d)

    def __eq__(self, other: object) -> bool:
        # The neighbour lists compared as arrays, not through JSON (they can be large).
        return (
            isinstance(other, type(self))
            and self.to_json(neighbour_lists=False) == other.to_json(neighbour_lists=False)
            and getattr(self, "neighbours", None) == getattr(other, "neighbours", None)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelConfig(JsonConfig):
    """Parameters of the Gaussian free energy (SPEC §2.2).

    K: latent dimension. With ``irreps=None`` K must be odd (one irrep, l = (K-1)/2); with ``irreps``
    a list of l's, K defaults to and must equal sum(2l+1).
    neighbours: ``"dense"`` (all j != i) or a :class:`SparseNeighbours`.
    W (obs_dim, K), R (obs_dim, obs_dim) SPD: the linear Gaussian observation model, needed when
    ``lambda_obs > 0``.
    jitter: explicit eps added as eps*I to every covariance before the energy (default 0: none).
    dtype: None (default): states of any float dtype are accepted and computed in their own dtype
    (``random_state`` makes float64); "float32" / "float64": states must have that dtype, and a state
    of the other one is refused naming the variable and both dtypes (cast it with ``state.astype``).
    """

    K: int | None = None
    lambda_self: float = 1.0
    lambda_belief: float = 1.0
    lambda_prior: float = 0.0
    lambda_obs: float = 0.0
    kappa_beta: float = 1.0
    kappa_gamma: float = 1.0
    aggregator: str = "expected"
    irreps: tuple[int, ...] | None = None
    neighbours: Any = "dense"
    W: np.ndarray | None = None
    R: np.ndarray | None = None
    dtype: str | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)
        for key in ("lambda_self", "lambda_belief", "lambda_prior", "lambda_obs"):
            s(key, _check_real(key, getattr(self, key), nonneg=True))
        for key in ("kappa_beta", "kappa_gamma"):
            s(key, _check_real(key, getattr(self, key), positive=True))
        s("jitter", _check_real("jitter", self.jitter, nonneg=True))
        if self.aggregator not in AGGREGATORS:
            raise ConfigError("aggregator", f"must be one of {AGGREGATORS}, got {self.aggregator!r}")
        if isinstance(self.dtype, (np.dtype, type)):
            try:
                s("dtype", np.dtype(self.dtype).name)
            except TypeError:
                raise ConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}") from None
        if self.dtype is not None and (not isinstance(self.dtype, str) or self.dtype not in DTYPES):
            raise ConfigError("dtype", f"must be None or one of {DTYPES}, got {self.dtype!r}")
        self._resolve_irreps()
        self._resolve_neighbours()
        self._resolve_observation()

    def _resolve_irreps(self) -> None:
        K, irreps = self.K, self.irreps
        if K is not None and (isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1):
            raise ConfigError("K", f"must be a positive integer, got {K!r}")
        if irreps is None:
            if K is None:
                raise ConfigError("K", "give K (odd) or irreps (a list of l's)")
            if K % 2 == 0:
                raise ConfigError(
                    "K",
                    f"a single so(3) irrep has odd dimension 2l+1; got K={K} (use irreps=[...] "
                    "for a block-diagonal sum of irreps)",
                )
            irreps = ((K - 1) // 2,)
        else:
            if isinstance(irreps, (int, np.integer)) or not len(irreps):
                raise ConfigError("irreps", f"must be a non-empty list of l >= 0, got {irreps!r}")
            for l in irreps:
                if isinstance(l, bool) or not isinstance(l, (int, np.integer)) or l < 0:
                    raise ConfigError("irreps", f"each l must be an integer >= 0, got {l!r}")
            irreps = tuple(int(l) for l in irreps)
            total = sum(2 * l + 1 for l in irreps)
            if K is not None and K != total:
                raise ConfigError("K", f"irreps {list(irreps)} give K={total}, not {K}")
            K = total
        object.__setattr__(self, "K", int(K))
        object.__setattr__(self, "irreps", irreps)

    def _resolve_neighbours(self) -> None:
        object.__setattr__(self, "neighbours", resolve_neighbours(self.neighbours))

    def _resolve_observation(self) -> None:
        W, R = self.W, self.R
        if W is None and R is None:
            if self.lambda_obs > 0:
                raise ConfigError("W", "lambda_obs > 0 needs the observation model W and R")
            return
        if W is None or R is None:
            raise ConfigError("W" if W is None else "R", "W and R must be given together")
        W = np.asarray(W, dtype=np.float64)
        R = np.asarray(R, dtype=np.float64)
        if W.ndim != 2 or W.shape[1] != self.K:
            raise ConfigError("W", f"must have shape (obs_dim, K={self.K}), got {W.shape}")
        if R.shape != (W.shape[0], W.shape[0]):
            raise ConfigError("R", f"must have shape {(W.shape[0],) * 2}, got {R.shape}")
        if not (np.isfinite(W).all()):
            raise ConfigError("W", "must be finite")
        if not np.isfinite(R).all() or not np.allclose(R, R.T, rtol=1e-12, atol=0):
            raise ConfigError("R", "must be finite and symmetric")
        try:
            np.linalg.cholesky(R)
        except np.linalg.LinAlgError:
            raise ConfigError("R", "must be positive definite (Cholesky failed)") from None
        object.__setattr__(self, "W", _readonly(W))
        object.__setattr__(self, "R", _readonly(R))

    # --- derived -----------------------------------------------------------------------------
    @property
    def obs_dim(self) -> int:
        return 0 if self.W is None else self.W.shape[0]

    @property
    def dense(self) -> bool:
        return isinstance(self.neighbours, str)

    def replace(self, **changes: Any) -> ModelConfig:
        """A new config with some fields changed (validated again); a new K drops the old irreps."""
        if "irreps" not in changes and "K" in changes:
            changes = {**changes, "irreps": None}
        return super().replace(**changes)

    @classmethod
    def _from_dict_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        if d.get("irreps") is not None and not isinstance(d["irreps"], (int, np.integer)):
            d["irreps"] = tuple(d["irreps"])
        return d


# The [model] keys of a scenario (the ModelConfig fields but dtype and neighbours, which a scenario sets
# in run.dtype and population.neighbours): key -> (type, one-line description). The scenario-key
# reference of the docs is generated from these; tests/test_docs.py checks that every key has one.
MODEL_DOCS = {
    "K": ("int", "latent dimension; odd for one so(3) irrep (l = (K-1)/2). Required, or irreps"),
    "lambda_self": ("float >= 0", "weight of the self term sum_i KL(q_i || p_i)"),
    "lambda_belief": ("float >= 0", "weight of belief alignment, KL(q_i || Omega_ij q_j) over neighbours"),
    "lambda_prior": ("float >= 0", "weight of prior alignment, KL(p_i || Omega_ij p_j) over neighbours"),
    "lambda_obs": ("float >= 0", "weight of the observation term E_q[-log N(o_i; W z, R)]; > 0 needs W, R"),
    "kappa_beta": ("float > 0", "temperature of the belief-alignment attention softmax"),
    "kappa_gamma": ("float > 0", "temperature of the prior-alignment attention softmax"),
    "aggregator": ('"expected" | "softmin"', "how an agent aggregates its divergences to the neighbours"),
    "irreps": ("list[int]", "a block-diagonal sum of so(3) irreps, one l >= 0 each; sets K = sum(2l+1)"),
    "W": ("list[list[float]]", "observation matrix (obs_dim, K); with R, the linear Gaussian observations"),
    "R": (
        "list[list[float]]",
        "observation noise covariance (obs_dim, obs_dim), symmetric positive definite",
    ),
    "jitter": ("float >= 0", "eps added as eps*I to every covariance before the energy"),
}


# Checks of scenario values (the families' run sections, vfesim.*.runs): a ConfigError names the key.
def scenario_real(
    key: str, v: Any, lo: float | None = None, strict: bool = False, hi: float | None = None
) -> float:
    """A finite number, >= lo (> lo when ``strict``) and < hi where given."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
        raise ConfigError(key, f"must be a finite number, got {v!r}")
    if lo is not None and (v <= lo if strict else v < lo):
        raise ConfigError(key, f"must be {'>' if strict else '>='} {lo}, got {v}")
    if hi is not None and v >= hi:
        raise ConfigError(key, f"must be < {hi:.6g}, got {v}")
    return float(v)


def scenario_bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(key, f"must be true or false, got {v!r}")
    return v


def scenario_range(key: str, v: Any) -> tuple[float, float]:
    """A pair [lo, hi] of numbers with 0 < lo <= hi."""
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ConfigError(key, f"must be a pair [lo, hi], got {v!r}")
    lo, hi = (scenario_real(key, x, 0.0, strict=True) for x in v)
    if lo > hi:
        raise ConfigError(key, f"needs lo <= hi, got [{lo}, {hi}]")
    return lo, hi
