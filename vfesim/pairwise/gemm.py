"""Dense pairs by row blocks of device GEMMs (the CUDA path for long features, e.g. D = 253 at K = 21).

``KL_ij / kappa = Ah_i . B_j + ch_i`` with receiver features pre-scaled by ``1 / (2 kappa)``. Each block of
receiver rows is one GEMM (logits), one row kernel (max shift, weights W_ij, row energies and sums,
:func:`vfesim_kernels.cuda.make_gemm_row_kernel`) and two GEMMs (``W B`` and ``W^T Ah``). Peak memory
O(block * N) (:func:`block_rows`); every sum in a fixed order (no atomics).
"""

from __future__ import annotations

import functools

import numpy as np

from ..arrays import array_module

__all__ = ["pairwise_gemm", "pairwise_dense_gemm", "block_rows", "GEMM_BLOCK_BYTES"]

# Bytes of one (receiver block, N) logit slab: 1 GiB, or a sixteenth of the GPU's memory where that is less.
# Fewer, larger blocks run faster (larger GEMMs, fewer launches); on an H100 (benchmarks/results/
# gemm_block_h100_stop38.txt), 256 MB -> 1 GB slabs made the density-matrix pairs at d = 8 (D = 64) 7.1 ->
# 6.3 ms (complex128) and 6.2 -> 5.0 ms (complex64) at N = 16 384, 116 -> 98 and 99 -> 78 ms at 65 536.
GEMM_BLOCK_BYTES = 1 << 30


def block_rows(N: int, dtype, xp, device: int | None = None) -> int:
    """Receiver rows per GEMM block for N senders in ``dtype`` (GEMM_BLOCK_BYTES, or for CuPy arrays
    (``xp``) a sixteenth of the memory of GPU ``device``, the current one if None), at least 1 and at most
    N."""
    limit = GEMM_BLOCK_BYTES
    if xp is not np:
        limit = min(limit, _device_memory(xp.cuda.Device().id if device is None else device, xp) // 16)
    return max(1, min(N, limit // (N * np.dtype(dtype).itemsize)))


@functools.cache
def _device_memory(device_id: int, xp) -> int:
    return int(xp.cuda.Device(device_id).mem_info[1])


def pairwise_gemm(Ah, B, ch, aggregator: str, out=None):
    """Dense pairs j != i: Ah, B (N, D), ch (N,) on the device.

    Returns (written into ``out`` when given) per-receiver energies / kappa (N,), sum_j W_ij B_j (N, D),
    sum_j W_ij (N,) and sum_i W_ij Ah_i (N, D).
    """
    from vfesim_kernels import cuda as kc

    xp = array_module(Ah)
    N = Ah.shape[0]
    if out is None:
        out = (xp.empty(N, Ah.dtype), xp.empty_like(B), xp.empty(N, Ah.dtype), xp.empty_like(Ah))
    e_rows, wB, wsum, wA = out
    if N < 2:
        for a in out:
            a.fill(0)
        return out
    block = block_rows(N, Ah.dtype, xp, getattr(getattr(Ah, "device", None), "id", None))
    rows = kc.make_gemm_row_kernel(Ah.dtype.name, aggregator)["rows"]
    # The kernel takes contiguous vectors (the simulator transfers nothing else).
    wsum_c = wsum if wsum.flags.c_contiguous else xp.empty(N, Ah.dtype)
    for r0 in range(0, N, block):
        r1 = min(N, r0 + block)
        L = Ah[r0:r1] @ B.T
        # Logits, max shift, weights, energies and row sums in one kernel: W overwrites L.
        rows[r1 - r0, kc.ROW_THREADS](L, ch, r0, e_rows, wsum_c)
        wB[r0:r1] = L @ B  # (wB may be a strided view of a kernel buffer)
        if r0 == 0:
            wA[...] = L.T @ Ah[r0:r1]
        else:
            wA += L.T @ Ah[r0:r1]
    if wsum_c is not wsum:
        wsum[...] = wsum_c
    return out


def pairwise_dense_gemm(A, B, c, kappa: float, aggregator: str):
    """The contract of :func:`vfesim.pairwise.reference.pairwise_dense` on device arrays, through
    :func:`pairwise_gemm`: (E (a float, summed in float64), gA, gB, gc)."""
    from vfesim_kernels.cuda.reduce import device_sum

    scale = A.dtype.type(0.5 / kappa)
    e_rows, wB, wsum, wA = pairwise_gemm(A * scale, B, c * scale, aggregator)
    # gA = 1/2 sum_j W B_j, gc = 1/2 sum_j W, gB = 1/2 sum_i W A_i = kappa sum_i W Ah_i
    return kappa * float(device_sum(e_rows)), 0.5 * wB, kappa * wA, 0.5 * wsum
