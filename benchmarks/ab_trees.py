"""A/B of code versions in one run: each version's ``vfesim`` and ``vfesim_kernels`` as a tree of its own,
timed by :mod:`bench_versions` in fresh processes, the versions alternated round by round (a GPU host's speed
then never enters a ratio).

    python benchmarks/ab_trees.py prepare 98e2754 HEAD          # here: .ab/<label>/ from git, WORKTREE too
    python benchmarks/ab_trees.py run --rounds 3 -- --backends cuda --n 65536 --dtypes float64
                                                                # there (the device, .ab carried along)

``prepare`` writes one tree per revision under ``--root`` (default ``.ab``, which git should ignore: add
``/.ab/`` to ``.git/info/exclude``), named by the revision as given (``WORKTREE``: the files as they are
now, uncommitted changes included). ``run`` times every tree under the root (or those named with
``--trees``), in the given order and then reversed, for ``--rounds`` rounds; the arguments after ``--``
go to bench_versions.py, whose lines it prints as they come (the label is the tree's name).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"vfesim": "vfesim", "kernels": "vfesim_kernels"}  # folder in the repository -> package name


def prepare(revs: list[str], root: Path) -> None:
    for rev in revs:
        dest = root / rev.replace("/", "_")
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for folder, package in PACKAGES.items():
            if rev == "WORKTREE":
                shutil.copytree(ROOT / folder, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
                continue
            tar = subprocess.run(["git", "archive", rev, folder], cwd=ROOT, capture_output=True, check=True)
            with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
                t.extractall(dest, filter="data")
            (dest / folder).rename(dest / package)
        print(f"{dest}: {rev}")


def run(root: Path, trees: list[str] | None, rounds: int, bench_args: list[str]) -> None:
    names = trees or sorted(p.name for p in root.iterdir() if (p / "vfesim").is_dir())
    if not names:
        raise SystemExit(f"no trees under {root} (run 'prepare' first)")
    script = ROOT / "benchmarks" / "bench_versions.py"
    header = True
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            path = os.pathsep.join([str((root / name).resolve()), os.environ.get("PYTHONPATH", "")])
            env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
            cmd = [sys.executable, str(script), "--label", name, *bench_args]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if header or not ln.lstrip().startswith("label")]
            header = False
            print("\n".join(lines), flush=True)
            if proc.returncode:
                sys.stderr.write(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT / ".ab")
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="one tree per git revision (or WORKTREE)")
    p.add_argument("revs", nargs="+")
    q = sub.add_parser("run", help="bench_versions.py over the trees, alternated")
    q.add_argument("--trees", nargs="*", default=None)
    q.add_argument("--rounds", type=int, default=2)
    q.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_versions.py's arguments")
    a = ap.parse_args()
    if a.verb == "prepare":
        prepare(a.revs, a.root)
    else:
        run(a.root, a.trees, a.rounds, [x for x in a.bench_args if x != "--"])


if __name__ == "__main__":
    main()
