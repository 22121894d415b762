"""Warp-level primitives of the tensor-core pair kernels: float64 matrix multiply-accumulates of one warp,
``dmma_k8`` / ``dmma_k4``, and the sum and maximum over the four lanes that share a row of their result,
``quad_sum`` / ``quad_max``. Every lane of a warp calls them together (they exchange values between
lanes); the caller's control flow around a call is uniform across the block.

``dmma_k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)``: D = A B + C for a 16 x 8 matrix
A, an 8 x 8 matrix B and 16 x 8 C, D (PTX ``mma.sync.aligned.m16n8k8.row.col.f64``, sm_90). With g =
lane // 4 and q = lane % 4, lane (g, q) holds

    a_i = A[g + 8 (i % 2), q + 4 (i // 2)],  b_i = B[q + 4 i, g],  c_i = C[g + 8 (i // 2), 2 q + i % 2].

``dmma_k4(a0, a1, b0, c0, c1, c2, c3)``: the same for K = 4 (``m16n8k4``; a_0, a_1 and b_0 as above).

These layouts were checked against NumPy on an H100 (benchmarks/results/gpu_dmma_h100_stop32.txt), where
both shapes run at 51-65 TFLOP/s against 30-31 for Ampere's m8n8k4. Each product is a float64 fused
multiply-add; the tensor cores' order within a row is their own but fixed: the same bits run to run.

``warp_any(flag)``: whether ``flag`` holds in any lane of the warp (the same answer in every lane: a
branch on it is uniform); in the simulator, over the block (the simulator's pair kernels run blocks of at
most a warp of threads).

``quad_sum(v)`` / ``quad_max(v)``: the sum (v_0 + v_1) + (v_2 + v_3) (resp. the maximum) over the lanes
4g .. 4g + 3, returned to each of them, by two butterfly shuffles. ``fmax(a, b)``: the larger of a and b,
ignoring a NaN (IEEE maxNum, the device's ``max``; quad_max takes it too), on either target.

Under the CUDA simulator (no warp shuffles, no PTX), the same contracts are kept through a shared-memory
scratch and one block barrier per call: every thread publishes its operands, then reads those it needs.
Those versions give the same values but not the same rounding as the tensor cores; they exist so that the
kernels' fragment bookkeeping runs in CI.
"""

from __future__ import annotations

import numpy as np
from numba import float64, types

from .core import SIMULATOR, cuda, device

__all__ = ["dmma_k8", "dmma_k4", "fmax", "quad_sum", "quad_max", "warp_any", "SIM_THREADS_MAX"]

# Threads per block the simulator's scratch holds.
SIM_THREADS_MAX = 128

if SIMULATOR:
    import threading

    _calls = threading.local()  # (the simulator runs each CUDA thread as a Python thread)

    def _publish(v0, v1, v2, v3, v4, v5):
        """Every thread's six values into a block-wide scratch, after one barrier; returns (scratch,
        slot). Two slots alternate (each thread counts its calls; all threads of a block call together),
        so the barrier of call n + 1 also orders call n's reads before call n + 2's writes to its slot."""
        sc = cuda.shared.array((2, SIM_THREADS_MAX, 6), np.float64)
        t = cuda.threadIdx.x
        n = getattr(_calls, "n", 0)
        _calls.n = n + 1
        k = n % 2
        sc[k, t, 0] = v0
        sc[k, t, 1] = v1
        sc[k, t, 2] = v2
        sc[k, t, 3] = v3
        sc[k, t, 4] = v4
        sc[k, t, 5] = v5
        cuda.syncthreads()
        return sc, k

    def _mma(sc, k, K, c0, c1, c2, c3):
        """D = A B + C from the published operands (A's registers in columns 0-3, B's in 4-5)."""
        t = cuda.threadIdx.x
        w = t - t % 32
        g = (t % 32) // 4
        q = t % 4
        d = [c0, c1, c2, c3]
        for i in range(4):
            row = g + 8 * (i // 2)
            col = 2 * q + i % 2
            for kk in range(K):
                a = sc[k, w + 4 * (row % 8) + kk % 4, (row // 8) + 2 * (kk // 4)]
                b = sc[k, w + 4 * col + kk % 4, 4 + kk // 4]
                d[i] += a * b
        return d[0], d[1], d[2], d[3]

    def _dmma_k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sc, k = _publish(a0, a1, a2, a3, b0, b1)
        return _mma(sc, k, 8, c0, c1, c2, c3)

    def _dmma_k4(a0, a1, b0, c0, c1, c2, c3):
        sc, k = _publish(a0, a1, a0, a1, b0, b0)
        return _mma(sc, k, 4, c0, c1, c2, c3)

    def _fmax(a, b):
        if a != a:
            return b
        if b != b:
            return a
        return max(a, b)

    def _quad(v, is_max):
        t = cuda.threadIdx.x
        r = t - t % 4
        sc, k = _publish(v, v, v, v, v, v)
        if is_max:
            return _fmax(_fmax(sc[k, r, 0], sc[k, r + 1, 0]), _fmax(sc[k, r + 2, 0], sc[k, r + 3, 0]))
        return (sc[k, r, 0] + sc[k, r + 1, 0]) + (sc[k, r + 2, 0] + sc[k, r + 3, 0])

    _publish = device(_publish)
    _mma = device(_mma)
    _quad = device(_quad)

    def _quad_sum(v):
        return _quad(v, False)

    def _warp_any(flag):
        return cuda.syncthreads_or(flag)  # (the simulator's blocks are at most a warp of threads)

    def _quad_max(v):
        return _quad(v, True)

else:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    def _mma_codegen(shape: str, na: int, nb: int):
        """Code generator of one float64 ``mma.sync`` of ``shape`` with na A, nb B and four C registers
        (inline PTX: NVVM has no intrinsic for the sm_90 shapes)."""
        regs = lambda s, n: "{" + ", ".join(f"${s + i}" for i in range(n)) + "}"  # noqa: E731
        asm = (
            f"mma.sync.aligned.{shape}.row.col.f64.f64.f64.f64 "
            f"{regs(0, 4)}, {regs(4, na)}, {regs(4 + na, nb)}, {regs(4 + na + nb, 4)};"
        )
        n_in = na + nb + 4
        constraints = ",".join(["=d"] * 4 + ["d"] * n_in)

        def codegen(context, builder, sig, args):
            d = ir.DoubleType()
            fnty = ir.FunctionType(ir.LiteralStructType([d] * 4), [d] * n_in)
            r = builder.call(ir.InlineAsm(fnty, asm, constraints, side_effect=True), args)
            parts = [builder.extract_value(r, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, parts)

        return types.UniTuple(float64, 4)(*([float64] * n_in)), codegen

    _K8 = _mma_codegen("m16n8k8", 4, 2)
    _K4 = _mma_codegen("m16n8k4", 2, 1)

    @intrinsic
    def _k8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _K8

    @intrinsic
    def _k4(typingctx, a0, a1, b0, c0, c1, c2, c3):
        return _K4

    def _dmma_k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    def _dmma_k4(a0, a1, b0, c0, c1, c2, c3):
        return _k4(a0, a1, b0, c0, c1, c2, c3)

    def _quad_sum(v):
        v = v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 1)
        return v + cuda.shfl_xor_sync(0xFFFFFFFF, v, 2)

    def _quad_max(v):
        v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 1))
        return max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, 2))

    def _warp_any(flag):
        return cuda.any_sync(0xFFFFFFFF, flag)

    def _fmax(a, b):
        return max(a, b)  # (numba's float max on the device: libdevice fmax, which ignores a NaN)


dmma_k8 = device(_dmma_k8)
dmma_k4 = device(_dmma_k4)
quad_sum = device(_quad_sum)
quad_max = device(_quad_max)
fmax = device(_fmax)
warp_any = device(_warp_any)
