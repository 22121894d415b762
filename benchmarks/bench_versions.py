"""Time one energy + gradient evaluation of the installed (or PYTHONPATH) vfesim, for comparing two code
versions in one run (e.g. before and after a refactor), each in its own process:

    PYTHONPATH=old python benchmarks/bench_versions.py --label before
    PYTHONPATH=new python benchmarks/bench_versions.py --label after

Default cases: backends numba and cuda (when a GPU is present), N in {4096, 65536}, K = 3, float32 and
float64, the default config (self + belief alignment, dense; ``--prior``: the prior alignment term too).
``--aggregator expected softmin`` runs every case with each aggregator (the case's name then ends in e or s;
default: each config's own). ``--quantum-d 4`` adds density-matrix agents of that d (self + belief terms,
dense) in the complex dtype of each real one (complex64, complex128). Prints one line per case: label,
backend, N, K (Gaussian) or d (density matrices, "d4"), dtype, median and least time (ms) of --repeat calls
after a warm-up call, and the repeats; ``--accuracy`` adds, for float32 / complex64 cases, each gradient's
max-norm relative error and the energy's relative error against the same state in float64 / complex128.
The inputs live where the backend wants them (NumPy for numba, CuPy for cuda), so transfers are not timed.
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


WIDE = {"float32": "float64", "complex64": "complex128"}


def accuracy(backend: str, N: int, cfg, dtype: str) -> str:
    """Max-norm relative error of each gradient, and relative error of the total energy, of a narrow-dtype
    evaluation against the same state evaluated in the wide dtype on the same backend."""
    state = vfesim.random_state(cfg, N, seed=0, dtype=dtype)
    be = get(backend)
    out = []
    for wide in (False, True):
        arrays = {k: state[k].data for k in state.data_vars}
        if wide:  # every float32 / complex64 array widened (integer outcomes as they are)
            arrays = {k: a.astype(WIDE.get(a.dtype.name, a.dtype)) for k, a in arrays.items()}
        arrays = be.to_device(arrays)
        terms, grads = be.energy_and_gradient(arrays, cfg)
        out.append((terms, be.to_host(grads)))
    (t1, g1), (t2, g2) = out
    errs = [f"{k} {np.abs(g1[k] - g2[k]).max() / np.abs(g2[k]).max():.1e}" for k in g2]
    errs.append(f"E {abs(t1['total'] - t2['total']) / abs(t2['total']):.1e}")
    return " | err vs " + WIDE[dtype] + ": " + " ".join(errs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default=vfesim.__version__)
    ap.add_argument("--backends", nargs="*", default=None)
    ap.add_argument("--n", nargs="*", type=int, default=[4096, 65536])
    ap.add_argument("--k", nargs="*", type=int, default=[3])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--prior", action="store_true", help="Gaussian cases with the prior alignment term")
    ap.add_argument("--aggregator", nargs="+", default=[None], help="aggregators (default: each config's)")
    ap.add_argument("--accuracy", action="store_true", help="narrow dtypes: errors against the wide dtype")
    ap.add_argument("--quantum-d", nargs="*", type=int, default=[], help="density-matrix cases of these d")
    args = ap.parse_args()
    backends = args.backends
    if backends is None:
        from vfesim.backends import cuda_available

        backends = ["numba"] + (["cuda"] if cuda_available() else [])
    prior = 1.0 if args.prior else 0.0
    cases = []
    for agg in args.aggregator:
        kw = {} if agg is None else {"aggregator": agg}
        tag = "" if agg is None else agg[0]  # e / s after the case's name
        cases += [
            (f"{K}{tag}", vfesim.ModelConfig(K=K, lambda_prior=prior, **kw), dt)
            for K in args.k
            for dt in args.dtypes
        ]
        cases += [
            (f"d{d}{tag}", vfesim.QuantumConfig(d=d, **kw), COMPLEX[dt])
            for d in args.quantum_d
            for dt in args.dtypes
        ]
    cols = ("label", 8), ("backend", 7), ("N", 8), ("K", 4), ("dtype", 10), ("median_ms", 10), ("min_ms", 8)
    print(" ".join(f"{c:>{w}}" for c, w in cols) + f" {'reps':>5}", flush=True)
    for backend in backends:
        for name, cfg, dtype in cases:
            for N in args.n:
                t, lo, reps = time_case(backend, N, cfg, dtype, args.repeat)
                row = f"{args.label:>8} {backend:>7} {N:>8} {name:>4} {dtype:>10}"
                acc = accuracy(backend, N, cfg, dtype) if args.accuracy and dtype in WIDE else ""
                print(f"{row} {1e3 * t:>10.2f} {1e3 * lo:>8.2f} {reps:>5}{acc}", flush=True)


if __name__ == "__main__":
    main()
