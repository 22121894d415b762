"""GPU benchmark of the cuda backend (SPEC §6, issue 5), with a PyTorch autograd baseline.

Measures one energy+gradient evaluation (CuPy arrays in and out) at N in SIZES, K in {3, 21}, float32 and
float64; peak device memory; the model's FLOP rate against ceilings measured in the same run (CuPy GEMM,
device-to-device copy); and the ratio to benchmarks/torch_baseline.py, which materialises the
(N, N, K, K) transports, at every size until it runs out of memory.

    python benchmarks/bench_gpu.py [--quick] [--tune] [--out DIR]
    python benchmarks/bench_gpu.py --steps [--step-sizes N ...] [--dtypes ...] [--out DIR]
    python benchmarks/bench_gpu.py --api [--out DIR]
    python benchmarks/bench_gpu.py --cold-start [--out DIR]
    python benchmarks/bench_gpu.py --tune-registers [--out DIR]
    python benchmarks/bench_gpu.py --tune-splits [--out DIR]

Writes DIR/gpu_bench.jsonl (one record per measurement) and DIR/gpu_bench.txt (the table, also printed).
``--steps`` instead times full integrator steps (``step_sweep``): DIR/gpu_steps.jsonl and gpu_steps.txt.
``--api`` compares the public ``energy_and_gradient`` (NumPy- and CuPy-backed Datasets, with and without
validation) with the kernels alone (``api_sweep``): DIR/gpu_api.jsonl and gpu_api.txt.
``--cold-start`` times fresh processes to their first energy and first integrator step, with empty and
with warm kernel caches (``cold_start``): DIR/gpu_cold.jsonl and gpu_cold.txt.
``--tune-registers`` times the dense pair kernels alone (``cb.BACKEND.pairwise_dense``) under register caps
(``tune_registers``), to set ``vfesim_kernels.cuda.pairwise.DENSE_REGISTERS``: DIR/gpu_registers.jsonl
and gpu_registers.txt.
``--tune-splits`` times each dense pair pass alone (``stats`` + ``merge``, ``grads``) for numbers of slices of
the other side (``tune_splits``): a grid of few blocks per SM leaves a last partial wave; DIR/gpu_splits.jsonl
and gpu_splits.txt.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np
from vfesim_kernels import cuda as kc
from vfesim_kernels.cuda import pairwise as kp

import vfesim
from vfesim.backends import cuda_backend as cb
from vfesim.gaussian.features import feature_dim
from vfesim.groups import generators

SIZES = [1024, 4096, 16384, 65536, 262144, 1048576]
# Extra sizes that locate where the baseline runs out of memory more precisely.
PROBE_SIZES = [2048, 8192]
KS = [3, 21]
DTYPES = ["float32", "float64"]


def log(*a):
    print(*a, flush=True)


def timeit(fn, *, min_reps=3, max_reps=20, target_s=1.0):
    """Median wall time (s) of fn() (which synchronises), after one warm-up call; and the reps done."""
    fn()
    times = []
    t_start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < target_s):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def ceilings() -> dict:
    """Measured device ceilings: GEMM FLOP/s (fp32 without TF32, fp64) and copy bytes/s (read + write)."""
    out = {}
    n = 8192
    for dt in ("float32", "float64"):
        a = cp.random.standard_normal((n, n), dtype=dt)
        b = cp.random.standard_normal((n, n), dtype=dt)
        t, _ = timeit(lambda a=a, b=b: a @ b, min_reps=5, target_s=0.5)
        out[f"gemm_{dt}_flops"] = 2 * n**3 / t
        del a, b
    x = cp.random.standard_normal(1 << 28, dtype="float32")  # 1 GiB
    y = cp.empty_like(x)
    t, _ = timeit(lambda x=x, y=y: y.__setitem__(Ellipsis, x), min_reps=10, target_s=0.5)
    out["copy_bytes_per_s"] = 2 * x.nbytes / t
    del x, y
    cp.get_default_memory_pool().free_all_blocks()
    return out


def device_state(N: int, K: int, dtype: str, seed: int = 0) -> dict:
    """Random valid state generated on the device: sigma = L L^T + I/2 (SPD), |phi| <= 1."""
    rs = cp.random.RandomState(seed)
    out = {}
    for m, s in (("mu_q", "sigma_q"), ("mu_p", "sigma_p")):
        out[m] = rs.standard_normal((N, K))
        L = 0.4 * rs.standard_normal((N, K, K))
        out[s] = L @ L.transpose(0, 2, 1) + 0.5 * cp.eye(K)
    v = rs.standard_normal((N, 3))
    out["phi"] = v / cp.linalg.norm(v, axis=1, keepdims=True) * rs.uniform(0, 1, (N, 1)) ** (1 / 3)
    return {k: cp.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}


def pair_flops(N: int, K: int, nterms: int) -> float:
    """Model FLOPs of the dense pairwise kernels: per ordered pair and term, two feature dots (2D each),
    two weighted row accumulations (2D each) and ~14 scalar operations (logits, two exps, online
    log-sum-exp, weights). (Before the receiver sums joined the statistics sweep: three dots, ~21.)"""
    D = feature_dim(K)
    return float(N) * (N - 1) * nterms * (8 * D + 14)


def config(K: int, terms: str, aggregator: str = "expected") -> vfesim.ModelConfig:
    return vfesim.ModelConfig(K=K, lambda_prior=1.0 if terms == "both" else 0.0, aggregator=aggregator)


def bench_cuda(N, K, dtype, cfg):
    pool = cp.get_default_memory_pool()
    cb.clear_cache()
    pool.free_all_blocks()
    x = device_state(N, K, dtype)
    base = pool.total_bytes()
    t, reps = timeit(lambda: cb.energy_and_gradient(x, cfg), min_reps=3 if N <= 65536 else 2, max_reps=20)
    peak = pool.total_bytes()
    return t, reps, peak, peak - base


def bench_torch(N, K, dtype, cfg):
    import torch
    import torch_baseline as tb

    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()
    x = {k: torch.as_tensor(v, device="cuda") for k, v in device_state(N, K, dtype).items()}
    G = torch.as_tensor(generators(cfg.irreps), dtype=x["mu_q"].dtype, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    result = None
    try:
        t, reps = timeit(lambda x=x, G=G: tb.energy_and_gradient(x, G, cfg), max_reps=5, target_s=2.0)
        result = (t, reps, torch.cuda.max_memory_allocated())
    except torch.cuda.OutOfMemoryError:
        pass
    # Give the caching allocator's memory back before CuPy needs it (also after an OOM).
    del x, G
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return result


def check_baseline(K: int, dtype: str = "float64", N: int = 256) -> dict:
    """Relative differences between the torch baseline and the cuda backend on one state (same function?)."""
    import torch
    import torch_baseline as tb

    cfg = config(K, "both")
    x = device_state(N, K, dtype, seed=3)
    terms, g = cb.energy_and_gradient(x, cfg)
    xt = {k: torch.as_tensor(v, device="cuda") for k, v in x.items()}
    G = torch.as_tensor(generators(cfg.irreps), dtype=xt["mu_q"].dtype, device="cuda")
    F, gt = tb.energy_and_gradient(xt, G, cfg)
    out = {"energy": abs(F - terms["total"]) / abs(terms["total"])}
    for k in g:
        a = cp.asnumpy(g[k])
        b = gt[k].cpu().numpy()
        out[k] = float(np.abs(a - b).max() / np.abs(b).max())
    return out


def tune(out_rows):
    """Threads per block x owners per thread of the SIMT dense kernels at N = 65536, K = 3 (float64 too:
    its tensor-core kernels are set aside for the sweep). The register caps of DENSE_REGISTERS stay on
    (numba's disk cache does not key on a cap: the table's kernels must keep theirs)."""
    N, K = 65536, 3
    keep = (kp.PAIR_THREADS, dict(kc.PAIR_OPTS), kp.DENSE_MMA, dict(kc.PAIR_OPTS_NARROW))
    kp.DENSE_MMA = frozenset()
    kc.PAIR_OPTS_NARROW.clear()  # (the sweep's owners at every width)
    try:
        for dtype in DTYPES:
            for threads in (128, 256):
                for opt in (1, 2, 3, 4):
                    kp.PAIR_THREADS, kc.PAIR_OPTS[dtype] = threads, opt  # (read where the kernels are made)
                    t, reps, _, _ = bench_cuda(N, K, dtype, config(K, "belief"))
                    row = dict(kind="tune", N=N, K=K, dtype=dtype, threads=threads, opt=opt, t_s=t, reps=reps)
                    out_rows.append(row)
                    log(f"tune {dtype} threads={threads} opt={opt}: {t * 1e3:.2f} ms")
    finally:
        kp.PAIR_THREADS, kp.DENSE_MMA = keep[0], keep[2]
        kc.PAIR_OPTS.update(keep[1])
        kc.PAIR_OPTS_NARROW.update(keep[3])


# Register caps (stats, grads) of the dense pair kernels tried by --tune-registers: each a resident block
# of 128 threads more per SM than the compiler's choice where that fits (65 536 registers per SM).
REGISTER_CAPS = [
    (None, None), (None, 128), (96, 128), (80, 128), (None, 96), (96, 96), (168, 168), (128, 128),
    (200, 200), (184, 168),
]  # fmt: skip
# (D, dtype): Gaussian K = 3 (D = 10) and density-matrix d = 4 (D = 16)
# (float64 dense pairs run on the tensor-core kernels, kernels/cuda/pair_mma.py, which take no caps)
REGISTER_CASES = [(10, "float32"), (16, "float32")]


def tune_registers(out: Path, N: int = 65536) -> None:
    """The dense pair kernels alone (stats, merge, grads of ``cb.BACKEND.pairwise_dense``) at N agents on
    random feature rows, for each case of REGISTER_CASES under each (stats, grads) cap of REGISTER_CAPS,
    in interleaved rounds (median of 5 rounds of 3 calls). Capped variants compile without the disk
    cache."""
    make = kc.make_dense_kernels
    rows = []
    try:
        for D, dtype in REGISTER_CASES:
            rng = np.random.default_rng(0)
            A = cp.asarray(rng.standard_normal((N, D)), dtype)
            B = cp.asarray(0.3 * rng.standard_normal((N, D)), dtype)
            c = cp.asarray(rng.standard_normal(N), dtype)
            times: dict = {caps: [] for caps in REGISTER_CAPS}
            for _ in range(5):
                for caps in REGISTER_CAPS:
                    kc.make_dense_kernels = lambda *a, caps=caps: make(*a, registers=caps)
                    cb.BACKEND.pairwise_dense(A, B, c, 1.0, "softmin")
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    for _ in range(3):
                        cb.BACKEND.pairwise_dense(A, B, c, 1.0, "softmin")
                    cp.cuda.Device().synchronize()
                    times[caps].append((time.perf_counter() - t0) / 3)
            base = float(np.median(times[(None, None)]))
            for caps, ts in times.items():
                t = float(np.median(ts))
                rows.append(dict(kind="registers", N=N, D=D, dtype=dtype, stats=caps[0], grads=caps[1], t_s=t,
                                 vs_free=t / base))  # fmt: skip
                log(f"D={D} {dtype} caps={caps}: {t * 1e3:.2f} ms ({t / base:.3f} of free)")
    finally:
        kc.make_dense_kernels = make
    table = "\n".join(
        f"{r['D']:3d} {r['dtype']:8s} stats={str(r['stats']):>5s} grads={str(r['grads']):>5s} "
        f"{r['t_s'] * 1e3:9.2f} ms  {r['vs_free']:.3f}"
        for r in rows
    )
    write_rows(out, "gpu_registers", rows, f"# dense pair kernels alone, N = {N}, softmin\n{table}\n")


# (owners, others, D, dtype, slices tried): the receiver pass of a chunk of a 2^20 population on 4 GPUs,
# and of a whole population of 2^16 and 2^20; the sender pass likewise (owners = senders).
SPLIT_CASES = [
    (262144, 1 << 20, 10, "float32", (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)),
    (1 << 20, 1 << 20, 10, "float32", (1, 2, 3, 4, 6)),
    (65536, 65536, 10, "float32", (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)),
    (65536, 65536, 10, "float64", (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)),
    (65536, 65536, 16, "float32", (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)),
    # N = 16 384: 64 owner blocks; the default 22 slices make 2.7 waves (float32) / 5.3 (float64, D = 16)
    (16384, 16384, 16, "float32", (1, 2, 4, 6, 8, 12, 16, 22, 32)),
    (16384, 16384, 16, "float64", (1, 2, 4, 6, 8, 12, 16, 22, 32)),
    (16384, 16384, 10, "float32", (1, 2, 4, 6, 8, 12, 16, 22, 32)),
]


def tune_splits(out: Path) -> None:
    """Each dense pass alone on random feature rows for every case of SPLIT_CASES and number of slices
    (median of 3 rounds, slices interleaved within a round), with the occupancy (resident blocks per SM)
    of its kernel and the default choice of slices (``dense_splits``)."""
    rows = []
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    for NO, NX, D, dtype, tries in SPLIT_CASES:
        rng = np.random.default_rng(0)
        Ah = cp.asarray(0.1 * rng.standard_normal((1, max(NO, NX), D)), dtype)
        Bb = cp.asarray(0.1 * rng.standard_normal((1, max(NO, NX), D)), dtype)
        ch = cp.asarray(0.1 * rng.standard_normal((1, max(NO, NX))), dtype)
        ks = kc.make_dense_kernels(D, dtype, "softmin")
        nt = ks["threads"]
        one = np.dtype(dtype).type(1.0)
        _, _, _, m, inv_s, abar = cb._dense_stats(Ah[:, :NX], Bb[:, :NX], ch[:, :NX], one, 0, "softmin")
        # stats: receivers 0 .. NO - 1 against NX senders; grads: senders 0 .. NO - 1 from NX receivers
        stats_args = (Ah[:, :NO], Bb[:, :NX], ch[:, :NO], one, 0, "softmin")
        grads_args = (Ah[:, :NX], Bb[:, :NO], ch[:, :NX], one, m, inv_s, abar, 0, "softmin")
        calls = {
            "stats": lambda S, a=stats_args: cb._dense_stats(*a, splits=S),
            "grads": lambda S, a=grads_args: cb._dense_grads(*a, splits=S),
        }
        for role, call in calls.items():
            row_bytes = (D + (role == "stats")) * np.dtype(dtype).itemsize
            default = kc.dense_splits(NO, NX, row_bytes, ks["per_block"], nt)[0]
            times: dict = {S: [] for S in tries}
            for S in tries:
                call(S)
            for _ in range(3):
                for S in tries:
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    call(S)
                    cp.cuda.Device().synchronize()
                    times[S].append(time.perf_counter() - t0)
            kern = next(iter(ks[role].overloads.values()))
            per_sm = kern.max_cooperative_grid_blocks(nt) // sms
            blocks = -(-NO // ks["per_block"])
            best = min(tries, key=lambda S: np.median(times[S]))
            for S in tries:
                t = float(np.median(times[S]))
                rows.append(dict(kind="splits", role=role, owners=NO, others=NX, D=D, dtype=dtype, S=S, t_s=t,
                                 blocks=blocks * S, per_sm=per_sm, sms=sms, default=default))  # fmt: skip
                mark = (" (default)" if S == default else "") + (" (best)" if S == best else "")
                where = f"{blocks * S} blocks, {per_sm}/SM{mark}"
                log(f"{role} {NO}x{NX} D={D} {dtype} S={S}: {t * 1e3:.2f} ms, {where}")
    table = "\n".join(
        f"{r['role']:5s} {r['owners']:8d} {r['others']:8d} {r['D']:3d} {r['dtype']:8s} S={r['S']:3d} "
        f"{r['t_s'] * 1e3:9.2f} ms  blocks {r['blocks']:6d} ({r['per_sm']}/SM x {r['sms']})"
        f"{'  default' if r['S'] == r['default'] else ''}"
        for r in rows
    )
    write_rows(out, "gpu_splits", rows, f"# dense passes alone, softmin\n{table}\n")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="sizes up to 65536, K=21 up to 4096")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--max-eval-s", type=float, default=30.0, help="skip sizes predicted slower than this")
    ap.add_argument("--out", default=".")
    ap.add_argument("--ks", type=int, nargs="*", default=KS)
    ap.add_argument("--dtypes", nargs="*", default=DTYPES)
    ap.add_argument("--min-n", type=int, default=0, help="measure only sizes >= this")
    ap.add_argument("--aggregator", choices=["expected", "softmin"], default="expected",
                    help="the energy table's aggregator (default: the config's default)")  # fmt: skip
    ap.add_argument("--steps", action="store_true", help="only the full-step sweep (step_sweep below)")
    ap.add_argument("--step-sizes", type=int, nargs="*", default=STEP_SIZES)
    ap.add_argument("--api", action="store_true", help="only the public-API overhead sweep (api_sweep)")
    ap.add_argument("--cold-start", action="store_true", help="only the fresh-process sweep (cold_start)")
    ap.add_argument("--tune-registers", action="store_true", help="only the register-cap sweep of the pairs")
    ap.add_argument("--tune-splits", action="store_true", help="only the slice-count sweep of the pairs")
    ap.add_argument("--cold-child", nargs=4, metavar=("N", "K", "DTYPE", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cold_child:
        n, k, dtype, launched = args.cold_child
        return cold_child(int(n), int(k), dtype, float(launched))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.steps:
        return step_sweep(out, args.step_sizes, args.dtypes)
    if args.api:
        return api_sweep(out)
    if args.cold_start:
        return cold_start(out)
    if args.tune_registers:
        return tune_registers(out)
    if args.tune_splits:
        return tune_splits(out)
    rows: list[dict] = []
    dev = cp.cuda.runtime.getDeviceProperties(0)
    info = dict(kind="device", name=dev["name"].decode(), sms=dev["multiProcessorCount"],
                mem_gib=dev["totalGlobalMem"] / 2**30, threads=kc.PAIR_THREADS, opt=kc.PAIR_OPTS,
                opt_narrow=kc.PAIR_OPTS_NARROW, aggregator=args.aggregator)  # fmt: skip
    log(info)
    ceil = ceilings()
    rows += [info, dict(kind="ceilings", **ceil)]
    log({k: f"{v:.3e}" for k, v in ceil.items()})
    if not args.no_baseline:
        for K in args.ks:
            chk = check_baseline(K)
            rows.append(dict(kind="baseline_check", K=K, **chk))
            log(f"baseline vs cuda (K={K}, float64, N=256), max relative differences:", chk)
    if args.tune:
        tune(rows)

    sizes = sorted(SIZES + PROBE_SIZES)
    sizes = [n for n in sizes if n <= 65536] if args.quick else sizes
    for K in args.ks:
        for dtype in args.dtypes:
            last = None
            torch_fits = not args.no_baseline
            for N in sizes:
                if (K == 21 and args.quick and N > 4096) or N < args.min_n:
                    continue
                if last is not None and last[1] * (N / last[0]) ** 2 > args.max_eval_s:
                    rows.append(
                        dict(kind="skipped", N=N, K=K, dtype=dtype, predicted_s=last[1] * (N / last[0]) ** 2)
                    )
                    log(f"skip N={N} K={K} {dtype}: predicted {last[1] * (N / last[0]) ** 2:.0f} s")
                    continue
                cfg = config(K, "belief", args.aggregator)
                t, reps, peak, used = bench_cuda(N, K, dtype, cfg)
                last = (N, t)
                fl = pair_flops(N, K, 1)
                row = dict(kind="cuda", N=N, K=K, dtype=dtype, terms="belief", t_s=t, reps=reps,
                           peak_bytes=peak, flops_model=fl, flops_per_s=fl / t,
                           frac_gemm=fl / t / ceil[f"gemm_{dtype}_flops"])  # fmt: skip
                if torch_fits:
                    r = bench_torch(N, K, dtype, cfg)
                    if r is None:
                        torch_fits = False
                        row["torch"] = "OOM"
                    else:
                        row |= dict(torch_t_s=r[0], torch_reps=r[1], torch_peak_bytes=r[2], speedup=r[0] / t)
                rows.append(row)
                log(json.dumps(row))
                if N == 65536 and K == 3:
                    t2, reps2, peak2, _ = bench_cuda(N, K, dtype, config(K, "both", args.aggregator))
                    fl2 = pair_flops(N, K, 2)
                    row2 = dict(kind="cuda", N=N, K=K, dtype=dtype, terms="both", t_s=t2, reps=reps2,
                                peak_bytes=peak2, flops_model=fl2, flops_per_s=fl2 / t2,
                                frac_gemm=fl2 / t2 / ceil[f"gemm_{dtype}_flops"])  # fmt: skip
                    rows.append(row2)
                    log(json.dumps(row2))
    write_rows(out, "gpu_bench", rows, format_table(rows))


def format_table(rows) -> str:
    lines = []
    for r in rows:
        if r["kind"] == "device" and "aggregator" in r:
            lines.append(f"aggregator: {r['aggregator']}")
        if r["kind"] == "ceilings":
            lines.append(
                f"ceilings: GEMM fp32 {r['gemm_float32_flops'] / 1e12:.1f} TFLOP/s, fp64 "
                f"{r['gemm_float64_flops'] / 1e12:.1f} TFLOP/s, copy {r['copy_bytes_per_s'] / 1e12:.2f} TB/s"
            )
    hdr = f"{'K':>3} {'dtype':>7} {'terms':>6} {'N':>8} {'time ms':>10} {'TFLOP/s':>8} {'%GEMM':>6} "
    hdr += f"{'peak MiB':>9} {'torch ms':>10} {'torch MiB':>10} {'speedup':>8}"
    lines.append(hdr)
    for r in rows:
        if r["kind"] == "cuda":
            tt = r.get("torch_t_s")
            tcol = f"{tt * 1e3:10.2f}" if tt else f"{r.get('torch', '-'):>10}"
            tmem = f"{r['torch_peak_bytes'] / 2**20:10.0f}" if tt else f"{'-':>10}"
            sp = f"{r['speedup']:8.1f}" if tt else f"{'-':>8}"
            lines.append(
                f"{r['K']:3d} {r['dtype']:>7} {r['terms']:>6} {r['N']:8d} {r['t_s'] * 1e3:10.2f} "
                f"{r['flops_per_s'] / 1e12:8.2f} {100 * r['frac_gemm']:6.1f} {r['peak_bytes'] / 2**20:9.0f} "
                f"{tcol} {tmem} {sp}"
            )
        elif r["kind"] == "skipped":
            pred = r["predicted_s"]
            lines.append(f"{r['K']:3d} {r['dtype']:>7} {'':>6} {r['N']:8d}  skipped (predicted {pred:.0f} s)")
        elif r["kind"] == "tune":
            lines.append(f"tune {r['dtype']} threads={r['threads']} opt={r['opt']}: {r['t_s'] * 1e3:.2f} ms")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Full integrator steps (--steps): integrators.make_integrator(..., backend="cuda") with the state on
# the device; one step = the fused update kernels + the energy evaluations of the scheme + the guard.
# ------------------------------------------------------------------------------------------------
STEP_SIZES = [4096, 65536, 262144]
STEP_METHODS = {"gradient_flow": 0.01, "verlet": 0.005, "pefrl": 0.005}  # method -> dt


def bench_step(N: int, K: int, dtype: str, method: str) -> dict:
    """Median wall time of one integrator step (ends with the energy terms on the host), the energy
    evaluation alone at the same state, and the rest (update kernels, guard, allocations)."""
    from vfesim.integrators import make_integrator

    pool = cp.get_default_memory_pool()
    cb.clear_cache()
    pool.free_all_blocks()
    cfg = config(K, "belief")
    state = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    calls = [0]

    def energy(arrays):  # the model energy (what backend="cuda" uses), counted
        calls[0] += 1
        return cb.energy_and_gradient(arrays, cfg)

    integ = make_integrator(method, cfg, STEP_METHODS[method], backend="cuda", seed=1, energy=energy)
    carry = [integ.init(state)]

    def step():
        carry[0] = integ.step(carry[0])

    t, reps = timeit(step, min_reps=3, max_reps=20, target_s=1.0)
    c = carry[0]
    assert all(isinstance(c.state[k].data, cp.ndarray) for k in c.state.data_vars)
    x = {k: c.state[k].data for k in c.state.data_vars}
    t_e, _ = timeit(lambda: cb.energy_and_gradient(x, cfg), min_reps=3, max_reps=20, target_s=0.5)
    ev = (calls[0] - 1) // c.step  # energy evaluations per step (init made one)
    return dict(kind="step", N=N, K=K, dtype=dtype, method=method, dt=STEP_METHODS[method], t_s=t,
                reps=reps, steps_done=c.step, energy_t_s=t_e, evals=ev, other_t_s=t - ev * t_e,
                F=c.terms["total"], peak_bytes=pool.total_bytes())  # fmt: skip


def step_sweep(out: Path, sizes, dtypes, K: int = 3) -> None:
    """Step time per scheme at each N, dtype; writes out/gpu_steps.jsonl and out/gpu_steps.txt."""
    dev = cp.cuda.runtime.getDeviceProperties(0)
    rows = [dict(kind="device", name=dev["name"].decode(), sms=dev["multiProcessorCount"])]
    log(rows[0])
    for dtype in dtypes:
        for N in sizes:
            for method in STEP_METHODS:
                row = bench_step(N, K, dtype, method)
                rows.append(row)
                log(json.dumps(row))
    write_rows(out, "gpu_steps", rows, format_steps(rows))


def format_steps(rows) -> str:
    lines = [
        f"# {rows[0]['name']}: one integrator step, backend cuda, K = 3, state on the device; 'energy' is",
        "# one energy+gradient evaluation at the same state, 'other' = step - evals x energy (update",
        "# kernels, guard, allocations, launches). Median wall times.",
        f"{'dtype':>7} {'method':>13} {'N':>7} {'step ms':>10} {'evals':>5} {'energy ms':>10} "
        f"{'other ms':>9}",
    ]
    for r in rows:
        if r["kind"] == "step":
            lines.append(
                f"{r['dtype']:>7} {r['method']:>13} {r['N']:7d} {r['t_s'] * 1e3:10.2f} {r['evals']:5d} "
                f"{r['energy_t_s'] * 1e3:10.2f} {r['other_t_s'] * 1e3:9.2f}"
            )
    return "\n".join(lines) + "\n"


def write_rows(out: Path, name: str, rows: list[dict], table: str) -> None:
    with open(out / f"{name}.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    (out / f"{name}.txt").write_text(table)
    print(table)


# ------------------------------------------------------------------------------------------------
# Public-API overhead (--api): vfesim.energy_and_gradient(Dataset, backend="cuda") against the kernels
# alone on arrays already on the device (energy_and_gradient_arrays).
# ------------------------------------------------------------------------------------------------
API_CASES = [(3, 65536, "float32"), (3, 65536, "float64"), (21, 16384, "float32")]


def api_row(K: int, N: int, dtype: str, dev: str) -> dict:
    from vfesim.backends import energy_and_gradient_arrays

    cb.clear_cache()
    cp.get_default_memory_pool().free_all_blocks()
    cfg = config(K, "belief")
    host = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    on_dev = host.copy(data={k: cp.asarray(host[k].values) for k in host.data_vars})
    arrays = {k: on_dev[k].data for k in on_dev.data_vars}
    eg = vfesim.energy_and_gradient
    fns = {
        "numpy": lambda: eg(host, cfg, backend="cuda"),
        "numpy_novalidate": lambda: eg(host, cfg, backend="cuda", validate=False),
        "cupy": lambda: eg(on_dev, cfg, backend="cuda"),
        "cupy_novalidate": lambda: eg(on_dev, cfg, backend="cuda", validate=False),
        "kernels": lambda: energy_and_gradient_arrays(arrays, cfg, backend="cuda"),
        "transfers": lambda: cb.to_host(cb.to_device({k: host[k].values for k in host.data_vars})),
    }
    row = dict(kind="api", device=dev, K=K, N=N, dtype=dtype)
    row.update(interleaved(fns, rounds=API_ROUNDS))
    return row


API_ROUNDS = 40


def interleaved(fns: dict, rounds: int) -> dict:
    """Median wall time (s) of each fn() (synchronised) over ``rounds`` rounds that call every fn once, in
    an order rotated each round: the ratios between them do not drift with the machine's state."""
    names = list(fns)
    times = {k: [] for k in names}
    for k in names:
        fns[k]()  # warm-up
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fns[k]()
            cp.cuda.Device().synchronize()
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def api_sweep(out: Path) -> None:
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = []
    for K, N, dtype in API_CASES:
        rows.append(api_row(K, N, dtype, dev))
        log(json.dumps(rows[-1]))
    write_rows(out, "gpu_api", rows, format_api(rows))


def format_api(rows) -> str:
    cols = ["numpy", "numpy_novalidate", "cupy", "cupy_novalidate", "kernels", "transfers"]
    lines = [
        f"# {rows[0]['device']}: one vfesim.energy_and_gradient(Dataset, backend='cuda'), median ms of "
        f"{API_ROUNDS} interleaved rounds.",
        "# numpy/cupy: where the Dataset's arrays live; _novalidate: validate=False; kernels:",
        "# energy_and_gradient_arrays on device arrays; transfers: the state host->device and the",
        "# gradients device->host.",
        f"{'K':>3} {'N':>7} {'dtype':>7} "
        + " ".join(f"{c:>16}" for c in cols)
        + f" {'numpy/kern':>10} {'cupy/kern':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['K']:3d} {r['N']:7d} {r['dtype']:>7} "
            + " ".join(f"{r[c] * 1e3:16.2f}" for c in cols)
            + f" {r['numpy'] / (r['kernels'] + r['transfers']):10.2f} {r['cupy'] / r['kernels']:9.2f}"
        )
    lines.append("# numpy/kern = numpy / (kernels + transfers); cupy/kern = cupy / kernels.")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# Cold start (--cold-start): fresh processes, each timing import, the first and second energy call
# and the first and second integrator step; first with empty kernel caches (numba and CuPy), then warm.
# ------------------------------------------------------------------------------------------------
COLD_CASE = (65536, 3, "float32")


def cold_child(N: int, K: int, dtype: str, launched: float) -> None:
    """One fresh process: phase times and where kernel compilation went, as one JSON line on stdout.
    ``launched``: the parent's time.time() at the launch (the import phase includes interpreter start)."""
    from numba.cuda.dispatcher import CUDADispatcher

    from vfesim.integrators import make_integrator

    t = {"import": time.time() - launched}
    t0 = time.perf_counter() - t["import"]
    compiles: dict[str, float] = {}
    compile_kernel = CUDADispatcher.compile

    def timed_compile(self, sig):  # compile or load from the disk cache (in-memory hits are not counted)
        t1 = time.perf_counter()
        r = compile_kernel(self, sig)
        dt = time.perf_counter() - t1
        if dt > 1e-3:
            qn = self.py_func.__qualname__.replace(".<locals>", "")
            compiles[qn] = compiles.get(qn, 0.0) + dt
        return r

    CUDADispatcher.compile = timed_compile
    from vfesim_kernels.cuda import ahead

    compile_ahead, reports = ahead.compile_ahead, []

    def reported_ahead(jobs, n_workers=None, **kw):  # the backend's compile ahead (parallel processes)
        reports.append(compile_ahead(jobs, n_workers, **kw))
        return reports[-1]

    ahead.compile_ahead = reported_ahead
    cfg = config(K, "belief")
    t1 = time.perf_counter()
    state = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    t["state"] = time.perf_counter() - t1

    def phase(name, fn):
        t1 = time.perf_counter()
        r = fn()
        cp.cuda.Device().synchronize()
        t[name] = time.perf_counter() - t1
        return r

    phase("energy_1", lambda: vfesim.energy_and_gradient(state, cfg, backend="cuda"))
    phase("energy_2", lambda: vfesim.energy_and_gradient(state, cfg, backend="cuda"))
    integ = phase("integrator", lambda: make_integrator("verlet", cfg, 0.005, backend="cuda", seed=1))
    carry = phase("init", lambda: integ.init(state))
    carry = phase("step_1", lambda: integ.step(carry))
    phase("step_2", lambda: integ.step(carry))
    t["to_first_step"] = time.perf_counter() - t0  # from the launch, imports included
    print(json.dumps(dict(times=t, compiles=compiles, ahead=reports)), flush=True)


# A child without the dask extra (as a ``vfesim[gpu]`` install): with dask installed, xarray imports
# dask.array when it builds its first Variable (its duck-array check), about a second on the GPU hosts.
_WITHOUT_DASK = (
    "import runpy, sys\n"
    "sys.modules['dask'] = sys.modules['distributed'] = None  # import dask: ModuleNotFoundError\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def cold_start(out: Path) -> None:
    N, K, dtype = COLD_CASE
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NUMBA_CACHE_DIR=f"{tmp}/numba", CUPY_CACHE_DIR=f"{tmp}/cupy")
        for run in ("first ever", "second", "third", "no dask", "no dask 2"):
            t0 = time.perf_counter()
            prelude = [sys.executable, "-c", _WITHOUT_DASK] if run.startswith("no dask") else [sys.executable]
            cmd = [*prelude, __file__, "--cold-child", str(N), str(K), dtype, repr(time.time())]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            wall = time.perf_counter() - t0
            rec = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append(dict(kind="cold", device=dev, run=run, N=N, K=K, dtype=dtype, wall_s=wall, **rec))
            log(json.dumps(rows[-1]))
    write_rows(out, "gpu_cold", rows, format_cold(rows))


def format_cold(rows) -> str:
    r0 = rows[0]
    phases = ["import", "state", "energy_1", "energy_2", "integrator", "init", "step_1", "step_2"]
    phases.append("to_first_step")
    lines = [
        f"# {r0['device']}: fresh processes, N = {r0['N']}, K = {r0['K']}, {r0['dtype']}, backend cuda,",
        "# verlet;",
        *(
            ["# PYTHONDONTWRITEBYTECODE is set: without .pyc files (python -m compileall) every process also"]
            + ["# compiles Python sources (about a second on the GPU hosts), which a pip install does not."]
            if sys.flags.dont_write_bytecode
            else []
        ),
        "# seconds per phase (energy_1: first vfesim.energy_and_gradient; step_1: first integrator step),",
        "# after_import = to_first_step - import; wall = the whole process; compile = numba kernel",
        "# compilation in the process or loading from the disk cache (the kernels compiled ahead in other",
        "# processes are listed below).",
        "# 'no dask': warm caches, dask hidden (a `vfesim[gpu]` install without the dask extra: with dask",
        "# installed, xarray imports dask.array at its first Variable).",
        f"{'run':>10} "
        + " ".join(f"{p:>13}" for p in phases)
        + f" {'after_import':>12} {'wall':>7} {'compile':>8}",
    ]
    for r in rows:
        tt = r["times"]
        lines.append(
            f"{r['run']:>10} "
            + " ".join(f"{tt.get(p, float('nan')):13.3f}" for p in phases)  # rows from before a phase
            + f" {tt.get('to_first_step', float('nan')) - tt['import']:12.3f}"
            + f" {r['wall_s']:7.2f} {sum(r['compiles'].values()):8.2f}"
        )
    for r in rows:
        for a in r.get("ahead", []):
            if a["compiled"]:
                ready = a.get("ready") or []
                took = f"; workers took a first kernel {ready[0]:.2f}-{ready[-1]:.2f} s in" if ready else ""
                lines.append(
                    f"# compiled ahead in '{r['run']}': {a['compiled']} kernels in {a['workers']} processes"
                    f" ({a['loaded']} loaded from the cache), {a['seconds']:.2f} s{took}"
                )
                by_process: dict = {}
                for who, kernel, start, end in a.get("groups", []):
                    by_process.setdefault(who, []).append(f"{kernel} {start:.1f}-{end:.1f}")
                for who, groups in sorted(by_process.items()):
                    name = "this process" if who == 0 else f"worker {who}"
                    lines.append(f"#   {name}: {', '.join(groups)}")
                if "load_s" in a:
                    lines.append(f"#   then binding them here: {a['load_s']:.2f} s")
    for r in rows:
        if r["compiles"]:
            top = sorted(r["compiles"].items(), key=lambda kv: -kv[1])
            lines.append(f"# compiled in '{r['run']}': " + ", ".join(f"{k} {v:.2f} s" for k, v in top))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
