"""Time one run step of a scenario on a backend: what `vfesim run NAME --backend B` spends per step.

    python benchmarks/bench_scenario_step.py field_consensus --backend cuda [--steps 20] [--warm 2]
    python benchmarks/bench_scenario_step.py quantum_consensus --backend numba

The scenario's integrator (as ``vfesim run`` builds it) is initialised and stepped ``--warm`` times
(compiles the kernels, or loads them from Numba's cache), then ``--steps`` steps are timed one by one;
each step ends with the energy terms on the host (a device synchronisation on GPU backends). Prints the
median and minimum seconds per step and the time to the first step (init + first step, compile
included). No store is written: frames and checkpoints are not part of the step time.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from vfesim.scenario import load_scenario
from vfesim.simulate import _make_integrator, _with_overrides


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", help="a shipped scenario name or a TOML path")
    p.add_argument("--backend", default=None, help="the backend (default: the scenario's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm", type=int, default=2)
    args = p.parse_args(argv)
    scn = _with_overrides(load_scenario(args.scenario), None, args.backend, None)
    backend = scn.run["backend"]
    t0 = time.perf_counter()
    state = scn.initial_state()
    integ = _make_integrator(scn, backend, state)
    carry = integ.init(state)
    for _ in range(args.warm):
        carry = integ.step(carry)
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        carry = integ.step(carry)
        float(carry.terms["total"])  # the terms are host floats: the step is complete
        times.append(time.perf_counter() - t)
    print(f"{args.scenario} on {backend} ({platform.node()}): {args.steps} steps after {args.warm} warm-up")
    print(f"  per step: median {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms")
    print(f"  init + {args.warm} warm-up steps (compiles included): {first:.2f} s")


if __name__ == "__main__":
    main()
