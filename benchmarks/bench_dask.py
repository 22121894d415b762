"""The dask backend against the numba backend on the CPU (issue 11): one energy + gradient evaluation.

    python benchmarks/bench_dask.py [--N 16384] [--K 3] [--ring H] [--reps 5] [--workers 2] [--chunks ...]
                                    [--out DIR] [--name FILE]

    python benchmarks/bench_dask.py --gpu [--gpus 1 2] [--big [--big-only] [--big-n N]] [--reps 3] [--out DIR]

Dense neighbours, softmin, float64. Rows: the numba backend in this process (Numba's threads, one per
core); the dask backend on the threaded scheduler; on a LocalCluster of ``--workers`` processes with one
thread each, from an in-memory state (the state is sent with the graph) and from a state persisted
chunked on the workers (``state.chunk(agent=n)``, gradients stay there). Public API
(``vfesim.energy_and_gradient``, validation off: it is the same for every backend). Medians of
``--reps`` calls after one warm-up (which compiles and starts the workers' imports). ``--ring H``: sparse
ring neighbours (2H per agent) instead of dense. Writes DIR/dask_cpu.txt (or ``--name``).

``--gpu``: inner="cuda" tasks, one worker per GPU (``dask_cuda.LocalCUDACluster``; without dask-cuda one
GPU runs on a LocalCluster of one worker process). Energy + gradient, K = 3, float32, dense softmin:
strong scaling at N = 1 048 576 on each GPU count of ``--gpus`` (efficiency t1 / (g t_g)), weak scaling
at 262 144 agents per GPU; ``--big`` adds a full ``vfesim.simulate`` run of 10^7 agents with 32 sparse
(ring) neighbours each, 10 gradient-flow steps writing Zarr, on the largest GPU count (``--big-only``:
only that run). Each row: the
median wall time, and from Dask's task stream where the time went: compute (task execution, summed over
workers and divided by their number), transfer (worker-to-worker), and the rest of the wall time
(scheduler, client round trips, idle). Writes DIR/dask_gpu.txt.
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
    ap.add_argument("--ring", type=int, default=None, help="sparse ring neighbours, this half width")
    ap.add_argument("--name", default="dask_cpu.txt", help="results file name in --out")
    ap.add_argument("--gpu", action="store_true", help="the GPU benchmark (inner='cuda')")
    ap.add_argument("--gpus", type=int, nargs="*", default=[1, 2], help="GPU counts (--gpu)")
    ap.add_argument("--big", action="store_true", help="--gpu: also the big sparse run (--big-n agents)")
    ap.add_argument("--big-n", type=int, default=10**7, help="agents of the --big run")
    ap.add_argument("--profile", action="store_true", help="--big: write the client's cProfile to DIR")
    ap.add_argument("--big-checkpoint-every", type=int, default=5, help="--big: steps between checkpoints")
    ap.add_argument("--big-only", action="store_true", help="--big: only the big run, on max(--gpus)")
    args = ap.parse_args()
    if args.gpu:
        gpu_main(args)
        return

    from distributed import Client, LocalCluster

    nb = "dense" if args.ring is None else vfesim.SparseNeighbours.ring(args.N, args.ring)
    cfg = vfesim.ModelConfig(K=args.K, aggregator="softmin", neighbours=nb)
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
        f"dask backend vs numba, energy + gradient, N = {args.N}, K = {args.K}, float64, "
        + ("dense" if args.ring is None else f"ring of {2 * args.ring} sparse neighbours")
        + " softmin",
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
    (out / args.name).write_text(text + "\n")


def gpu_cluster(n_gpus: int):
    """One worker process per GPU: dask_cuda.LocalCUDACluster, or (one GPU, no dask-cuda) a LocalCluster
    with one single-threaded worker process."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        if n_gpus != 1:
            msg = f"--gpus {n_gpus}: several GPUs need dask-cuda (pip install 'vfesim[multigpu]')"
            raise SystemExit(msg) from None
        from distributed import LocalCluster

        return LocalCluster(n_workers=1, threads_per_worker=1, processes=True, silence_logs=logging.ERROR)
    devices = ",".join(str(i) for i in range(n_gpus))
    return LocalCUDACluster(CUDA_VISIBLE_DEVICES=devices, threads_per_worker=1, silence_logs=logging.ERROR)


def stream_split(stream: list[dict], n_workers: int, wall: float) -> tuple[float, float, float]:
    """(compute, transfer, other) seconds of one timed call from Dask's task stream: each action's
    durations summed and divided by the workers; other = wall - compute - transfer (scheduler, client
    round trips, idle workers)."""
    acc = {"compute": 0.0, "transfer": 0.0}
    for task in stream:
        for ss in task.get("startstops", ()):
            if ss["action"] in acc:
                acc[ss["action"]] += ss["stop"] - ss["start"]
    compute, transfer = acc["compute"] / n_workers, acc["transfer"] / n_workers
    return compute, transfer, max(0.0, wall - compute - transfer)


def task_split(stream: list[dict], n_workers: int, top: int = 8) -> str:
    """Where the compute went, by task function: 'name seconds' for the ``top`` largest (summed over
    workers and divided by their number), largest first. Tasks that Dask fused into a Zarr store
    (``...-stack-store-map``, named after their first part, e.g. ``concatenate-from-value``) are counted
    as ``zarr-store``."""
    from dask.utils import key_split

    acc: dict[str, float] = {}
    for task in stream:
        key = task["key"][0] if isinstance(task["key"], tuple) else task["key"]
        name = "zarr-store" if "store-map" in str(key) else key_split(task["key"])
        for ss in task.get("startstops", ()):
            if ss["action"] == "compute":
                acc[name] = acc.get(name, 0.0) + (ss["stop"] - ss["start"]) / n_workers
    items = sorted(acc.items(), key=lambda kv: -kv[1])[:top]
    per_worker: dict[str, float] = {}
    for task in stream:
        busy = sum(ss["stop"] - ss["start"] for ss in task.get("startstops", ()) if ss["action"] == "compute")
        per_worker[task.get("worker", "?")] = per_worker.get(task.get("worker", "?"), 0.0) + busy
    workers = " ".join(f"{v:.2f}" for _, v in sorted(per_worker.items()))
    return ", ".join(f"{name} {sec:.2f}" for name, sec in items) + f"; busy per worker (s): {workers}"


def timed_eg(client, state, cfg, reps: int) -> tuple[float, tuple[float, float, float]]:
    """Median wall time of energy + gradient of a state persisted on the workers (inner="cuda"), and the
    task-stream split of the median call."""
    from distributed import get_task_stream

    n_workers = len(client.scheduler_info()["workers"])
    eg = vfesim.energy_and_gradient
    with client.as_current():
        eg(state, cfg, backend="dask", inner="cuda", validate=False)  # warm-up: compiles the kernels
        runs = []
        for _ in range(reps):
            with get_task_stream(client) as ts:
                t0 = time.perf_counter()
                eg(state, cfg, backend="dask", inner="cuda", validate=False)
                wall = time.perf_counter() - t0
            runs.append((wall, stream_split(ts.data, n_workers, wall), task_split(ts.data, n_workers)))
    runs.sort(key=lambda r: r[0])
    wall, split, tasks = runs[len(runs) // 2]
    print(f"  N = {state.sizes['agent']}, {n_workers} workers, {wall:.3f} s; compute by task: {tasks}")
    return wall, split


def gpu_main(args) -> None:
    from distributed import Client

    cfg = vfesim.ModelConfig(K=3, aggregator="softmin")
    rows, strong = [], {}
    for g in [max(args.gpus)] if args.big_only else args.gpus:
        with gpu_cluster(g) as cluster, Client(cluster) as client:
            client.wait_for_workers(g)
            for kind, n in () if args.big_only else (("strong", 1 << 20), ("weak", 262_144 * g)):
                state = vfesim.random_state(cfg, n, seed=0, dtype="float32")
                lazy = client.persist(state.chunk(agent=-(-n // g)))  # one receiver chunk per GPU
                wall, split = timed_eg(client, lazy, cfg, args.reps)
                if kind == "strong":
                    strong[g] = wall
                rows.append((kind, g, n, wall, *split))
                del lazy
            if args.big and g == max(args.gpus):
                rows.append(("big run", g, args.big_n, *big_run(client, g, args)))
    t1 = strong.get(1)
    lines = [
        "dask backend inner='cuda', energy + gradient, K = 3, float32, dense softmin (big run: 32 sparse",
        f"neighbours, 10 gradient-flow steps writing Zarr); medians of {args.reps}; GPU: {gpu_name()}",
        "",
        f"{'case':<8} {'GPUs':>4} {'N':>9} {'wall (s)':>9} {'compute':>8} {'transfer':>8} {'other':>7} "
        f"{'eff.':>6}",
    ]
    for kind, g, n, wall, comp, tr, other in rows:
        eff = f"{t1 / (g * wall):.0%}" if kind == "strong" and t1 else "-"
        lines.append(f"{kind:<8} {g:>4} {n:>9} {wall:>9.3f} {comp:>8.3f} {tr:>8.3f} {other:>7.3f} {eff:>6}")
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dask_gpu.txt").write_text(text + "\n")


def big_run(client, g: int, args) -> tuple[float, float, float, float]:
    """``vfesim.simulate`` of ``--big-n`` agents, ring of 32 neighbours, float32, 10 gradient-flow steps
    saving every 5 and checkpointing every ``--big-checkpoint-every`` (5), on the cluster: (wall,
    compute, transfer, other). ``--profile``: the client's cProfile in DIR/big_run.prof (where the
    client's time goes: building the population, the graph, waiting)."""
    import contextlib
    import cProfile
    import faulthandler
    import signal
    import tempfile

    from distributed import get_task_stream

    scenario = {
        "model": {"K": 3, "aggregator": "softmin", "lambda_prior": 0.5},
        "population": {"n_agents": args.big_n, "seed": 0, "neighbours": "ring", "half_width": 16},
        "integrator": {"method": "gradient_flow", "dt": 0.01},
        "run": {"n_steps": 10, "save_every": 5, "checkpoint_every": args.big_checkpoint_every,
                "backend": "dask", "dtype": "float32", "chunks": -(-args.big_n // (4 * g))},
    }  # fmt: skip
    marks = _Marks()  # when the store was created and when the run finished (vfesim's log records)
    vlog = logging.getLogger("vfesim")
    level = vlog.level
    vlog.addHandler(marks)
    vlog.setLevel(min(level or logging.INFO, logging.INFO))
    with tempfile.TemporaryDirectory(dir=args.out) as tmp, client.as_current():
        with get_task_stream(client) as ts:
            if args.profile:  # time-stamped progress, and every thread's stack on SIGUSR1
                faulthandler.register(signal.SIGUSR1, all_threads=True)
                logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
                logging.getLogger("vfesim").setLevel(logging.INFO)
            prof = cProfile.Profile() if args.profile else contextlib.nullcontext()
            t0 = time.perf_counter()
            with prof:
                # --profile: progress as time-stamped log lines (one per step)
                vfesim.simulate(
                    scenario, out=Path(tmp) / "big.zarr", progress=None if args.profile else False
                )
            wall = time.perf_counter() - t0
    vlog.removeHandler(marks)
    vlog.setLevel(level)
    n_workers = len(client.scheduler_info()["workers"])
    print(f"big run, N = {args.big_n}: compute by task (s per worker): {task_split(ts.data, n_workers, 12)}")
    if {"run", "done"} <= marks.at.keys():
        setup, steps = marks.at["run"] - t0, marks.at["done"] - marks.at["run"]
        print(
            f"big run, N = {args.big_n}: setup (population, graphs, first evaluation, store) {setup:.1f} s; "
            f"steps (10, with their frames and checkpoints) {steps:.1f} s"
        )
    if args.profile:
        prof.dump_stats(Path(args.out) / "big_run.prof")
    return (wall, *stream_split(ts.data, n_workers, wall))


class _Marks(logging.Handler):
    """Times (``time.perf_counter``) of vfesim's "run ..." (store created) and "done ..." log records."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.at: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        for key in ("run", "done"):
            if str(record.msg).startswith(key + " ") or str(record.msg).startswith(key + ":"):
                self.at[key] = time.perf_counter()


def gpu_name() -> str:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 - a label only
        return "unknown"


if __name__ == "__main__":
    main()
