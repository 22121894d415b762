"""The pairwise layer, free of any agent family (SPEC §2.3–2.4).

A family reduces its pairwise divergence to per-agent feature rows: ``D_ij = 1/2 (A_i . B_j + c_i)``
(the Gaussian KL after transport, SPEC §2.3; the quantum relative entropy likewise). Everything here
works on those rows, whatever produced them: the attention softmax over ``-D_ij / kappa``, the
aggregators ("expected", "softmin"), dense and sparse neighbours, and the cotangents
``gA = 1/2 W B``, ``gB = 1/2 W^T A``, ``gc = 1/2 sum_j W`` with ``W_ij = dE/dD_ij``.

- :mod:`.reference`: the NumPy reference (row-blocked GEMMs; gathered sparse lists);
- :mod:`.blocks`: a receiver block against a sender block (statistics, merge, gradient pass), the
  unit of work of a distributed scheduler;
- :mod:`.gemm`: dense pairs by device GEMMs plus one row kernel (CUDA, long features);
- :mod:`.weighted`: pair weights outside the softmax (field agents' support products).
The streaming CPU and CUDA kernels are :mod:`vfesim_kernels.pairwise_cpu` and
:mod:`vfesim_kernels.cuda.pairwise`, keyed by the feature width D.
"""

from collections.abc import Callable

from . import blocks, weighted
from .reference import aggregator_check, pairwise_dense, pairwise_sparse, row_weights

__all__ = [
    "aggregator_check",
    "blocks",
    "weighted",
    "pairwise_dense",
    "pairwise_sparse",
    "pairwise_energy",
    "row_weights",
]


def pairwise_energy(
    A,
    B,
    c,
    kappa: float,
    aggregator: str,
    neighbours: tuple | None = None,
    *,
    dense: Callable = pairwise_dense,
    sparse: Callable = pairwise_sparse,
):
    """(E, gA, gB, gc) of one alignment term: all pairs through ``dense`` when ``neighbours`` is None,
    else the lists ``neighbours = (index, mask)`` through ``sparse`` (a backend's kernels, or the NumPy
    reference by default)."""
    if neighbours is None:
        return dense(A, B, c, kappa, aggregator)
    return sparse(A, B, c, *neighbours, kappa, aggregator)
