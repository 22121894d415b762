"""A fixed cuda-backend workload for a kernel profiler (Nsight Compute), e.g. per-kernel times:

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python benchmarks/profile_pairs.py --N 65536 --K 3 --dtype float32 --evals 2

Runs ``--evals`` energy+gradient evaluations on a random device state (the first one compiles).
"""

from __future__ import annotations

import argparse

import cupy as cp

import vfesim
from vfesim.backends import cuda_backend as cb


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=65536)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--evals", type=int, default=2)
    ap.add_argument("--terms", choices=["belief", "both"], default="belief")
    args = ap.parse_args(argv)
    cfg = vfesim.ModelConfig(K=args.K, lambda_prior=1.0 if args.terms == "both" else 0.0)
    st = vfesim.random_state(cfg, n_agents=args.N, seed=0, dtype=args.dtype)
    arrays = cb.to_device({k: st[k].values for k in st.data_vars})
    for _ in range(args.evals):
        terms, _ = cb.energy_and_gradient(arrays, cfg)
    cp.cuda.Device().synchronize()
    print(terms)


if __name__ == "__main__":
    main()
