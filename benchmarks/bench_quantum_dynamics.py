"""Density-matrix dynamics: one step and one rollout with its adjoint (issue 13, spec/quantum.md §3, §4, §6).

    python benchmarks/bench_quantum_dynamics.py                       # CPU: N = 1024, d = 2 4 8, c128/c64
    python benchmarks/bench_quantum_dynamics.py --qutip               # + vfesim Lindblad vs QuTiP mesolve
    python benchmarks/bench_quantum_dynamics.py --backend numba --no-rollout  # CPU: the per-agent kernels
    python benchmarks/bench_quantum_dynamics.py --backend numpy numba --sizes 256 1024 --ds 2 4 --T 8
    python benchmarks/bench_quantum_dynamics.py --backend cupy --sizes 4096 65536 262144 \\
        --dtypes complex128 complex64 --torch                         # GPU, + the PyTorch autograd baseline
    python benchmarks/bench_quantum_dynamics.py --backend cuda --no-rollout --sizes 4096 65536 262144
    python benchmarks/bench_quantum_dynamics.py --backend cuda --sizes 65536 --ds 4 --dtypes complex128 \
        --T 100 --window 8 --copy --torch                             # GPU: the issue's target, one table

Problem (the issue's target): Jacobi steps of N agents with C1 coupling over a causal window of w = 8
(``--window``) senders (eps0 = 0.3, ell = 1.618), the unitary step from one eigh of H_i per rollout,
computational-basis dephasing (gamma = 0.2) and a Born loss with every agent observed at every step; dt =
0.09. "step": one synchronous step (evolve's inner step, arrays in, arrays out) from a state one step in
(laid out as a rollout holds its states: agent-minor on the GPU). "rollout": T = 100 steps (``--T``)
with the exact adjoint (:func:`vfesim.quantum.rollout` with the backend's QuantumOps, uniform
checkpointing, s = ceil(sqrt T)); includes the per-rollout eigh of H, frames and transports; "adjoint"
says which step adjoint it ran ("kernels" or the array code's "tape"), "forward_steps" how many forward
steps it ran (the loss pass and the replays; ``--store-all`` adds "rollout_all_s", the same rollout with
``checkpoint_every=1``: every state kept, so the kernels replay none), "arrays" where the rollout's
states lived (the module of its final state: "cupy" for a device-resident GPU rollout). Medians of
repeated calls after one warm-up. Under the Numba CUDA simulator (NUMBA_ENABLE_CUDASIM=1, no GPU) backend
"cuda" runs the same kernels on NumPy arrays: a check of the script's paths at tiny sizes, not a timing.

Achieved bytes/s against a traffic model (c = bytes of one complex number; the model counts each array a
step must read or write once): forward step (2 w + 6) N d^2 c (senders and transports, w each; state in,
after the unitary, after the dephasing, out; U; sigma), adjoint step (3 w + 10) N d^2 c (tapes read,
cotangents of states, senders and transports), rollout T (2 forward + 1 adjoint) (forward twice: the loss
pass and the checkpoint replay). On the GPU ``--copy`` measures the device copy rate and adds the
fraction of it each row achieved (``step_of_copy``, ``rollout_of_copy``).

``--qutip`` (CPU): the same Lindblad problem per agent (H_i, L_k = sqrt(gamma)|k><k|) over T dt with
QuTiP 5 ``mesolve`` (adams, atol 1e-10, rtol 1e-8) on ``--qutip-agents`` agents, against
:func:`vfesim.quantum.lindblad_evolve` ("exact" Liouvillian propagator, "strang") on the same agents and
on N: time per agent and max |rho - rho_qutip|.

Backends (one or several, ``--backend numpy numba``): "numpy" / "cupy" run the array code; "numba" /
"cuda" the per-agent kernels of the channel step and of its adjoint (vfesim_kernels.quantum_math
``channel_step_agent``, ``channel_step_vjp_agent``; d up to the backend's kernel size, array code above),
in the step, the adjoint step and the rollout alike. "step_vjp": one adjoint step (array code: the taped
step and ``rollout._update_vjp``; kernels: forward recomputed per agent, then the adjoint).

``--torch``: benchmarks/torch_quantum_rollout.py (PyTorch autograd, the same rollout; imported only then).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import numpy as np

import vfesim
from vfesim.quantum import QuantumDynamics, Schedule, rollout
from vfesim.quantum.channels import causal_window
from vfesim.quantum.energy import NUMPY_OPS
from vfesim.quantum.evolve import agent_update, prepare, step
from vfesim.quantum.lindblad import lindblad_evolve
from vfesim.quantum.state import make_state

HERE = Path(__file__).resolve().parent
DT, T_STEPS, WINDOW, EPS0, ELL, GAMMA = 0.09, 100, 8, 0.3, 1.618, 0.2


def array_module(name: str):
    """The arrays of a backend: NumPy on the CPU; CuPy on the GPU ("cuda": the backend's own, NumPy under
    the CUDA simulator)."""
    if name in ("numpy", "numba"):
        return np
    if name == "cuda":
        from vfesim.backends.cuda_backend import array_module as cuda_arrays

        return cuda_arrays()
    import cupy

    return cupy


def backend_ops(name: str):
    """The QuantumOps of a backend name (its ``step_vjp(d)``: the kernel adjoint of the channel step, or
    None where the array code runs)."""
    if name == "numba":
        from vfesim.backends.numba_backend import QUANTUM_OPS

        return QUANTUM_OPS
    if name == "cuda":
        from vfesim.backends.cuda_backend import QUANTUM_OPS

        return QUANTUM_OPS
    return NUMPY_OPS


def sync(xp) -> None:
    if xp is not np:
        xp.cuda.Device().synchronize()


def timeit(fn, xp, *, min_reps=3, max_reps=20, target_s=1.0) -> tuple[float, int]:
    fn()
    sync(xp)
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < target_s):
        t0 = time.perf_counter()
        fn()
        sync(xp)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), len(times)


def problem(N: int, d: int, dtype: str, xp, seed: int = 0, T: int = T_STEPS, window: int = WINDOW):
    """(cfg, state Dataset on the device, dynamics, schedule) of the module docstring's problem."""
    cfg = vfesim.QuantumConfig(d=d, lambda_belief=0.0)
    host = vfesim.random_state(cfg, N, seed=seed, dtype=dtype)
    st = make_state(cfg, *(xp.asarray(host[k].values) for k in ("rho", "hamiltonian", "temperature", "phi")))
    dyn = QuantumDynamics(
        coupling_strength=EPS0,
        coupling_length=ELL,
        neighbours=causal_window(N, window),
        dephasing_rate=GAMMA,
    )
    y = np.random.default_rng(seed).integers(0, d, size=(T, N))
    return cfg, st, dyn, Schedule(dyn, DT, T, y)


def traffic(N: int, d: int, dtype: str, T: int = T_STEPS, window: int = WINDOW) -> tuple[float, float]:
    c = np.dtype(dtype).itemsize
    fwd = (2 * window + 6) * N * d * d * c
    adj = (3 * window + 10) * N * d * d * c
    return fwd, T * (2 * fwd + adj)


def bench(
    N: int,
    d: int,
    dtype: str,
    rollout_too: bool,
    backend: str = "numpy",
    T: int = T_STEPS,
    window: int = WINDOW,
    store_all: bool = False,
) -> dict:
    from vfesim.quantum.rollout import _update_vjp, _zeros_acc

    xp = array_module(backend)
    cfg, st, dyn, sched = problem(N, d, dtype, xp, T=T, window=window)
    arrays = {k: st[k].data for k in st.data_vars}
    P = prepare(arrays, cfg, dyn)
    ops = backend_ops(backend)
    rho = step(P, arrays["rho"], DT, dyn, ops=ops)[0]  # a state as a rollout holds it (the backend's layout)
    vjp = ops.step_vjp(d)
    t_step, n_step = timeit(lambda: step(P, rho, DT, dyn, ops=ops), xp)
    b_step, b_roll = traffic(N, d, dtype, T, window)
    row = dict(backend=backend, N=N, d=d, dtype=dtype, step_s=t_step, step_GBps=b_step / t_step / 1e9)
    row["step_reps"] = n_step
    ob = rho + 0.5  # a cotangent
    if vjp is not None:
        t_adj, _ = timeit(lambda: vjp(P, rho, ob, DT, dyn), xp)
    else:

        def taped():
            R = rho[xp.asarray(P.index)]
            _, tape = agent_update(P, slice(None), rho, R, DT, dyn, keep=True)
            _update_vjp(P, slice(None), R, tape, ob, DT, dyn, _zeros_acc(P, xp, rho.dtype))

        t_adj, _ = timeit(taped, xp)
    row["step_vjp_s"] = t_adj
    if rollout_too:
        res = []
        t_roll, n_roll = timeit(
            lambda: res.append(rollout(st, cfg, sched, "born", ops=ops)), xp, min_reps=1, max_reps=5
        )
        row.update(rollout_s=t_roll, rollout_GBps=b_roll / t_roll / 1e9, rollout_reps=n_roll)
        row["adjoint"] = res[-1].stats["step_adjoint"]
        row["arrays"] = type(res[-1].final["rho"].data).__module__.split(".")[0]
        row["forward_steps"] = res[-1].stats["forward_steps"]
        if store_all:  # every state kept (checkpoint_every=1): with kernels, no step is replayed
            t_all, _ = timeit(
                lambda: res.append(rollout(st, cfg, sched, "born", ops=ops, checkpoint_every=1)),
                xp, min_reps=1, max_reps=5,
            )  # fmt: skip
            row.update(rollout_all_s=t_all, forward_steps_all=res[-1].stats["forward_steps"])
    return row


def copy_rate(xp, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate (read + write) in GB/s."""
    a = xp.ones(nbytes // 8, np.float64)
    b = xp.empty_like(a)
    t, _ = timeit(lambda: b.__setitem__(Ellipsis, a), xp)
    return 2 * a.nbytes / t / 1e9


def bench_qutip(n_agents: int, d: int, N: int) -> dict:
    """The Lindblad comparison of the module docstring (complex128, CPU)."""
    import qutip

    cfg = vfesim.QuantumConfig(d=d)
    st = vfesim.random_state(cfg, N, seed=1)
    rho, H = st.rho.values, st.hamiltonian.values
    t_end = T_STEPS * DT
    c_ops = [qutip.Qobj(np.sqrt(GAMMA) * np.outer(np.eye(d)[k], np.eye(d)[k])) for k in range(d)]
    opts = {"atol": 1e-10, "rtol": 1e-8, "store_states": False, "store_final_state": True}

    def run_qutip():
        return [
            qutip.mesolve(
                qutip.Qobj(H[i]), qutip.Qobj(rho[i]), [0.0, t_end], c_ops, options=opts
            ).final_state.full()
            for i in range(n_agents)
        ]

    t0 = time.perf_counter()
    ref = np.array(run_qutip())
    t_q = (time.perf_counter() - t0) / n_agents
    row = dict(d=d, qutip_agents=n_agents, qutip_s_per_agent=t_q)
    for method, n_steps in (("exact", 1), ("strang", T_STEPS)):
        dt = t_end / n_steps
        out = lindblad_evolve(rho[:n_agents], H[:n_agents], dt, n_steps, dephasing_rate=GAMMA, method=method)
        err = float(np.abs(out[-1] - ref).max())
        t_v, _ = timeit(
            lambda dt=dt, n=n_steps, m=method: lindblad_evolve(rho, H, dt, n, dephasing_rate=GAMMA, method=m),
            np,
        )
        row[f"{method}_s_per_agent"] = t_v / N
        row[f"{method}_max_err"] = err
        row[f"{method}_speedup"] = t_q / (t_v / N)
    return row


def table(rows: list[dict], keys: list[str]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    width = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, width, strict=True))
    return "\n".join([line(keys), *(line(c) for c in cells)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["numpy", "numba", "cupy", "cuda"], nargs="+", default=["numpy"])
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="N (default 1024 CPU, 3 sizes GPU)")
    ap.add_argument("--ds", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--dtypes", nargs="*", default=["complex128", "complex64"])
    ap.add_argument("--no-rollout", action="store_true", help="time the step only")
    ap.add_argument("--T", type=int, default=T_STEPS, help="rollout steps")
    ap.add_argument("--window", type=int, default=WINDOW, help="senders per agent (causal window)")
    ap.add_argument("--copy", action="store_true", help="also print the device copy rate (GPU)")
    ap.add_argument("--store-all", action="store_true", help="also time a rollout that keeps every state")
    ap.add_argument("--qutip", action="store_true", help="Lindblad vs QuTiP mesolve (CPU)")
    ap.add_argument("--qutip-agents", type=int, default=16)
    ap.add_argument("--torch", action="store_true", help="the PyTorch autograd baseline at the same sizes")
    ap.add_argument("--out", default=None, help="folder for quantum_dynamics_bench.jsonl")
    args = ap.parse_args(argv)
    gpu = [b for b in args.backend if array_module(b) is not np]
    sizes = args.sizes or ([4096, 65536, 262144] if gpu else [1024])
    backends = " ".join(args.backend)
    print(f"# {platform.node()} {platform.processor()} numpy {np.__version__} backends {backends}")
    print(
        f"# T = {args.T}, window = {args.window}, dt = {DT}; medians; GB/s of the traffic model (docstring)"
    )
    copy = copy_rate(array_module(gpu[0])) if args.copy and gpu else None
    if copy is not None:
        print(f"# device copy rate {copy:.0f} GB/s")
    rows = []
    for N in sizes:
        for d in args.ds:
            for dtype in args.dtypes:
                for backend in args.backend:
                    roll = not args.no_rollout
                    row = bench(N, d, dtype, roll, backend, args.T, args.window, args.store_all)
                    row.update(T=args.T, window=args.window)
                    if copy is not None and array_module(backend) is not np:
                        row["copy_GBps"] = copy
                        for k in ("step", "rollout"):
                            if f"{k}_GBps" in row:
                                row[f"{k}_of_copy"] = row[f"{k}_GBps"] / copy
                    rows.append(row)
                    print(table(rows[-1:], list(rows[-1])), flush=True)
    keys = ["backend", "N", "d", "dtype", "step_s", "step_GBps", "step_vjp_s"] + (
        [] if args.no_rollout else ["rollout_s", "rollout_GBps", "adjoint", "arrays", "forward_steps"]
    )
    if args.store_all and not args.no_rollout:
        keys += ["rollout_all_s", "forward_steps_all"]
    if copy is not None:
        keys += ["step_of_copy"] + ([] if args.no_rollout else ["rollout_of_copy"])
    if args.torch:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "torch_quantum_rollout", HERE / "torch_quantum_rollout.py"
        )
        torch_quantum_rollout = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(torch_quantum_rollout)

        for b in gpu:  # CuPy's pool keeps the rollouts' memory: hand it back before PyTorch allocates
            xp = array_module(b)
            if xp is not np:
                xp.get_default_memory_pool().free_all_blocks()
        for r in rows:
            r.update(torch_quantum_rollout.bench(r["N"], r["d"], r["dtype"], args.T, args.window))
            r["speedup_vs_torch"] = r.get("torch_rollout_s", math.nan) / r.get("rollout_s", math.nan)
        keys += ["torch_rollout_s", "speedup_vs_torch", "torch_note"]
    print("\n" + table(rows, keys))
    if args.qutip:
        qrows = [bench_qutip(args.qutip_agents, d, sizes[0]) for d in args.ds]
        print("\n# Lindblad (H, computational dephasing) over T dt, per agent: QuTiP mesolve vs vfesim")
        print(table(qrows, list(qrows[0])))
        rows += qrows
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "quantum_dynamics_bench.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
