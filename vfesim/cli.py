"""Command line (SPEC §1): ``vfesim run | resume | inspect | plot | verify``.

Exit codes: 0 done, 2 bad scenario or arguments, 3 the dynamics failed (NaN/Inf, SPD loss),
4 the store cannot be written, read or resumed, 5 ``verify`` found damage, 130 interrupted (Ctrl-C),
143 terminated (SIGTERM). Messages go to stderr through the ``vfesim`` logger; ``inspect`` and
``verify`` print their reports on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ._version import __version__
from .config import ConfigError
from .progress import configure_logging, log

__all__ = ["main"]


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar, warnings only")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vfesim", description="Run and analyse vfesim simulations.")
    ap.add_argument("--version", action="version", version=f"vfesim {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run a scenario (a TOML file, or the name of a shipped one)")
    p.add_argument(
        "scenario", nargs="?", help="scenario TOML file, or the name of a shipped scenario (see --list)"
    )
    p.add_argument("--list", action="store_true", help="list the scenarios shipped with vfesim and exit")
    p.add_argument("--out", help="output Zarr store (default: [output] path)")
    p.add_argument("--steps", type=int, help="total number of steps (overrides run.n_steps)")
    p.add_argument("--backend", help="numpy | numba | cuda | auto (overrides run.backend)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run store")
    _common(p)
    p = sub.add_parser("resume", help="continue a run from its last checkpoint")
    p.add_argument("store", help="run Zarr store")
    p.add_argument("--steps", type=int, help="new total number of steps (default: the run's)")
    p.add_argument("--backend", help="backend (default: the run's; another one breaks bitwise)")
    p.add_argument("--scenario", help="check the stored scenario against this file")
    p.add_argument(
        "--allow-version-change", action="store_true", help="resume a run of another vfesim version"
    )
    _common(p)
    p = sub.add_parser(
        "inspect", help="a run's summary (steps done, checkpoints, energies) and its scenario as TOML"
    )
    p.add_argument("store")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="everything as JSON (machine-readable)")
    what.add_argument(
        "--scenario",
        action="store_true",
        help="only the resolved scenario, as a TOML file `vfesim run` takes",
    )
    _common(p)
    p = sub.add_parser("plot", help="PNG figures of a run")
    p.add_argument("store")
    p.add_argument("--outdir", help="where to write PNGs (default: STORE without .zarr + _plots)")
    p.add_argument(
        "--time", type=float, help="field runs: model time of the maps (nearest saved frame; default: last)"
    )
    _common(p)
    p = sub.add_parser("scenarios", help="list the scenarios shipped with vfesim (`vfesim run NAME`)")
    _common(p)
    p = sub.add_parser("verify", help="check every chunk of a run store (exit code 5 on damage)")
    p.add_argument("store")
    _common(p)
    return ap


def _verify(path: str) -> int:
    from .io.store import RunStore, StoreError

    store = RunStore(path)
    if not store.path.is_dir():
        raise StoreError(f"{path}: not a vfesim run store (no such directory)")
    reports = store.verify()
    lines, unchecked = [], 0
    for r in reports:
        chunks = sum(a.chunks for a in r.arrays)
        unchecked += len(r.unchecksummed)
        head = "ok      " if r.intact else "DAMAGED "
        lines.append(f"{head}{r.name}: {len(r.arrays)} arrays, {chunks} chunks")
        lines += [f"    {d}" for d in r.damage]
    bad = [r for r in reports if not r.intact]
    if unchecked:
        lines.append(
            f"note: {unchecked} arrays were written without checksums (an older vfesim): "
            "they decode, but a flipped bit in them cannot be detected"
        )
    if bad:
        n = sum(len(r.damage) for r in bad)
        head = "checkpoint step-"
        steps = [r.name.removeprefix(head) for r in reports if r.intact and r.name.startswith(head)]
        if any(r.name in ("store", "trajectory") for r in bad) or not steps:
            after = "`vfesim resume` refuses to continue it"
        else:
            after = f"`vfesim resume` continues from step {int(steps[-1])}"
        lines.append(f"{path}: DAMAGED ({n} damaged items; {after})")
    else:
        lines.append(f"{path}: intact")
    _out("\n".join(lines))
    return 5 if bad else 0


def _list_scenarios() -> None:
    from .scenario import describe, packaged_dir, packaged_scenarios

    known = packaged_scenarios()
    width = max(map(len, known), default=0)
    lines = [f"{name:<{width}}  {describe(path)}" for name, path in known.items()]
    lines.append(f"(in {packaged_dir()}; run one with `vfesim run NAME --out NAME.zarr`)")
    _out("\n".join(lines))


def _chunking_lines(chunking: dict | None) -> list[str]:
    """The dask backend's chunking of a run (store attr ``chunking``), for ``inspect``."""
    if not chunking:
        return []
    sizes = chunking["chunks"]
    if len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]:
        last = f", the last {sizes[-1]}" if sizes[-1] != sizes[0] else ""
        what = f"{len(sizes)} chunks of {sizes[0]} agents{last}"
    else:
        what = f"{len(sizes)} chunks of {sizes} agents"
    return [
        f"chunking     {what} (Zarr: {chunking['agent_chunk']} agents per chunk), "
        f"inner {chunking['inner']}, scheduler {chunking['scheduler']}"
    ]


def _size_key(sc: dict) -> str:
    """The model section's size keys: "K = 3" (Gaussian [model]), "d = 2", "K = 3, grid = [64, 64]" (a
    family's own section)."""
    shared = ("population", "integrator", "run", "output")
    model = next((v for k, v in sc.items() if k not in shared), {})
    return ", ".join(f"{k} = {model[k]}" for k in ("K", "d", "grid") if k in model) or "?"


def _inspect(path: str, as_json: bool, scenario_only: bool) -> None:
    from .scenario import to_toml
    from .simulate import run_info

    info = run_info(path)
    if as_json:
        _out(json.dumps(info, indent=2, sort_keys=True))
        return
    sc = info["scenario"]
    scenario = f"# scenario {info['name']!r}, resolved (every default filled in)\n"
    scenario += to_toml(sc)
    if scenario_only:
        _out(scenario.rstrip("\n"))
        return
    running = "  (or killed: `vfesim resume` continues it)" if info["status"] == "running" else ""
    done = info["last_saved_step"]
    lines = [
        f"run          {info['path']}  ({info['name']})",
        f"status       {info['status']}{running}",
        f"family       {info.get('family') or 'gaussian'}, vfesim {info['vfesim_version']}",
        f"agents       {info['n_agents']}  ({_size_key(sc)})",
        f"backend      {info['backend']}, {info['dtype']}",
        *_chunking_lines(info.get("chunking")),
        f"integrator   {sc['integrator']['method']}, dt = {sc['integrator']['dt']}"
        + (f", friction = {sc['integrator']['friction']}" if "friction" in sc["integrator"] else ""),
        f"steps        {done if done is not None else 'none'} saved of {info['n_steps']} "
        f"({info['frames_saved']} frames, every {sc['run']['save_every']})",
        f"checkpoints  at steps {', '.join(map(str, info['checkpoints'])) or 'none'}"
        f" (every {sc['run']['checkpoint_every']}, {sc['output']['keep_checkpoints']} kept)",
        f"observables  {', '.join(info['observables']) or 'none'}  (per frame; docs/outputs.md)",
    ]
    if info["last_energies"]:
        lines.append(f"energies     at step {done}")
        width = max(map(len, info["last_energies"]))
        lines += [f"  {k:<{width}}  {v:.10g}" for k, v in info["last_energies"].items()]
    _out("\n".join(lines) + "\n\n" + scenario.rstrip("\n"))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vfesim`` command; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(quiet=args.quiet, verbose=args.verbose)
    from .integrators.base import DynamicsError
    from .io.store import StoreError
    from .simulate import RunError, Terminated

    progress = False if args.quiet else None
    try:
        if args.command == "scenarios" or (args.command == "run" and args.list):
            _list_scenarios()
        elif args.command == "run":
            from .simulate import simulate

            if args.scenario is None:
                parser.error("run: give a scenario file or the name of a shipped one (`vfesim scenarios`)")

            simulate(
                args.scenario,
                out=args.out,
                steps=args.steps,
                backend=args.backend,
                progress=progress,
                overwrite=args.overwrite,
            )
        elif args.command == "resume":
            from .simulate import resume

            resume(
                args.store,
                steps=args.steps,
                backend=args.backend,
                scenario=args.scenario,
                progress=progress,
                allow_version_change=args.allow_version_change,
            )
        elif args.command == "inspect":
            _inspect(args.store, args.json, args.scenario)
        elif args.command == "plot":
            from .plots import plot_run

            outdir = args.outdir or str(args.store).rstrip("/").removesuffix(".zarr") + "_plots"
            for p in plot_run(args.store, Path(outdir), time=args.time):
                log.info("wrote %s", p)
        elif args.command == "verify":
            return _verify(args.store)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    except DynamicsError:
        return 3  # already reported by the run loop, with the last good checkpoint
    except (StoreError, RunError) as e:
        log.error("%s", e)
        return 4
    except KeyboardInterrupt as e:  # SIGTERM arrives as Terminated during run and resume
        if not getattr(e, "vfesim_reported", False):
            log.error("%s", "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted")
        return 143 if isinstance(e, Terminated) else 130
    except Exception as e:  # a bug or an unexpected failure: say what, traceback with --verbose
        log.error("%s: %s", type(e).__name__, e, exc_info=args.verbose)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
