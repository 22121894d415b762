"""Where one large-K energy+gradient evaluation spends its time (issue 5, K = 21 target).

Whole call: cupyx.profiler.benchmark (host time per call vs device time between events). Stages: each
function of the cuda backend named in STAGES is wrapped with device synchronisations and timed on the host
(the sum over stages exceeds the plain call time by the added syncs; it locates the time, it is no
substitute for the plain median).

    python benchmarks/profile_large_k.py [--n 1024 2048] [--k 21] [--dtypes float32 float64]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import cupy as cp
from bench_gpu import config, device_state  # noqa: E402
from cupyx.profiler import benchmark
from vfesim_kernels import cuda as kc  # noqa: E402

from vfesim.backends import cuda_backend as cb  # noqa: E402

# Backend functions timed as stages when present (old path: batched CuPy; new path: block kernels).
STAGES = [
    "self_kl", "self_kl_vjp", "expm_so3", "agent_features", "pairwise_gemm", "features_vjp",
    "phi_grad_from_R", "_large_k_agents", "_large_k_pairs", "_large_k_adjoint", "_collect",
]  # fmt: skip


def stage_times(x, cfg, reps=10):
    acc: dict[str, float] = defaultdict(float)
    orig = {}

    def wrap(name, fn):
        def inner(*a, **kw):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            r = fn(*a, **kw)
            cp.cuda.Device().synchronize()
            acc[name] += time.perf_counter() - t0
            return r

        return inner

    for name in STAGES:
        if hasattr(cb, name):
            orig[name] = getattr(cb, name)
            setattr(cb, name, wrap(name, orig[name]))
    try:
        cb.energy_and_gradient(x, cfg)
        acc.clear()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            cb.energy_and_gradient(x, cfg)
        cp.cuda.Device().synchronize()
        total = (time.perf_counter() - t0) / reps
    finally:
        for name, fn in orig.items():
            setattr(cb, name, fn)
    return total, {k: v / reps for k, v in acc.items()}


def kernel_times(cfg, N, K, dtype, max_registers=None):
    """Device time of each block-kernel launch on the workspace of the last evaluation (block mode)."""
    ws = next(reversed(cb._workspaces.values()))
    if cb._mode(K, ws.dtype) != "block":
        return {}
    d = ws.dev
    bk = kc.make_block_kernels(K, dtype, max_registers)
    nt, jit, one = kc.block_threads(K), ws.dtype.type(cfg.jitter), ws.dtype.type(1.0)
    launches = {
        "prep": lambda: bk["prep"][N, nt](d["phi"], d["G"], max(cfg.irreps), d["mu"], d["sigma"], jit, 0, 1,
                                          d["R"], d["lam"], d["P"], d["nu"], d["ld"]),
        "self_kl": lambda: bk["self_kl"][N, nt](d["mu"], d["sigma"], jit, one, d["e_self"], d["g_mu"],
                                                d["g_sigma"]),
        "features": lambda: bk["features"][(N, 1), nt](
            d["lam"], d["P"], d["nu"], d["nubar"], d["ld"], d["feat_scale"], 0, d["A"], d["B"], d["c"],
            d["nuc"], d["Pnu"]),
        "adjoint": lambda: bk["adjoint"][N, nt](d["phi"], d["G"], d["R"], d["mu"], d["sigma"], jit, d["nuc"],
                                                d["P"], d["Pnu"], d["gAr"], d["gBs"], d["lam_w"], d["kappa"],
                                                0, 1, d["g_mu"], d["g_sigma"], d["g_phi"]),
    }  # fmt: skip
    out = {}
    for name, fn in launches.items():
        r = benchmark(fn, (), n_repeat=20, n_warmup=2)
        regs = ",".join(str(getattr(c, "regs_per_thread", "?")) for c in bk[name].overloads.values())
        out[name] = f"{float(r.gpu_times.mean()) * 1e3:.3f} ({regs} regs)"
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="*", default=[1024, 2048])
    ap.add_argument("--k", type=int, default=21)
    ap.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    ap.add_argument("--threads", type=int, nargs="*", default=[kc.BLOCK_THREADS_MAX], help="thread caps")
    ap.add_argument("--max-registers", type=int, nargs="*", default=[0], help="0: no limit")
    args = ap.parse_args(argv)
    for dtype in args.dtypes:
        for N in args.n:
            cfg = config(args.k, "belief")
            x = device_state(N, args.k, dtype)
            for cap in args.threads:
                for regs in args.max_registers:
                    kc.gaussian.BLOCK_THREADS_MAX = cap
                    cb.BLOCK_MAX_REGISTERS = regs or None
                    cb.clear_cache()
                    r = benchmark(cb.energy_and_gradient, (x, cfg), n_repeat=30, n_warmup=3)
                    cpu = float(r.cpu_times.mean()) * 1e3
                    gpu = float(r.gpu_times.mean()) * 1e3
                    head = f"K={args.k} {dtype} N={N} threads<={cap} maxregs={regs}"
                    print(f"{head}: whole call host {cpu:.2f} ms, device {gpu:.2f} ms", flush=True)
                    kt = kernel_times(cfg, N, args.k, dtype, regs or None)
                    parts = ", ".join(f"{k} {v}" for k, v in kt.items())
                    print(f"   block kernels (device ms): {parts}", flush=True)
            kc.gaussian.BLOCK_THREADS_MAX = args.threads[0]
            cb.BLOCK_MAX_REGISTERS = args.max_registers[0] or None
            total, st = stage_times(x, cfg)
            parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(st.items(), key=lambda kv: -kv[1]))
            print(f"   synced stages (total {total * 1e3:.2f} ms): {parts}", flush=True)


if __name__ == "__main__":
    main()
