"""Time one energy + gradient evaluation of the installed (or PYTHONPATH) vfesim, for comparing two code
versions in one run (e.g. before and after a refactor), each in its own process:

    PYTHONPATH=old python benchmarks/bench_versions.py --label before
    PYTHONPATH=new python benchmarks/bench_versions.py --label after

Default cases: backends numba and cuda (when a GPU is present), N in {4096, 65536}, K = 3, float32 and
float64, the default config (self + belief alignment, dense; ``--prior``: the prior alignment term too).
``--quantum-d 4`` adds density-matrix agents of that d (self + belief terms, dense) in the complex dtype of
each real one (complex64, complex128). Prints one line per case: label, backend, N, K (Gaussian) or d
(density matrices, "d4"), dtype, median and least time (ms) of --repeat calls after a warm-up call, and the
repeats. The inputs live where the backend wants them (NumPy for numba, CuPy for cuda), so transfers are
not timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import vfesim
from vfesim.backends import get


def _sync(backend: str) -> None:
    if backend == "cuda":
        import cupy

        cupy.cuda.Device().synchronize()


COMPLEX = {"float32": "complex64", "float64": "complex128"}


def time_case(backend: str, N: int, cfg, dtype: str, repeat: int) -> tuple[float, float, int]:
    state = vfesim.random_state(cfg, N, seed=0, dtype=dtype)
    be = get(backend)
    arrays = be.to_device({k: state[k].data for k in state.data_vars})
    be.energy_and_gradient(arrays, cfg)  # warm-up (compilation, workspaces)
    times = []
    t_end = time.perf_counter() + 30.0
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() < t_end):
        _sync(backend)
        t0 = time.perf_counter()
        be.energy_and_gradient(arrays, cfg)
        _sync(backend)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(np.min(times)), len(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default=vfesim.__version__)
    ap.add_argument("--backends", nargs="*", default=None)
    ap.add_argument("--n", nargs="*", type=int, default=[4096, 65536])
    ap.add_argument("--k", nargs="*", type=int, default=[3])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--prior", action="store_true", help="Gaussian cases with the prior alignment term")
    ap.add_argument("--quantum-d", nargs="*", type=int, default=[], help="density-matrix cases of these d")
    args = ap.parse_args()
    backends = args.backends
    if backends is None:
        from vfesim.backends import cuda_available

        backends = ["numba"] + (["cuda"] if cuda_available() else [])
    prior = 1.0 if args.prior else 0.0
    cases = [(str(K), vfesim.ModelConfig(K=K, lambda_prior=prior), dt) for K in args.k for dt in args.dtypes]
    cases += [(f"d{d}", vfesim.QuantumConfig(d=d), COMPLEX[dt]) for d in args.quantum_d for dt in args.dtypes]
    cols = ("label", 8), ("backend", 7), ("N", 8), ("K", 3), ("dtype", 10), ("median_ms", 10), ("min_ms", 8)
    print(" ".join(f"{c:>{w}}" for c, w in cols) + f" {'reps':>5}", flush=True)
    for backend in backends:
        for name, cfg, dtype in cases:
            for N in args.n:
                t, lo, reps = time_case(backend, N, cfg, dtype, args.repeat)
                row = f"{args.label:>8} {backend:>7} {N:>8} {name:>3} {dtype:>10}"
                print(f"{row} {1e3 * t:>10.2f} {1e3 * lo:>8.2f} {reps:>5}", flush=True)


if __name__ == "__main__":
    main()
