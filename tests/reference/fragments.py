"""The float64 mma.sync fragment layouts of PTX (m16n8k8 and m16n8k4, ``.row.col``) written out as index
maps, and one-warp kernels that load A, B, C by them, call :mod:`vfesim_kernels.cuda.warp`'s product and
store D by them: D must equal A B + C (NumPy) if the primitive keeps the documented layout. With g = lane
// 4 and q = lane % 4: a_i = A[g + 8 (i % 2), q + 4 (i // 2)], b_i = B[q + 4 i, g], c_i = D_i = C[g + 8 (i
// 2), 2 q + i % 2]."""

from __future__ import annotations

import functools

import numpy as np
from vfesim_kernels.cuda import warp
from vfesim_kernels.cuda.core import cuda  # (a module global: the simulator swaps it during a launch)


def products(K: int, seed: int = 0):
    """Random A (16, K), B (K, 8), C (16, 8) and the expected A B + C."""
    rng = np.random.default_rng(seed)
    A, B, C = rng.normal(size=(16, K)), rng.normal(size=(K, 8)), rng.normal(size=(16, 8))
    return A, B, C, A @ B + C


@functools.cache
def kernels():
    """{8: kernel, 4: kernel}, each launched [1, 32](A, B, C, out), and "quads" [1, 32](v, out)."""

    def store(out, g, q, d0, d1, d2, d3):
        out[g, 2 * q] = d0
        out[g, 2 * q + 1] = d1
        out[g + 8, 2 * q] = d2
        out[g + 8, 2 * q + 1] = d3

    store = cuda.jit(device=True)(store)

    def k8(A, B, C, out):
        g = cuda.threadIdx.x // 4
        q = cuda.threadIdx.x % 4
        d0, d1, d2, d3 = warp.dmma_k8(
            A[g, q], A[g + 8, q], A[g, q + 4], A[g + 8, q + 4], B[q, g], B[q + 4, g],
            C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1],
        )  # fmt: skip
        store(out, g, q, d0, d1, d2, d3)

    def k4(A, B, C, out):
        g = cuda.threadIdx.x // 4
        q = cuda.threadIdx.x % 4
        d0, d1, d2, d3 = warp.dmma_k4(
            A[g, q], A[g + 8, q], B[q, g], C[g, 2 * q], C[g, 2 * q + 1], C[g + 8, 2 * q], C[g + 8, 2 * q + 1]
        )
        store(out, g, q, d0, d1, d2, d3)

    def quads(v, out):
        """out[0, l] = quad_sum(v[l]), out[1, l] = quad_max(v[l])."""
        t = cuda.threadIdx.x
        out[0, t] = warp.quad_sum(v[t])
        out[1, t] = warp.quad_max(v[t])

    return {8: cuda.jit(k8), 4: cuda.jit(k4), "quads": cuda.jit(quads)}
