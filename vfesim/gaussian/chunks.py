"""Gaussian agents evaluated chunk by chunk (the dask backend): the one population-wide quantity of the
per-agent stages.

:func:`~vfesim.gaussian.features.agent_features` centres nu_i = R_i^T mu_i on a common vector (exact: the
pairwise KL is invariant under a common shift of both means). Chunks of one population must share that
vector, or the features of different chunks would describe differently shifted populations. Per chunk,
:func:`population_sum` gives (sum_i nu_i over the chunk's belief and prior means); the executor sums them in
chunk order, divides by N and evaluates every chunk with :func:`chunk_agent_ops` of the result.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .energy import NUMPY_AGENT_OPS, AgentOps

__all__ = ["population_sum", "chunk_agent_ops"]


def population_sum(arrays: dict[str, Any], cfg, ops: AgentOps = NUMPY_AGENT_OPS) -> dict[str, np.ndarray]:
    """Per mean variable ("mu_q", "mu_p"): sum over the chunk's agents of nu_i = R_i^T mu_i (K,), float64
    (frames by ``ops``)."""
    R = ops.frames(arrays["phi"], cfg.irreps)
    return {k: np.einsum("nkl,nk->l", R, arrays[k]).astype(np.float64) for k in ("mu_q", "mu_p")}


def _features(features, centres: dict[str, np.ndarray], mu, sigma, R, name: str = "sigma"):
    return features(mu, sigma, R, name, centre=centres["mu_q" if name == "sigma_q" else "mu_p"])


def chunk_agent_ops(centres: dict[str, np.ndarray], ops: AgentOps = NUMPY_AGENT_OPS) -> AgentOps:
    """The stages ``ops`` (the array-generic ones by default; any whose ``features`` takes ``centre=``)
    with nu centred on ``centres`` (mean variable -> (K,), the population's mean of nu) instead of each
    chunk's own mean."""
    return ops._replace(features=partial(_features, ops.features, centres))
