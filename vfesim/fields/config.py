"""Configuration of field agents: the point-agent model keys plus the grid (a frozen, validated dataclass).

Every impossible value is rejected at construction with a :class:`~vfesim.config.ConfigError` naming the
key; the point-agent keys are validated by building the :class:`~vfesim.ModelConfig` of the pointwise
model (:attr:`FieldConfig.point`). Dict/JSON round trip, ``replace`` and equality come from
:class:`~vfesim.config.JsonConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..config import ConfigError, JsonConfig, ModelConfig, SparseNeighbours, _check_real, resolve_neighbours

__all__ = ["FieldConfig", "BOUNDARIES", "MODEL_KEYS"]

BOUNDARIES = ("periodic", "bounded")
# The keys of the pointwise model (a ModelConfig's fields).
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig))


@dataclasses.dataclass(frozen=True, eq=False)
class FieldConfig(JsonConfig):
    """Parameters of the field free energy (every point-agent term evaluated pointwise and summed over
    the grid, see :mod:`vfesim.fields.energy`).

    Point-agent keys: as :class:`~vfesim.ModelConfig` (K, lambdas, kappas, aggregator, irreps, W, R,
    dtype, jitter), except ``neighbours``: ``"overlap"`` (default: j != i with
    ``max_c chi_i(c) chi_j(c) >= overlap_threshold``), ``"dense"`` (all j != i) or a
    :class:`~vfesim.SparseNeighbours` (an explicit list).
    grid: the grid shape, ``(nx,)`` or ``(nx, ny)``; spacing: the distance between grid points (> 0);
    coordinates are ``x = spacing * arange(nx)`` (and y likewise).
    boundary: ``"periodic"`` (a ring or torus) or ``"bounded"``.
    overlap_threshold: in [0, 1] (default 0.1).
    cell_volume: the weight of a grid point in every sum: ``"sum"`` (default: 1, a plain sum, as the
    reference system), ``"grid"`` (spacing ** ndim, a Riemann sum) or a number > 0.
    lambda_phi: weight of the gauge smoothness ``sum_i sum_c chi_i |grad phi_i|^2`` (>= 0, default 0).
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
    neighbours: Any = "overlap"
    W: np.ndarray | None = None
    R: np.ndarray | None = None
    dtype: str | None = None
    jitter: float = 0.0
    grid: tuple[int, ...] | None = None
    boundary: str = "periodic"
    spacing: float = 1.0
    overlap_threshold: float = 0.1
    cell_volume: Any = "sum"
    lambda_phi: float = 0.0

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)
        nb = self.neighbours
        if isinstance(nb, str) and nb not in ("overlap", "dense"):
            raise ConfigError("neighbours", f"must be 'overlap', 'dense' or SparseNeighbours, got {nb!r}")
        if not isinstance(nb, str):
            s("neighbours", resolve_neighbours(nb))
        model = {k: getattr(self, k) for k in MODEL_KEYS}
        model["neighbours"] = self.neighbours if isinstance(self.neighbours, SparseNeighbours) else "dense"
        point = ModelConfig(**model)  # validates the point-agent keys, naming them
        for k in MODEL_KEYS:
            if k != "neighbours":
                s(k, getattr(point, k))
        s("_point", point)
        self._check_grid()
        if not isinstance(self.boundary, str) or self.boundary not in BOUNDARIES:
            raise ConfigError("boundary", f"must be one of {BOUNDARIES}, got {self.boundary!r}")
        s("spacing", _check_real("spacing", self.spacing, positive=True))
        t = _check_real("overlap_threshold", self.overlap_threshold, nonneg=True)
        if t > 1:
            raise ConfigError("overlap_threshold", f"must be in [0, 1] (supports lie in [0, 1]), got {t}")
        s("overlap_threshold", t)
        cv = self.cell_volume
        if isinstance(cv, str):
            if cv not in ("sum", "grid"):
                raise ConfigError("cell_volume", f"must be 'sum', 'grid' or a number > 0, got {cv!r}")
        else:
            s("cell_volume", _check_real("cell_volume", cv, positive=True))
        s("lambda_phi", _check_real("lambda_phi", self.lambda_phi, nonneg=True))

    def _check_grid(self) -> None:
        g = self.grid
        if g is None:
            raise ConfigError("grid", "give the grid shape, (nx,) or (nx, ny)")
        if isinstance(g, (int, np.integer)) and not isinstance(g, bool):
            g = (g,)
        if not isinstance(g, (tuple, list)) or len(g) not in (1, 2):
            raise ConfigError("grid", f"must be (nx,) or (nx, ny), got {g!r}")
        for n in g:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ConfigError("grid", f"each size must be an integer >= 1, got {n!r}")
        object.__setattr__(self, "grid", tuple(int(n) for n in g))

    # --- derived -----------------------------------------------------------------------------
    @property
    def point(self) -> ModelConfig:
        """The pointwise model: a :class:`~vfesim.ModelConfig` with this config's point-agent keys
        (neighbours "dense" unless an explicit list is given)."""
        return self._point  # type: ignore[attr-defined]

    @property
    def ndim(self) -> int:
        return len(self.grid)

    @property
    def grid_dims(self) -> tuple[str, ...]:
        """Names of the grid dims: ("x",) or ("x", "y")."""
        return ("x", "y")[: self.ndim]

    @property
    def n_points(self) -> int:
        return math.prod(self.grid)

    @property
    def weight(self) -> float:
        """The weight of one grid point in every sum (the resolved ``cell_volume``)."""
        if self.cell_volume == "sum":
            return 1.0
        if self.cell_volume == "grid":
            return self.spacing**self.ndim
        return float(self.cell_volume)

    @property
    def obs_dim(self) -> int:
        return self.point.obs_dim

    @property
    def dense(self) -> bool:
        """True unless an explicit neighbour list is given."""
        return isinstance(self.neighbours, str)

    def coords(self) -> dict[str, np.ndarray]:
        """Grid coordinates: dim name -> spacing * arange(n) (float64)."""
        return {
            d: self.spacing * np.arange(n, dtype=np.float64)
            for d, n in zip(self.grid_dims, self.grid, strict=True)
        }

    def replace(self, **changes: Any) -> FieldConfig:
        """A new config with some fields changed (validated again); a new K drops the old irreps."""
        if "irreps" not in changes and "K" in changes:
            changes = {**changes, "irreps": None}
        return super().replace(**changes)

    @classmethod
    def _from_dict_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        for k in ("irreps", "grid"):
            if isinstance(d.get(k), list):
                d[k] = tuple(d[k])
        return d
