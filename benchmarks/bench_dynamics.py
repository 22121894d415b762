"""Step time per integrator at N = 4096, K = 3 (float64) on the numpy and numba backends.

Prints a table of medians over repeats: ``step`` is one full step (model energy included; the number of
energy evaluations per step is in ``evals``), ``update`` is the integrator's own work (the energy replaced
by a precomputed gradient), i.e. what the fused kernels in ``kernels/update_cpu.py`` accelerate.

    python benchmarks/bench_dynamics.py [--n 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import time

import numba

import vfesim
from vfesim.backends import energy_and_gradient_arrays
from vfesim.integrators import available, make_integrator

EVALS = {
    "gradient_flow": 1,
    "symplectic_euler": 1,
    "verlet": 1,
    "ruth3": 3,
    "pefrl": 5,
    "riemannian_leapfrog": 1,
}


def median_step(integ, state, repeats):
    c = integ.step(integ.init(state))  # warm-up (numba compilation, caches)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = integ.step(c)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = vfesim.ModelConfig(K=args.K, lambda_prior=0.5)
    state = vfesim.random_state(cfg, n_agents=args.n, seed=0)
    arrays = {k: state[k].data for k in state.data_vars}
    terms0, grads0 = energy_and_gradient_arrays(arrays, cfg, "numpy")
    frozen = lambda a: (terms0, grads0)  # constant force: isolates the integrator's own cost
    have_numba_energy = importlib.util.find_spec("vfesim.backends.numba_backend") is not None
    print(
        f"# N={args.n} K={args.K} float64, {platform.processor() or platform.machine()}, "
        f"median of {args.repeats}; numba energy backend present: {have_numba_energy}; "
        f"{os.cpu_count()} CPUs, numba threads {numba.get_num_threads()}, "
        f"load average {os.getloadavg()[0]:.1f} at start"
    )
    print(f"{'method':<22}{'backend':<8}{'evals':>6}{'step [ms]':>12}{'update [ms]':>13}")
    for method in available():
        for backend in ("numpy", "numba"):
            opts = {}
            if backend == "numba" and not have_numba_energy:
                opts["energy"] = lambda a: energy_and_gradient_arrays(a, cfg, "numpy")
            full = make_integrator(method, cfg, 1e-3, backend=backend, **opts)
            upd = make_integrator(method, cfg, 1e-3, backend=backend, energy=frozen)
            t_full = median_step(full, state, args.repeats)
            t_upd = median_step(upd, state, max(args.repeats, 7))
            print(f"{method:<22}{backend:<8}{EVALS[method]:>6}{1e3 * t_full:>12.2f}{1e3 * t_upd:>13.2f}")


if __name__ == "__main__":
    main()
