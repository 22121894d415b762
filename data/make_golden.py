"""Write the golden trajectories in data/ (float64, numpy backend).

Run from the repository root: ``python -m data.make_golden``. Each file ``golden_<name>.npz`` holds
``step`` (T,), the state variables ``mu_q, sigma_q, mu_p, sigma_p, phi`` (T, N, ...), every energy
term ``energy_*`` (T,), the observables a run saves by default (``attention_entropy``,
``attention``), and ``scenario`` (the resolved scenario JSON, a 0-d string array).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from vfesim.io import open_run
from vfesim.scenario import Scenario
from vfesim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]

# Shortened copies of two shipped scenarios: few agents, few steps, float64, numpy backend.
GOLDEN = {
    "consensus": {
        "population": {"n_agents": 12},
        "run": {"n_steps": 20, "save_every": 2, "checkpoint_every": 20, "backend": "numpy"},
    },
    "inertia": {
        "population": {"n_agents": 10},
        "run": {"n_steps": 30, "save_every": 3, "checkpoint_every": 30, "backend": "numpy"},
    },
}


def golden_scenario(name: str) -> Scenario:
    base = Scenario.from_toml(ROOT / "scenarios" / f"{name}.toml")
    d = base.to_dict()
    for sec, changes in GOLDEN[name].items():
        d[sec] = {**d[sec], **changes}
    d["run"]["dtype"] = "float64"
    d["output"].pop("path", None)
    return Scenario.from_dict(d, name=name)


def trajectory(scn: Scenario, workdir: Path) -> dict[str, np.ndarray]:
    """Run ``scn`` into ``workdir`` and return the arrays stored in a golden file."""
    run = simulate(scn, out=workdir / f"{scn.name}.zarr", progress=False)
    ds = open_run(run.path).load()
    out = {"step": ds["step"].values}
    for k in ds.data_vars:
        if k != "saved" and "time" in ds[k].dims:
            out[k] = ds[k].values
    out["scenario"] = np.array(scn.to_json())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outdir", default=str(ROOT / "data"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for name in GOLDEN:
            arrays = trajectory(golden_scenario(name), Path(tmp))
            np.savez_compressed(Path(args.outdir) / f"golden_{name}.npz", **arrays)


if __name__ == "__main__":
    main()
