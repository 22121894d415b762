"""The vfesim command: run -> resume -> inspect -> plot, exit codes and messages, progress."""

import io
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from vfesim.cli import main
from vfesim.io import open_run
from vfesim.progress import Progress
from vfesim.scenario import Scenario

SMALL = """
[model]
K = 3
kappa_beta = 2.0
[population]
n_agents = 6
seed = 3
[integrator]
method = "verlet"
dt = 0.05
friction = 0.1
[run]
n_steps = 8
save_every = 2
checkpoint_every = 4
"""


def write(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_run_resume_inspect_plot(tmp_path, capsys):
    toml = write(tmp_path, SMALL)
    out = tmp_path / "r.zarr"
    assert main(["run", str(toml), "--out", str(out), "--steps", "4", "-q"]) == 0
    assert open_run(out).sizes["time"] == 3
    assert main(["resume", str(out), "--steps", "8", "-q"]) == 0
    assert open_run(out)["step"].values.tolist() == [0, 2, 4, 6, 8]
    assert capsys.readouterr().err == ""  # -q: no bar, no INFO lines
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "status       complete" in text and "8 saved of 8" in text
    assert "energy_total" in text and "checkpoints  at steps 4, 8" in text
    assert "observables  attention_entropy, attention  (per frame" in text
    energies = text.split("energies     at step 8\n", 1)[1].split("\n\n")[0].split()[::2]
    assert energies[0] == "energy_total" and all(k.startswith("energy_") for k in energies)
    assert "family       gaussian" in text and "backend      numpy, float64" in text
    summary, scenario = text.split("\n\n", 1)
    assert max(map(len, text.splitlines())) < len(str(out)) + 40  # no one-line JSON dump
    assert tomllib.loads(scenario)["integrator"] == {
        "method": "verlet",
        "dt": 0.05,
        "friction": 0.1,
        "options": {},
    }
    assert scenario.index("[model]") < scenario.index("[population]") < scenario.index("[run]")
    assert main(["inspect", str(out), "--scenario"]) == 0
    again = write(tmp_path, capsys.readouterr().out, "again.toml")
    assert (
        Scenario.from_toml(again).to_dict()
        == Scenario.from_toml(toml).replace("output", path=str(out)).to_dict()
    )
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["frames_saved"] == 5 and info["scenario"]["integrator"]["method"] == "verlet"
    assert main(["plot", str(out), "--outdir", str(tmp_path / "png"), "-q"]) == 0
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert pngs == ["attention.png", "beliefs.png", "energy.png", "frames.png"]
    assert all((tmp_path / "png" / p).stat().st_size > 10_000 for p in pngs)


def test_last_step_off_the_save_grid_is_saved_and_resumed(tmp_path):
    from vfesim.io.store import RunStore
    from vfesim.simulate import simulate

    toml = write(tmp_path, SMALL)  # save_every = 2, checkpoint_every = 4, dt = 0.05
    out = tmp_path / "r.zarr"
    assert main(["run", str(toml), "--out", str(out), "--steps", "3", "-q"]) == 0
    ds = open_run(out)
    assert ds["step"].values.tolist() == [0, 2, 3]
    np.testing.assert_allclose(ds["time"].values, [0, 0.1, 0.15])
    assert RunStore(out).checkpoint_steps() == [0, 3]
    # Making room for a longer run drops the off-grid frame before its label changes.
    RunStore(out).extend(8, 2, 0.05)
    assert open_run(out)["step"].values.tolist() == [0, 2]
    every_step = simulate(toml, out=tmp_path / "ref.zarr", progress=False, run={"save_every": 1})
    ref = open_run(every_step.path).swap_dims(time="step")
    for steps, want in ((7, [0, 2, 4, 6, 7]), (8, [0, 2, 4, 6, 8])):
        assert main(["resume", str(out), "--steps", str(steps), "-q"]) == 0
        ds = open_run(out)
        assert ds["step"].values.tolist() == want
        for k in ("mu_q", "sigma_q", "phi", "energy_total", "time"):
            np.testing.assert_array_equal(ds[k].values, ref[k].sel(step=want).values, err_msg=k)
    assert main(["verify", str(out), "-q"]) == 0  # every chunk intact after the relabelling


def test_bad_scenario_exits_2_naming_the_key(tmp_path):
    toml = write(tmp_path, SMALL.replace("dt = 0.05", "dt = -0.05"))
    out = tmp_path / "r.zarr"
    r = subprocess.run(
        [sys.executable, "-m", "vfesim.cli", "run", str(toml), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "integrator.dt: must be > 0, got -0.05" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (("[run]", "[run]\nsteps = 3"), "run.steps: unknown key"),
        (('method = "verlet"', 'method = "rk45"'), "integrator.method: must be one of"),
        (("friction = 0.1", 'friction = "high"'), "integrator.friction: must be a real number"),
        (("n_agents = 6", "n_agents = 6\nmu_scale = -1"), "population.mu_scale: must be >= 0"),
    ],
)
def test_more_bad_scenarios(tmp_path, capsys, change, message):
    toml = write(tmp_path, SMALL.replace(*change))
    assert main(["run", str(toml), "--out", str(tmp_path / "r.zarr")]) == 2
    assert message in capsys.readouterr().err


def test_dynamics_failure_exits_3_with_report(tmp_path, capsys):
    toml = write(
        tmp_path,
        SMALL.replace('method = "verlet"', 'method = "gradient_flow"')
        .replace("friction = 0.1", "")
        .replace("dt = 0.05", "dt = 1000.0"),
    )
    out = tmp_path / "r.zarr"
    assert main(["run", str(toml), "--out", str(out)]) == 3
    err = capsys.readouterr().err
    assert "step 1: sigma_q[agent=0]: contains NaN or Inf" in err
    assert "last good checkpoint: step 0" in err
    ds = open_run(out)
    assert ds.attrs["status"].startswith("failed: step 1") and ds.sizes["time"] == 1


def test_unwritable_output_exits_4(tmp_path, capsys):
    toml = write(tmp_path, SMALL)
    (tmp_path / "file").write_text("x")
    assert main(["run", str(toml), "--out", str(tmp_path / "file" / "r.zarr")]) == 4
    assert "not writable" in capsys.readouterr().err


def test_resume_missing_store_exits_4(tmp_path, capsys):
    assert main(["resume", str(tmp_path / "nothing.zarr")]) == 4
    assert "not a vfesim run store" in capsys.readouterr().err


def test_output_path_from_scenario_is_used(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toml = write(tmp_path, SMALL + '[output]\npath = "from_toml.zarr"\n')
    assert main(["run", str(toml), "-q"]) == 0
    assert open_run(Path("from_toml.zarr")).sizes["time"] == 5


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_tty_fits_80_columns_and_silent_when_off():
    tty = _Tty()
    bar = Progress(1000, stream=tty)
    for i in range(1, 1001):
        bar.update(i, F=-123456.789 * i)
    bar.close()
    text = tty.getvalue()
    assert "step/s" in text and "F=-1.23457e+08" in text and "1000/1000" in text
    assert max(len(line) for line in text.replace("\r", "\n").splitlines()) <= 80
    quiet = _Tty()
    off = Progress(10, stream=quiet, enabled=False)
    off.update(5, 1.0)
    off.close()
    assert quiet.getvalue() == ""
    pipe = io.StringIO()  # not a TTY and the logger not configured: nothing at all
    Progress(10, stream=pipe).update(10, 1.0)
    assert pipe.getvalue() == ""


def test_progress_of_a_run_quiet_or_shown(tmp_path, capsys):
    from vfesim.simulate import simulate

    toml = write(tmp_path, SMALL)
    simulate(toml, out=tmp_path / "a.zarr", progress=False)
    assert capsys.readouterr().err == ""
    simulate(toml, out=tmp_path / "b.zarr", progress=True)
    err = capsys.readouterr().err
    assert "8/8" in err and "step/s" in err and "F=" in err


def test_version_and_python_dash_m(capsys):
    import vfesim

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"vfesim {vfesim.__version__}"
    r = subprocess.run([sys.executable, "-m", "vfesim", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"vfesim {vfesim.__version__}"


def test_cli_run_matches_python_api(tmp_path):
    from vfesim.simulate import simulate

    toml = write(tmp_path, SMALL)
    assert main(["run", str(toml), "--out", str(tmp_path / "a.zarr"), "-q"]) == 0
    run = simulate(toml, out=tmp_path / "b.zarr", progress=False)
    a = open_run(tmp_path / "a.zarr")
    np.testing.assert_array_equal(a["mu_q"].values[-1], run.state["mu_q"].values)


def test_scenario_with_several_mistakes_reports_all_and_exits_2(tmp_path, capsys):
    toml = write(
        tmp_path,
        SMALL.replace("dt = 0.05", "dt = -0.05")
        .replace("n_agents = 6", "n_agnets = 6")
        .replace("save_every = 2", 'save_every = "2"'),
    )
    assert main(["run", str(toml), "--out", str(tmp_path / "r.zarr")]) == 2
    err = capsys.readouterr().err
    assert f"{toml}: 4 problems:" in err
    for line in (
        "population.n_agnets: unknown key; did you mean 'n_agents'?",
        "population.n_agents: is required",
        "integrator.dt: must be > 0, got -0.05",
        "run.save_every: must be an integer, got str '2'",
    ):
        assert f"\n  {line}" in err
    assert not (tmp_path / "r.zarr").exists()


def test_shipped_scenarios_listed_and_run_by_name(tmp_path, capsys, monkeypatch):
    from vfesim.scenario import packaged_scenarios

    shipped = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "scenarios").glob("*.toml"))
    assert list(packaged_scenarios()) == shipped and "consensus" in shipped
    assert main(["scenarios"]) == 0
    listing = capsys.readouterr().out
    assert main(["run", "--list"]) == 0
    assert capsys.readouterr().out == listing
    for name in shipped:
        assert any(line.startswith(f"{name}  ") for line in listing.splitlines()), name
    assert re.search(
        r"^inertia +Inertia: Hamiltonian \(Verlet\) dynamics with light friction\.$", listing, re.M
    )
    monkeypatch.chdir(tmp_path)  # a name, not a path: found among the shipped scenarios
    assert main(["run", "inertia", "--out", "i.zarr", "--steps", "2", "-q"]) == 0
    assert json.loads(open_run("i.zarr").attrs["scenario"])["name"] == "inertia"
    write(tmp_path, SMALL, "inertia.toml")  # a file of that name here wins over the shipped one
    assert main(["run", "inertia.toml", "--out", "mine.zarr", "-q"]) == 0
    assert open_run("mine.zarr").sizes["agent"] == 6


def test_unknown_scenario_name_lists_the_shipped_ones(tmp_path, capsys):
    assert main(["run", "concensus", "--out", str(tmp_path / "r.zarr")]) == 2
    err = capsys.readouterr().err
    assert (
        "concensus: no such scenario file, nor a scenario shipped with vfesim; did you mean 'consensus'?"
        in err
    )
    shipped = ", ".join(
        sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "scenarios").glob("*.toml"))
    )
    assert f"shipped: {shipped};" in err and "consensus, decoherence" in shipped
    assert main(["run", str(tmp_path / "nothing.toml"), "--out", str(tmp_path / "r.zarr")]) == 2
    assert "nothing.toml: scenario file not found" in capsys.readouterr().err  # a path: as before
    with pytest.raises(SystemExit) as e:
        main(["run"])
    assert e.value.code == 2 and "give a scenario file or the name" in capsys.readouterr().err
