"""Field agents: energy + gradient time per backend (issue 14's benchmark cases).

Cases (default config of :class:`vfesim.fields.FieldConfig`: self and belief alignment, overlap
neighbours, Gaussian-bump supports of the default area):

    N = 64 agents on a 128 x 128 torus, K = 3
    N = 16 agents on a 64 x 64 torus, K = 21

Per case the state is built once; per backend its arrays are moved to the backend's device, one untimed
call warms the kernels (compiled, or loaded from Numba's cache), then ``--repeat`` timed calls of
:func:`vfesim.backends.energy_and_gradient_arrays` (raw arrays, no validation: what a run evaluates per
step; neighbour lists and the row layout included) give the median and the minimum. On ``cuda`` each
call ends with a device synchronisation. The load average is printed: on a shared machine the numbers
say how long a call took under that load.

    python benchmarks/bench_fields.py                              # numpy and numba, both cases
    python benchmarks/bench_fields.py --backends cuda --repeat 20  # on a GPU
    python benchmarks/bench_fields.py --case small --repeat 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

import vfesim
from vfesim.backends import energy_and_gradient_arrays, get
from vfesim.fields import FieldConfig

CASES = {
    "N64-128x128-K3": dict(N=64, grid=(128, 128), K=3),
    "N16-64x64-K21": dict(N=16, grid=(64, 64), K=21),
}


def _sync(backend) -> None:
    if backend.on_device and backend.array_module() is not np:
        backend.array_module().cuda.Device().synchronize()


def bench_case(name: str, backends: list[str], repeat: int, dtype: str) -> list[dict]:
    spec = CASES[name]
    cfg = FieldConfig(K=spec["K"], grid=spec["grid"])
    t0 = time.perf_counter()
    state = vfesim.random_state(cfg, spec["N"], seed=0, dtype=dtype)
    build = time.perf_counter() - t0
    host = {k: state[k].values for k in state.data_vars}
    rows = int((host["support"] > 0).sum())
    out = []
    for b in backends:
        be = get(b)
        arrays = be.to_device(host)
        t0 = time.perf_counter()
        terms, _ = energy_and_gradient_arrays(arrays, cfg, b)
        _sync(be)
        warm = time.perf_counter() - t0
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            terms, grads = energy_and_gradient_arrays(arrays, cfg, b)
            _sync(be)
            times.append(time.perf_counter() - t0)
        out.append(
            dict(case=name, backend=b, dtype=dtype, N=spec["N"], K=spec["K"], rows=rows, build_s=build,
                 warm_s=warm, median_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times),
                 repeat=repeat, terms=terms)
        )  # fmt: skip
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="numpy,numba", help="comma-separated backends (numpy, numba, cuda)")
    p.add_argument("--case", choices=[*CASES, "all", "small"], default="all", help="'small': the K = 21 case")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    a = p.parse_args(argv)
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    names = list(CASES) if a.case == "all" else (["N16-64x64-K21"] if a.case == "small" else [a.case])
    import numba

    print(
        f"# {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, numba threads "
        f"{numba.get_num_threads()}, load average {os.getloadavg()[0]:.2f} (before)"
    )
    head = (
        f"{'case':<16} {'backend':<7} {'dtype':<7} {'rows':>8} {'median ms':>10} {'min ms':>9} "
        f"{'warm s':>7} {'n':>3}"
    )
    print(head)
    print("-" * len(head))
    results = []
    for name in names:
        for r in bench_case(name, backends, a.repeat, a.dtype):
            results.append(r)
            print(
                f"{r['case']:<16} {r['backend']:<7} {r['dtype']:<7} {r['rows']:>8} {r['median_ms']:>10.1f} "
                f"{r['min_ms']:>9.1f} {r['warm_s']:>7.2f} {r['repeat']:>3}",
                flush=True,
            )
    for name in names:
        runs = [r["terms"] for r in results if r["case"] == name]
        for k in ("self", "belief_align", "total"):
            ref = runs[0][k]
            spread = max(abs(t[k] - ref) for t in runs) / max(abs(ref), 1e-300)
            print(f"# {name}: {k} = {ref:.12g}, backends agree to {spread:.1e} (relative)")
    print(f"# load average {os.getloadavg()[0]:.2f} (after); rows: covered (agent, point) pairs")


if __name__ == "__main__":
    main()
