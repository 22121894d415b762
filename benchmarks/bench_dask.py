"""The dask backend against the numba backend on the CPU (issue 11): one energy + gradient evaluation.

    python benchmarks/bench_dask.py [--N 16384] [--K 3] [--reps 5] [--workers 2] [--chunks ...] [--out DIR]

Dense neighbours, softmin, float64. Rows: the numba backend in this process (Numba's threads, one per
core); the dask backend on the threaded scheduler; on a LocalCluster of ``--workers`` processes with one
thread each, from an in-memory state (the state is sent with the graph) and from a state persisted
chunked on the workers (``state.chunk(agent=n)``, gradients stay there). Public API
(``vfesim.energy_and_gradient``, validation off: it is the same for every backend). Medians of
``--reps`` calls after one warm-up (which compiles and starts the workers' imports). Writes
DIR/dask_cpu.txt.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import time
from pathlib import Path

import dask
import numpy as np

import vfesim
from vfesim.backends.dask_backend import auto_chunk

ROOT = Path(__file__).resolve().parents[1]


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunks", type=int, nargs="*", default=None, help="agents per chunk (default: auto)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()

    from distributed import Client, LocalCluster

    cfg = vfesim.ModelConfig(K=args.K, aggregator="softmin")
    state = vfesim.random_state(cfg, args.N, seed=0, dtype="float64")
    arrays = {k: state[k].values for k in state.data_vars}
    auto = auto_chunk(cfg, args.N, arrays)
    chunkings = args.chunks or [auto, -(-args.N // args.workers)]
    eg = vfesim.energy_and_gradient

    rows = []
    t_numba = median_time(lambda: eg(state, cfg, backend="numba", validate=False), args.reps)
    rows.append(("numba", "-", "in process", t_numba))
    for ch in chunkings:
        with dask.config.set(scheduler="threads"):
            t = median_time(
                lambda ch=ch: eg(state, cfg, backend="dask", validate=False, chunks=ch), args.reps
            )
        rows.append(("dask threads", ch, "in memory", t))

    cluster = LocalCluster(
        n_workers=args.workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    with Client(cluster) as client:
        for ch in chunkings:
            t = median_time(
                lambda ch=ch: eg(state, cfg, backend="dask", validate=False, chunks=ch), args.reps
            )
            rows.append((f"dask LocalCluster {args.workers}x1", ch, "in memory", t))
            lazy = client.persist(state.chunk(agent=ch))

            def run(lazy=lazy):
                _, g = eg(lazy, cfg, backend="dask", validate=False)
                return g

            t = median_time(run, args.reps)
            rows.append((f"dask LocalCluster {args.workers}x1", ch, "persisted chunked", t))
    cluster.close()

    lines = [
        f"dask backend vs numba, energy + gradient, N = {args.N}, K = {args.K}, float64, dense softmin",
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; medians of {args.reps}",
        f"default chunk (auto): {auto} agents",
        "",
        f"{'backend':<26} {'chunk':>7} {'state':<18} {'time (s)':>9} {'vs numba':>9}",
    ]
    for name, ch, where, t in rows:
        lines.append(f"{name:<26} {ch!s:>7} {where:<18} {t:>9.3f} {t / t_numba:>8.2f}x")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dask_cpu.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
