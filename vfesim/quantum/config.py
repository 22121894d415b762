"""Configuration of density-matrix agents (spec/quantum.md §2.1): a frozen, validated dataclass.

Every impossible value is rejected at construction with a :class:`~vfesim.config.ConfigError` that names
the key. Dict/JSON round trip, ``replace`` and equality come from :class:`~vfesim.config.JsonConfig`,
neighbours from :func:`~vfesim.config.resolve_neighbours`, exactly as for :class:`~vfesim.ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..config import ConfigError, JsonConfig, _check_real, resolve_neighbours

__all__ = ["QuantumConfig", "AGGREGATORS", "DTYPES"]

AGGREGATORS = ("softmin", "expected")
DTYPES = ("complex64", "complex128")


@dataclasses.dataclass(frozen=True, eq=False)
class QuantumConfig(JsonConfig):
    """Parameters of the density-matrix free energy (spec/quantum.md §2.1)::

        F = lambda_self   sum_i D(rho_i || sigma_i)
          + lambda_belief sum_i Agg_kappa_beta({D(rho~_i || rho~_j)}_j)
          + lambda_prior  sum_i Agg_kappa_gamma({D(sigma~_i || sigma~_j)}_j)
          + lambda_obs    sum_i -log <y_i| rho_i |y_i>

    d: Hilbert dimension (>= 2). aggregator: "softmin" (default, -kappa log sum_j exp(-D_ij/kappa)) or
    "expected" (sum_j beta_ij D_ij). neighbours: "dense" (all j != i) or a
    :class:`~vfesim.SparseNeighbours`. dtype: None (default: states of either complex dtype, computed in
    their own) or "complex64" / "complex128" (states must have it).
    """

    d: int | None = None
    lambda_self: float = 1.0
    lambda_belief: float = 1.0
    lambda_prior: float = 0.0
    lambda_obs: float = 0.0
    kappa_beta: float = 1.0
    kappa_gamma: float = 1.0
    aggregator: str = "softmin"
    neighbours: Any = "dense"
    dtype: str | None = None

    def __post_init__(self) -> None:
        s = lambda k, v: object.__setattr__(self, k, v)
        d = self.d
        if d is None:
            raise ConfigError("d", "give the Hilbert dimension d (an integer >= 2)")
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 2:
            raise ConfigError("d", f"must be an integer >= 2, got {d!r}")
        s("d", int(d))
        for key in ("lambda_self", "lambda_belief", "lambda_prior", "lambda_obs"):
            s(key, _check_real(key, getattr(self, key), nonneg=True))
        for key in ("kappa_beta", "kappa_gamma"):
            s(key, _check_real(key, getattr(self, key), positive=True))
        if not isinstance(self.aggregator, str) or self.aggregator not in AGGREGATORS:
            raise ConfigError("aggregator", f"must be one of {AGGREGATORS}, got {self.aggregator!r}")
        if isinstance(self.dtype, (np.dtype, type)):
            try:
                s("dtype", np.dtype(self.dtype).name)
            except TypeError:
                raise ConfigError("dtype", f"must be None or one of {DTYPES}, got {self.dtype!r}") from None
        if self.dtype is not None and (not isinstance(self.dtype, str) or self.dtype not in DTYPES):
            raise ConfigError("dtype", f"must be None or one of {DTYPES}, got {self.dtype!r}")
        s("neighbours", resolve_neighbours(self.neighbours))

    @property
    def dense(self) -> bool:
        return isinstance(self.neighbours, str)
