"""Throughput of the float64 ``mma.sync`` shapes on this GPU (H100: m8n8k4 is Ampere's shape, m16n8k4/k8/k16
are sm_90's), with each shape's fragment layout checked against NumPy first (the layouts that
kernels/cuda/warp.py relies on). Per shape and block size: 8 SMs' worth of blocks per SM, each warp running
8 independent accumulators for 2000 iterations; TFLOP/s from the median of 5 launches.

    python benchmarks/bench_dmma.py
"""

from __future__ import annotations

import time

import numpy as np
from llvmlite import ir
from numba import cuda, float64, types
from numba.cuda.extending import intrinsic

SHAPES = [  # (shape, A registers, B registers, C registers, M, N, K)
    ("m8n8k4", 1, 1, 2, 8, 8, 4),
    ("m16n8k4", 2, 1, 4, 16, 8, 4),
    ("m16n8k8", 4, 2, 4, 16, 8, 8),
    ("m16n8k16", 8, 4, 4, 16, 8, 16),
]


def _mma(shape: str, na: int, nb: int, nc: int):
    """An intrinsic mma(a, b, c) over tuples of float64 registers (inline PTX)."""
    regs = lambda s, n: "{" + ", ".join(f"${s + i}" for i in range(n)) + "}"  # noqa: E731
    asm = (
        f"mma.sync.aligned.{shape}.row.col.f64.f64.f64.f64 {regs(0, nc)}, {regs(nc, na)}, "
        f"{regs(nc + na, nb)}, {regs(nc + na + nb, nc)};"
    )
    constraints = ",".join(["=d"] * nc + ["d"] * (na + nb + nc))

    @intrinsic
    def mma(typingctx, a, b, c):
        tup = types.UniTuple
        sig = tup(float64, nc)(tup(float64, na), tup(float64, nb), tup(float64, nc))

        def codegen(context, builder, sig, args):
            d = ir.DoubleType()
            counts = zip(args, (na, nb, nc), strict=True)
            vals = [builder.extract_value(x, i) for x, n in counts for i in range(n)]
            fnty = ir.FunctionType(ir.LiteralStructType([d] * nc), [d] * (na + nb + nc))
            r = builder.call(ir.InlineAsm(fnty, asm, constraints, side_effect=True), vals)
            parts = [builder.extract_value(r, i) for i in range(nc)]
            return context.make_tuple(builder, sig.return_type, parts)

        return sig, codegen

    return mma


def _tuple(items) -> str:
    return "(" + ", ".join(items) + ",)"


def _kernels(shape, na, nb, nc, M):
    """check(A, B, C) (one warp: C = A B by the documented layouts) and bench(out, iterations)."""
    g_row = (lambda i: f"g + 8 * ({i} % 2)") if M == 16 else (lambda i: "g")
    a_col = (lambda i: f"q + 4 * ({i} // 2)") if M == 16 else (lambda i: f"q + 4 * {i}")
    src = f"""
def check(A, B, C):
    g = cuda.threadIdx.x // 4
    q = cuda.threadIdx.x % 4
    a = {_tuple(f"A[{g_row(i)}, {a_col(i)}]" for i in range(na))}
    b = {_tuple(f"B[q + 4 * {i}, g]" for i in range(nb))}
    d = mma(a, b, {_tuple(["0.0"] * nc)})
    for i in range({nc}):
        C[g + 8 * (i // 2), 2 * q + i % 2] = d[i]

def bench(out, iterations):
    x = out[0]
    a = {_tuple(["x"] * na)}
    b = {_tuple(["x"] * nb)}
    z = {_tuple(["0.0"] * nc)}
    c0 = z; c1 = z; c2 = z; c3 = z; c4 = z; c5 = z; c6 = z; c7 = z
    for _ in range(iterations):
        c0 = mma(a, b, c0); c1 = mma(a, b, c1); c2 = mma(a, b, c2); c3 = mma(a, b, c3)
        c4 = mma(a, b, c4); c5 = mma(a, b, c5); c6 = mma(a, b, c6); c7 = mma(a, b, c7)
    s = 0.0
    for v in c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7:
        s += v
    out[1 + cuda.grid(1)] = s
"""
    ns = {"cuda": cuda, "mma": _mma(shape, na, nb, nc)}
    exec(src, ns)
    return cuda.jit(ns["check"]), cuda.jit(ns["bench"])


def main() -> None:
    dev = cuda.get_current_device()
    sms = dev.MULTIPROCESSOR_COUNT
    print(f"# {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, {sms} SMs")
    print(f"{'shape':10s} {'layout err':>10s} {'threads':>8s} {'TFLOP/s':>8s}")
    iterations = 2000
    for shape, na, nb, nc, M, N, K in SHAPES:
        check, bench = _kernels(shape, na, nb, nc, M)
        rng = np.random.default_rng(0)
        A, B = rng.normal(size=(M, K)), rng.normal(size=(K, N))
        C = cuda.to_device(np.zeros((M, N)))
        check[1, 32](cuda.to_device(A), cuda.to_device(B), C)
        err = float(np.abs(C.copy_to_host() - A @ B).max())
        for threads in (128, 256):
            blocks = 8 * sms
            out = cuda.to_device(np.full(1 + blocks * threads, 1e-3))
            bench[blocks, threads](out, 10)
            cuda.synchronize()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                bench[blocks, threads](out, iterations)
                cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            flops = blocks * threads // 32 * iterations * 8 * 2 * M * N * K
            print(f"{shape:10s} {err:10.1e} {threads:8d} {flops / np.median(ts) / 1e12:8.1f}", flush=True)


if __name__ == "__main__":
    main()
