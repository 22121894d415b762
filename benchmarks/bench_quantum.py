"""Density-matrix agents: one energy + gradient evaluation per backend (issue 10).

    python benchmarks/bench_quantum.py [--backends numpy numba] [--sizes 256 1024 4096] [--ds 2 4 8]
                                       [--dtypes complex128] [--terms belief|both] [--oracle] [--out DIR]
    python benchmarks/bench_quantum.py --backends cuda --sizes 1024 16384 65536 262144 --ds 4 8 \\
                                       --dtypes complex128 complex64 --pairs --torch 1024 4096 16384 65536

Self + belief terms by default (``--terms both`` adds the prior term), dense neighbours, softmin. State on
the backend's device before timing (arrays in, arrays out: the public Dataset API adds validation and,
for NumPy-backed states on a GPU, transfers). ``--oracle`` also times the naive per-pair oracle
(tests/reference/quantum.py, energy only) at N = 64 against the numba backend's energy + gradient.
``--pairs`` also times the pairwise part alone with its FLOP/s (8 d^2 N (N - 1), :func:`pair_flops`) and,
on a GPU, the cuBLAS GEMM rate as the ceiling; ``--stages`` times the per-agent forward and backward
passes (``QuantumOps``) and the pairs alone, where an evaluation's time goes (on cuda from d = 6 also the
forward pass with one thread per eigen-decomposition instead of eight, ``forward_1thr``); ``--gemm-blocks``
times the GEMM pairs (cuda, d >= 5) with logit slabs of 2^28 .. 2^31 bytes; ``--torch`` adds the PyTorch
autograd baseline (benchmarks/torch_quantum_baseline.py). Medians of repeated calls after one
warm-up (which compiles). Writes DIR/quantum_bench.jsonl and .txt.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import numpy as np

import vfesim
from vfesim.backends import get

ROOT = Path(__file__).resolve().parents[1]


def _sync(backend) -> None:
    if backend.on_device and backend.array_module() is not np:
        backend.array_module().cuda.Device().synchronize()


def timeit(fn, sync, *, min_reps=3, max_reps=20, target_s=1.0) -> tuple[float, int]:
    fn()
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < target_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


# (lambda_self, lambda_belief, lambda_prior, lambda_obs) of the passes timed alone: config(d, "belief")
WEIGHTS = (1.0, 1.0, 0.0, 0.0)


def config(d: int, terms: str) -> vfesim.QuantumConfig:
    return vfesim.QuantumConfig(d=d, lambda_prior=1.0 if terms == "both" else 0.0)


def bench(backend_name: str, N: int, d: int, dtype: str, terms: str) -> dict:
    be = get(backend_name)
    cfg = config(d, terms)
    st = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    arrays = be.to_device({k: st[k].values for k in st.data_vars})
    t, reps = timeit(lambda: be.energy_and_gradient(arrays, cfg), lambda: _sync(be))
    return dict(kind="eval", backend=backend_name, N=N, d=d, dtype=dtype, terms=terms, t_s=t, reps=reps)


def pair_flops(N: int, d: int) -> float:
    """Floating-point operations of the dense streaming pairs per evaluation: per ordered pair a D-term dot
    product and a D-term accumulation in each of the two passes (receiver pass with the row statistics,
    sender pass; D = d^2; 2 flops per multiply-add): 8 D N (N - 1). (Three passes before: 10 D N (N - 1).)"""
    return 8.0 * d * d * N * (N - 1)


def bench_pairs(backend_name: str, N: int, d: int, dtype: str) -> dict:
    """The pairwise part alone (the backend's dense pair function on the belief features)."""
    from vfesim.quantum.energy import NUMPY_OPS

    be = get(backend_name)
    cfg = config(d, "belief")
    st = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    arrays = be.to_device({k: st[k].values for k in st.data_vars})
    ops = be.agent_ops.get("quantum", NUMPY_OPS)
    A, B, c = ops.forward(arrays, WEIGHTS).features["belief_align"]
    t, reps = timeit(lambda: be.pairwise_dense(A, B, c, 1.0, "softmin"), lambda: _sync(be))
    return dict(kind="pairs", backend=backend_name, N=N, d=d, dtype=dtype, terms="belief", t_s=t, reps=reps,
                tflops=pair_flops(N, d) / t / 1e12)  # fmt: skip


def bench_stages(backend_name: str, N: int, d: int, dtype: str) -> list[dict]:
    """The backend's per-agent passes (QuantumOps.forward, .backward) alone, and the pairs: where the time
    of an evaluation goes."""
    from vfesim.quantum.energy import NUMPY_OPS

    be = get(backend_name)
    cfg = config(d, "belief")
    st = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    a = be.to_device({k: st[k].values for k in st.data_vars})
    ops = be.agent_ops.get("quantum", NUMPY_OPS)
    fw = ops.forward(a, WEIGHTS)
    A, B, c = fw.features["belief_align"]
    cot = {"belief_align": be.pairwise_dense(A, B, c, 1.0, "softmin")[1:]}
    calls = {
        "forward": lambda: ops.forward(a, WEIGHTS),
        "pairs": lambda: be.pairwise_dense(A, B, c, 1.0, "softmin"),
        "backward": lambda: ops.backward(a, fw, WEIGHTS, cot),
    }
    serial = _serial_eigh_ops(backend_name, d)
    if serial is not None:  # the same forward pass with one thread per eigen-decomposition
        calls["forward_1thr"] = lambda: serial.forward(a, WEIGHTS)
    rows = []
    for name, fn in calls.items():
        t, reps = timeit(fn, lambda: _sync(be))
        row = dict(kind="stage", backend=backend_name, N=N, d=d, dtype=dtype, stage=name, t_s=t, reps=reps)
        rows.append(row)
    return rows


def bench_gemm_blocks(N: int, d: int, dtype: str) -> list[dict]:
    """The cuda backend's GEMM pairs (feature width d^2 above the streaming kernels') with logit slabs of
    2^28 .. 2^31 bytes (vfesim.pairwise.gemm.GEMM_BLOCK_BYTES; the default restored after)."""
    from vfesim.backends import cuda_backend as cb
    from vfesim.pairwise import gemm

    be = get("cuda")
    cfg = config(d, "belief")
    st = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    arrays = be.to_device({k: st[k].values for k in st.data_vars})
    A, B, c = be.agent_ops["quantum"].forward(arrays, WEIGHTS).features["belief_align"]
    assert A.shape[1] > cb.STREAM_MAX_D, "--gemm-blocks: d^2 must exceed the streaming kernels' width"
    rows, default = [], gemm.GEMM_BLOCK_BYTES
    try:
        for log2 in (28, 29, 30, 31):
            gemm.GEMM_BLOCK_BYTES = 1 << log2
            t, reps = timeit(lambda: be.pairwise_dense(A, B, c, 1.0, "softmin"), lambda: _sync(be))
            block = gemm.block_rows(N, A.dtype, be.array_module())
            rows.append(
                dict(kind="gemm_block", N=N, d=d, dtype=dtype, slab_bytes=1 << log2, rows=block, t_s=t)
            )
    finally:
        gemm.GEMM_BLOCK_BYTES = default
    return rows


def _serial_eigh_ops(backend_name: str, d: int):
    """On the cuda backend from d = COOP_MIN_D, its per-agent kernels with the forward pass's
    eigen-decompositions inside ``energy_prep`` (one thread each) instead of the cooperative ``eigh``
    launch: the comparison of ``--stages`` (stage ``forward_1thr``); None elsewhere."""
    if backend_name != "cuda":
        return None
    from vfesim_kernels.cuda.eigh import COOP_MIN_D

    from vfesim.backends import cuda_backend as cb
    from vfesim.quantum.kernel_ops import kernel_ops

    if not COOP_MIN_D <= d <= cb.QUANTUM_KERNEL_MAX_D:
        return None
    return kernel_ops(cb.array_module, cb._quantum_launch, agent_minor=True)


def gemm_ceiling(dtype: str, n: int = 8192) -> dict:
    """Measured GEMM rate of CuPy (cuBLAS) for the real dtype of ``dtype``: the ceiling of the table."""
    import cupy

    real = np.finfo(np.dtype(dtype)).dtype
    a = cupy.random.default_rng(0).standard_normal((n, n), dtype=real)
    t, _ = timeit(lambda: a @ a, lambda: cupy.cuda.Device().synchronize())
    return dict(kind="gemm", dtype=real.name, n=n, t_s=t, tflops=2.0 * n**3 / t / 1e12)


def oracle_speedup(d: int = 4, N: int = 64) -> dict:
    path = ROOT / "tests" / "reference" / "quantum.py"
    spec = importlib.util.spec_from_file_location("vfesim_quantum_oracle", path)
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)
    cfg = config(d, "belief")
    st = vfesim.random_state(cfg, n_agents=N, seed=0)
    t_o, _ = timeit(lambda: oracle.reference_energy(st, cfg), lambda: None, min_reps=1, max_reps=3)
    be = get("numba")
    arrays = be.to_device({k: st[k].values for k in st.data_vars})
    t_n, _ = timeit(lambda: be.energy_and_gradient(arrays, cfg), lambda: None)
    return dict(kind="oracle", N=N, d=d, oracle_s=t_o, numba_s=t_n, speedup=t_o / t_n)


def table(rows: list[dict]) -> str:
    lines = [f"# {platform.node()}: one energy + gradient, dense softmin, state on the backend's device"]
    lines.append(f"{'backend':>8} {'terms':>6} {'d':>3} {'dtype':>10} {'N':>8} {'time ms':>10} {'reps':>5}")
    for r in rows:
        if r["kind"] in ("eval", "pairs"):
            what = r["backend"] if r["kind"] == "eval" else "pairs"
            flops = f"  {r['tflops']:.1f} TFLOP/s" if "tflops" in r else ""
            lines.append(
                f"{what:>8} {r['terms']:>6} {r['d']:3d} {r['dtype']:>10} {r['N']:8d} "
                f"{r['t_s'] * 1e3:10.2f} {r['reps']:5d}{flops}"
            )
        elif r["kind"] == "stage":
            t = r["t_s"] * 1e3
            lines.append(f"   stage {r['stage']:>14} {r['d']:3d} {r['dtype']:>10} {r['N']:8d} {t:10.3f}")
        elif r["kind"] == "gemm_block":
            lines.append(
                f"GEMM pairs {r['d']:3d} {r['dtype']:>10} {r['N']:8d}: slab 2^"
                f"{r['slab_bytes'].bit_length() - 1} bytes ({r['rows']} rows) {r['t_s'] * 1e3:8.3f} ms"
            )
        elif r["kind"] == "gemm":
            lines.append(f"GEMM ceiling ({r['dtype']}, {r['n']}^3): {r['tflops']:.1f} TFLOP/s")
        elif r["kind"] == "torch":
            t = f"{r['t_s'] * 1e3:10.2f}" if "t_s" in r else f"    failed: {r['error']}"
            lines.append(f"{'torch':>8} {'belief':>6} {r['d']:3d} {r['dtype']:>10} {r['N']:8d} {t}")
        else:
            lines.append(
                f"oracle (energy only) at N = {r['N']}, d = {r['d']}: {r['oracle_s']:.3f} s; numba energy + "
                f"gradient {r['numba_s'] * 1e3:.2f} ms: {r['speedup']:.0f}x"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="*", default=["numpy", "numba"])
    ap.add_argument("--sizes", type=int, nargs="*", default=[256, 1024, 4096])
    ap.add_argument("--ds", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--dtypes", nargs="*", default=["complex128"])
    ap.add_argument("--terms", choices=["belief", "both"], default="belief")
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--pairs", action="store_true", help="also time the pairwise part alone (FLOP/s)")
    ap.add_argument("--stages", action="store_true", help="time the per-agent passes, the pairs")
    ap.add_argument("--torch", type=int, nargs="*", help="PyTorch autograd baseline at these N (GPU)")
    ap.add_argument("--gemm-blocks", action="store_true", help="cuda, d >= 5: the GEMM pairs' slab sizes")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for backend in args.backends:
        for dtype in args.dtypes:
            for d in args.ds:
                for N in args.sizes:
                    rows.append(bench(backend, N, d, dtype, args.terms))
                    print(json.dumps(rows[-1]), flush=True)
                    if args.pairs:
                        rows.append(bench_pairs(backend, N, d, dtype))
                        print(json.dumps(rows[-1]), flush=True)
                    if args.stages:
                        rows += bench_stages(backend, N, d, dtype)
                    if args.gemm_blocks and backend == "cuda":
                        rows += bench_gemm_blocks(N, d, dtype)
            if args.pairs and backend == "cuda":
                rows.append(gemm_ceiling(dtype))
    if args.torch:
        from torch_quantum_baseline import bench as torch_bench

        for dtype in args.dtypes:
            for d in args.ds:
                for N in args.torch:
                    rows.append(torch_bench(N, d, dtype))
                    print(json.dumps(rows[-1]), flush=True)
    if args.oracle:
        rows.append(oracle_speedup())
        print(json.dumps(rows[-1]), flush=True)
    with open(out / "quantum_bench.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    text = table(rows)
    (out / "quantum_bench.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
