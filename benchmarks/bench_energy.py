"""Energy + gradient time and peak memory: numpy vs numba backends vs the per-pair loop oracle (SPEC §6).

Each case (backend, dtype, K, N) runs in a fresh subprocess: the state is built, one untimed call warms
the JIT (loaded from Numba's cache) on a 64-agent state, then ``--repeat`` timed calls of the whole
``vfesim.energy_and_gradient`` (default config, lambda_prior = 0) give the median. Peak memory is the
growth of the process's resident high-water mark during the timed calls: VmHWM is reset through
/proc/self/clear_refs right before them and compared with VmRSS at that moment (Linux), else the
ru_maxrss delta. The loop oracle (tests/reference/loop.py ``reference_energy``) computes the energy only,
in float64; it runs where N <= --loop-max-n.

    python benchmarks/bench_energy.py                      # full table (tens of minutes on 2 cores)
    python benchmarks/bench_energy.py --quick              # N in {64, 256, 1024}, K = 3, float64
    python benchmarks/bench_energy.py --n 4096 --k 3 --dtype float64 --backend numba
    python benchmarks/bench_energy.py --dtype-table                 # numpy/numba x f64/f32, K = 3
    python benchmarks/bench_energy.py --dtype-table --tree /old/pp --tree /new/pp   # before/after

``--dtype-table`` (issue 9, items 3-4): numpy and numba in float64 and float32 at K = 3 and N in
{1024, 4096, 16384}, one process per backend and round, its cases interleaved (each repetition times
every case once, in a rotated order), so that the load of a shared machine hits every case alike; wall
and CPU time medians and their ratios. (The backends run apart: NumPy's BLAS threads spin on after each
call and, on two cores, took the cores from the numba calls timed next to them.) Each ``--tree`` (a
directory holding ``vfesim/`` and ``vfesim_kernels/``, put first on PYTHONPATH) gets its own processes;
the trees alternate for ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LOOP_REFERENCE = ROOT / "tests" / "reference" / "loop.py"

_CASE = textwrap.dedent(
    """
    import json, resource, sys, time
    import numpy as np
    import vfesim

    backend, dtype = sys.argv[1], sys.argv[2]
    K, N, repeat = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    cfg = vfesim.ModelConfig(K=K)
    state = vfesim.random_state(cfg, N, seed=0, dtype=dtype)
    if backend == "loop":
        import importlib.util
        spec = importlib.util.spec_from_file_location("vfesim_loop_reference", sys.argv[6])
        loop = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loop)
        reference_energy = loop.reference_energy
        call = lambda: reference_energy(state, cfg)
    else:
        call = lambda: vfesim.energy_and_gradient(state, cfg, backend=backend)
        small = vfesim.random_state(cfg, min(N, 64), seed=0, dtype=dtype)
        vfesim.energy_and_gradient(small, cfg, backend=backend)  # warm-up: JIT (from Numba's cache)

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        return None

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        base, how = status("VmRSS:"), "VmHWM"
    except OSError:
        base, how = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if sum(times) > 60:
            break
    peak = status("VmHWM:") if how == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"median": float(np.median(times)), "runs": len(times),
                                  "peak_mib": max(0, peak - base) / 2**20, "mem": how}))
    """
)


_TABLE_CASE = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import vfesim

    K, repeat = int(sys.argv[1]), int(sys.argv[2])
    Ns = [int(n) for n in sys.argv[3].split(",")]
    cases = [(N, b, d) for N in Ns for b in sys.argv[4].split(",") for d in ("float64", "float32")]
    cfg = vfesim.ModelConfig(K=K)
    dts = ("float64", "float32")
    states = {(N, d): vfesim.random_state(cfg, N, seed=0, dtype=d) for N in Ns for d in dts}
    for N, b, d in cases:  # warm-up: JIT (from Numba's cache), thread pool, first touch
        if N == Ns[0]:
            vfesim.energy_and_gradient(states[N, d], cfg, backend=b)
    times = {repr(c): [] for c in cases}
    for r in range(repeat):
        for N in Ns:
            group = [c for c in cases if c[0] == N]
            k = r % len(group)
            for c in group[k:] + group[:k]:  # rotated: no case always runs after the same one
                w0, c0 = time.perf_counter(), time.process_time()
                vfesim.energy_and_gradient(states[c[0], c[2]], cfg, backend=c[1])
                times[repr(c)].append((time.perf_counter() - w0, time.process_time() - c0))
    print("RESULT " + json.dumps(times))
    """
)


def dtype_table(trees, Ns, K, repeat, rounds, emit) -> None:
    """The numpy/numba x float64/float32 table (see the module doc), one block per tree."""
    per_round = max(1, -(-repeat // rounds))
    pooled = {t: {} for t in trees}
    for _ in range(rounds):
        for t in trees:
            env = dict(os.environ)
            if t != ".":
                env["PYTHONPATH"] = os.pathsep.join([t] + [p for p in [env.get("PYTHONPATH")] if p])
            # One process per backend: NumPy's BLAS threads spin for a while after each call, and on a
            # 2-core machine they took the cores from Numba's threads timed right after them (numba
            # float64, N = 4096: 0.094 s interleaved in one process, 0.063 s with OPENBLAS_NUM_THREADS=1).
            for backend in ("numpy", "numba"):
                sizes = ",".join(map(str, Ns))
                cmd = [sys.executable, "-c", _TABLE_CASE, str(K), str(per_round), sizes, backend]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
                out = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not out:
                    sys.stderr.write(f"tree {t} ({backend}) failed:\n{proc.stderr[-3000:]}\n")
                    return
                for c, v in json.loads(out[-1][7:]).items():
                    pooled[t].setdefault(c, []).extend(v)
    emit(f"# K={K}; per case: median wall s (median CPU s, both threads) of {rounds * per_round} calls")
    emit("# speedups: f64/f32 = numba float64 time / numba float32 time; np64/x = numpy float64 time / x")
    for t in trees:
        emit(f"# tree: {t if t != '.' else ROOT}")
        cols = [("numpy", "float64"), ("numpy", "float32"), ("numba", "float64"), ("numba", "float32")]
        emit(
            f"{'N':>6} "
            + " ".join(f"{b + ' ' + d[-2:] + ' wall (cpu)':>22}" for b, d in cols)
            + f" {'f64/f32':>8} {'np64/nb64':>9} {'np64/nb32':>9} {'np32/nb32':>9}"
        )
        for N in Ns:
            med = {}
            for b, d in cols:
                v = np.array(pooled[t][repr((N, b, d))])
                med[b, d] = np.median(v, axis=0)
            w = {k: v[0] for k, v in med.items()}
            emit(
                f"{N:>6} "
                + " ".join(f"{med[c][0]:>12.4f} ({med[c][1]:7.4f})" for c in cols)
                + f" {w['numba', 'float64'] / w['numba', 'float32']:8.2f}"
                + f" {w['numpy', 'float64'] / w['numba', 'float64']:9.2f}"
                + f" {w['numpy', 'float64'] / w['numba', 'float32']:9.2f}"
                + f" {w['numpy', 'float32'] / w['numba', 'float32']:9.2f}"
            )


def run_case(backend: str, dtype: str, K: int, N: int, repeat: int, timeout: float) -> dict | None:
    """Median seconds and peak MiB of one case in a fresh interpreter; None on timeout or failure."""
    cmd = [sys.executable, "-c", _CASE, backend, dtype, str(K), str(N), str(repeat), str(LOOP_REFERENCE)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(f"{backend} {dtype} K={K} N={N} failed:\n{proc.stderr[-2000:]}\n")
    return None


def loop_available() -> bool:
    return LOOP_REFERENCE.is_file()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    p.add_argument("--k", type=int, nargs="+", default=[3, 21])
    p.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    names = ["numpy", "numba", "loop"]
    p.add_argument("--backend", nargs="+", default=names, choices=names)
    p.add_argument("--repeat", type=int, default=5, help="timed calls per case (stops after 60 s)")
    p.add_argument("--loop-max-n", type=int, default=256, help="largest N for the loop oracle")
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per case (then larger N are skipped)"
    )
    p.add_argument("--quick", action="store_true", help="N in {64, 256, 1024}, K = 3, float64")
    p.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    p.add_argument("--dtype-table", action="store_true", help="numpy/numba x f64/f32 table")
    p.add_argument("--tree", action="append", default=None, help="--dtype-table: code tree (repeatable)")
    p.add_argument("--rounds", type=int, default=1, help="--dtype-table: alternations of the trees")
    a = p.parse_args(argv)
    if a.dtype_table and a.n == p.get_default("n"):
        a.n = [1024, 4096, 16384]
    if a.quick:
        a.n, a.k, a.dtype = [64, 256, 1024], [3], ["float64"]
    backends = [b for b in a.backend if b != "loop" or loop_available()]
    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    import numba

    cpu = platform.processor() or platform.machine()
    emit(f"# vfesim bench_energy  {time.strftime('%Y-%m-%d %H:%M')}  {cpu}")
    emit(
        f"# cores={os.cpu_count()} numba threads={numba.config.NUMBA_NUM_THREADS} numpy={np.__version__} "
        f"numba={numba.__version__}  load avg at start={os.getloadavg()[0]:.1f}"
    )
    if a.dtype_table:
        dtype_table(a.tree or ["."], a.n, a.k[0], a.repeat, a.rounds, emit)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text("\n".join(lines) + "\n")
        return 0
    emit("# time: median of the whole energy_and_gradient call (loop: energy only, float64)")
    emit("# peak: resident high-water growth during the timed calls, fresh process per case")
    if "loop" in a.backend and "loop" not in backends:
        emit("# loop oracle not importable (tests/reference/loop.py): skipped")
    head = (("K", 3), ("dtype", 8), ("N", 6), ("backend", 7), ("time_s", 10), ("peak_MiB", 9))
    emit(" ".join(f"{h:>{w}}" for h, w in head) + f" {'numpy/x':>8} {'loop/x':>8}")
    for K in a.k:
        for dtype in a.dtype:
            skip = set()
            for N in a.n:
                res = {}
                for b in backends:
                    if b in skip or (b == "loop" and (N > a.loop_max_n or dtype != a.dtype[-1])):
                        continue
                    r = run_case(b, dtype if b != "loop" else "float64", K, N, a.repeat, a.timeout)
                    if r is None:
                        skip.add(b)
                        emit(f"{K:>3} {dtype:>8} {N:>6} {b:>7} {'timeout':>10}")
                        continue
                    res[b] = r
                for b, r in res.items():
                    t = r["median"]
                    vs = {x: f"{res[x]['median'] / t:8.1f}" if x in res else " " * 8 for x in names}
                    emit(
                        f"{K:>3} {dtype:>8} {N:>6} {b:>7} {r['median']:10.4f} {r['peak_mib']:9.1f} "
                        f"{vs['numpy']} {vs['loop']}"
                    )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
