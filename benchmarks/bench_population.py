"""Drawing a random Gaussian population (``vfesim.random_state``) on several threads.

    python benchmarks/bench_population.py [--N 16000000] [--K 3] [--threads 1 4 16] [--dtype float32]
                                          [--reps 1] [--out DIR]

A population is drawn in blocks of 2^20 agents, each from its own stream, on ``threads`` threads; the
result does not depend on their number. Prints, per thread count, the median wall time of ``--reps``
draws, the speed-up over the first count of ``--threads`` (one by default) and the thread-seconds spent
in the covariances (``_random_spd``, summed over threads: equal to the one-thread time when the threads
do not slow each other down). Writes
DIR/population.txt.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import numpy as np

import vfesim
import vfesim.gaussian.state as gs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=16_000_000)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    cfg = vfesim.ModelConfig(K=args.K, lambda_prior=0.5)
    spent, lock, spd = [0.0], threading.Lock(), gs._random_spd

    def timed_spd(*a):
        t0 = time.perf_counter()
        r = spd(*a)
        with lock:
            spent[0] += time.perf_counter() - t0
        return r

    gs._random_spd = timed_spd
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        f"# random_state, N = {args.N}, K = {args.K}, {args.dtype}, {cores} cores; medians of {args.reps}",
        f"{'threads':>8} {'wall s':>9} {'speed-up':>9} {'covariance thread-s':>20}",
    ]
    print(lines[0], flush=True)
    base = None
    try:
        for n in args.threads:
            walls, spds = [], []
            for _ in range(args.reps):
                spent[0] = 0.0
                t0 = time.perf_counter()
                vfesim.random_state(cfg, n_agents=args.N, seed=0, dtype=args.dtype, threads=n)
                walls.append(time.perf_counter() - t0)
                spds.append(spent[0])
            wall = float(np.median(walls))
            base = base or wall
            lines.append(f"{n:8d} {wall:9.2f} {base / wall:8.2f}x {float(np.median(spds)):20.2f}")
            print(lines[-1], flush=True)
    finally:
        gs._random_spd = spd
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "population.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
