"""Field-agent runs (issue 14 "Runs"): [field] scenarios validated whole, run and resume bitwise, Zarr
trajectories with the grid dims and coordinates, support-weighted observables, the CLI on the shipped
2-D scenario by name, and the plots."""

from __future__ import annotations

import json

import numpy as np
import pytest

import vfesim
from vfesim.cli import main
from vfesim.fields import FieldConfig
from vfesim.fields.energy import attention as field_attention
from vfesim.io import RunStore, open_run
from vfesim.observables import Observables
from vfesim.scenario import Scenario, ScenarioError, load_scenario, read_toml
from vfesim.simulate import resume, simulate

SMALL = """
[field]
K = 3
grid = [6, 5]
lambda_prior = 0.5
kappa_beta = 2.0
lambda_phi = 0.3
[population]
n_agents = 4
seed = 3
support = "disc"
radius = 1.8
placement = "lattice"
[integrator]
method = "verlet"
dt = 0.02
[run]
n_steps = 8
save_every = 2
checkpoint_every = 4
seed = 5
[output]
time_chunk = 2
observables = ["belief_spread", "mean_frame_angle", "attention_entropy", "attention"]
"""


def _toml(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# ------------------------------------------------------------------------------------------- scenarios


def test_every_problem_reported_at_once():
    d = {
        "field": {"K": 3, "grid": [0, 4], "lamda_belief": 1.0, "boundary": "torus", "lambda_phi": -1.0,
                  "neighbours": "dense"},
        "population": {"seed": 1, "support": "bump", "radius": 2.0, "placement": "lattic",
                       "neighbours": "ring", "phi_radius": 4.0},
        "integrator": {"method": "verlett"},
        "run": {"n_steps": 4, "backend": "cupy", "dtype": "complex128"},
    }  # fmt: skip
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict(d)
    got = dict(exc.value.errors)
    assert "integer >= 1" in got["field.grid"]
    assert "did you mean 'lambda_belief'" in got["field.lamda_belief"]
    assert "periodic" in got["field.boundary"] and ">= 0" in got["field.lambda_phi"]
    assert got["field.neighbours"] == "set it in population.neighbours"
    assert got["population.n_agents"] == "is required"
    assert "not used with support = 'bump'" in got["population.radius"]
    assert "did you mean 'lattice'" in got["population.placement"]
    assert "is required with neighbours = 'ring'" in got["population.half_width"]
    assert "< 3.14159" in got["population.phi_radius"]
    assert "did you mean 'verlet'" in got["integrator.method"] and got["integrator.dt"] == "is required"
    assert "numba" in got["run.backend"] and "float64" in got["run.dtype"]
    assert len(got) == 14, got
    # keys that need each other are checked together, once the rest is right
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict({"field": {"grid": [4], "W": [[1.0, 0.0]], "lambda_obs": 1.0},
                            "population": {"n_agents": 2}, "integrator": {"dt": 0.1},
                            "run": {"n_steps": 1}})  # fmt: skip
    assert list(dict(exc.value.errors)) == ["field.K"]


def test_defaults_resolve_and_round_trip(tmp_path):
    s = Scenario.from_toml(_toml(tmp_path, SMALL))
    assert isinstance(s.model, FieldConfig) and s.model.grid == (6, 5) and s.model.neighbours == "overlap"
    assert s.run["dtype"] == "float64" and s.population["support"] == "disc"
    assert Scenario.from_json(s.to_json()).to_dict() == s.to_dict()
    text = s.to_toml()
    assert text.startswith("[field]\n") and "grid = [6, 5]" in text
    assert Scenario.from_toml(_toml(tmp_path, text, "back.toml")).to_dict() == s.to_dict()
    ring = load_scenario({"field": {"K": 3, "grid": [5]}, "population": {"n_agents": 5, "neighbours": "ring",
                          "half_width": 1}, "integrator": {"dt": 0.1}, "run": {"n_steps": 1}})  # fmt: skip
    assert ring.model.neighbours.index.shape == (5, 2)


# ------------------------------------------------------------------------------------------ run/resume


def test_run_then_resume_is_bitwise_and_keeps_the_grid(tmp_path):
    toml = _toml(tmp_path, SMALL)
    ref = simulate(read_toml(toml), out=tmp_path / "ref.zarr", progress=False)
    simulate(read_toml(toml), out=tmp_path / "a.zarr", steps=4, progress=False)
    ckpt = RunStore(tmp_path / "a.zarr").latest_checkpoint()
    out = ckpt.state.support.values == 0
    assert out.any() and not ckpt.aux["p_mu_q"][out].any()  # momenta at rest outside the supports
    back = resume(tmp_path / "a.zarr", steps=8, progress=False)
    x, y = open_run(tmp_path / "ref.zarr").load(), open_run(tmp_path / "a.zarr").load()
    for k in x.data_vars:
        np.testing.assert_array_equal(x[k].values, y[k].values, err_msg=k)
    assert back.terms == ref.terms and back.step == 8
    # the trajectory keeps the grid dims and coordinates; the support is saved once
    assert x.mu_q.dims == ("time", "agent", "x", "y", "latent")
    assert x.sigma_q.dims == ("time", "agent", "x", "y", "latent", "latent_b")
    assert x.support.dims == ("agent", "x", "y") and x.phi.dims[-1] == "gauge"
    assert x.x.values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and x.y.size == 5
    assert x.x.attrs["long_name"].startswith("grid coordinate x")
    assert x.attrs["agent_family"] == "field" and x.sizes["time"] == 5
    assert x.attention.dims == ("time", "agent", "agent_j") and x.attention_entropy.dims == ("time", "agent")
    assert "support-weighted" in x.attention.attrs["long_name"]
    H = x.energy_hamiltonian.values
    assert np.all(np.isfinite(H)) and x.energy_gauge_smoothness.values[0] > 0
    np.testing.assert_array_equal(x.mu_q.values[:, out], x.mu_q.values[:1, out].repeat(5, 0))


def test_simulate_takes_a_field_config_and_guards_the_run(tmp_path):
    cfg = FieldConfig(K=3, grid=(5,), lambda_prior=0.3)
    run = simulate(cfg, out=tmp_path / "r.zarr", progress=False, population={"n_agents": 3, "seed": 1},
                   integrator={"method": "gradient_flow", "dt": 0.05}, run={"n_steps": 3})  # fmt: skip
    ds = open_run(run.path)
    assert (
        ds.mu_q.dims == ("time", "agent", "x", "latent") and ds.energy_total.values[-1] < ds.energy_total[0]
    )
    assert json.loads(ds.attrs["scenario"])["scenario"]["field"]["grid"] == [5]
    with pytest.raises(ScenarioError, match="integrator: method 'gradient_flow': unknown option"):
        simulate(cfg, out=tmp_path / "b.zarr", progress=False, population={"n_agents": 3},
                 integrator={"dt": 0.05, "options": {"mass": 1.0}}, run={"n_steps": 1})  # fmt: skip


# ---------------------------------------------------------------------------------------- observables


def test_field_observables_are_support_weighted_sums():
    cfg = FieldConfig(K=3, grid=(4, 3), kappa_beta=1.5)
    st = vfesim.random_state(cfg, 4, seed=2, support="disc", radius=1.6)
    obs = Observables(["belief_spread", "mean_frame_angle", "attention_entropy", "attention"], cfg, 4)
    v = obs.evaluate(st)
    chi, mu = st.support.values, st.mu_q.values
    local = (chi[..., None] * mu).sum(0) / np.maximum(chi.sum(0), 1e-300)[..., None]
    spread = np.sqrt((chi * ((mu - local) ** 2).sum(-1)).sum() / chi.sum())
    assert v["belief_spread"] == pytest.approx(spread, rel=1e-12)
    beta = field_attention({k: st[k].values for k in st.data_vars}, cfg)  # (N, x, y, k)
    H = -np.sum(np.where(beta > 0, beta * np.log(np.where(beta > 0, beta, 1)), 0), axis=-1)
    np.testing.assert_allclose(v["attention_entropy"], (chi * H).sum((1, 2)) / chi.sum((1, 2)), rtol=1e-12)
    A = v["attention"]
    assert A.shape == (4, 4) and np.all(np.diag(A) == 0) and np.all(A.sum(1) <= 1 + 1e-12)
    # identical beliefs everywhere: no local spread
    same = st.assign(mu_q=st.mu_q * 0 + mu[0, 0, 0])
    assert obs.evaluate(same)["belief_spread"] == pytest.approx(0.0, abs=1e-12)
    da = vfesim.attention(st, cfg)
    assert da.dims == ("agent", "x", "y", "neighbour") and "sender" in da.coords
    np.testing.assert_array_equal(da.values, beta)


# ---------------------------------------------------------------------------------------- CLI, plots


def test_cli_runs_the_shipped_2d_scenario_by_name_inspects_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "field_consensus", "--out", "f.zarr", "--steps", "2", "-q"]) == 0
    assert main(["inspect", "f.zarr"]) == 0
    out = capsys.readouterr().out
    assert "family       field" in out and "(K = 3, grid = [32, 32])" in out and "[field]\n" in out
    assert main(["resume", "f.zarr", "--steps", "3", "-q"]) == 0
    ds = open_run("f.zarr")
    assert ds["step"].values.tolist() == [0, 3] and ds.mu_q.sizes["x"] == 32
    assert main(["plot", "f.zarr", "--outdir", "p", "--time", "0.3", "-q"]) == 0
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert names == ["agents.png", "animation.gif", "energy.png", "maps.png"]
    assert all((tmp_path / "p" / n).stat().st_size > 10_000 for n in names)


def test_plots_of_a_1d_run_and_time_refused_elsewhere(tmp_path, capsys):
    d = read_toml(_toml(tmp_path, SMALL))
    d["field"]["grid"] = [12]
    d["population"] |= {"support": "bump", "area": 5.0}
    d["population"].pop("radius")
    d["run"]["n_steps"] = 2
    simulate(d, out=tmp_path / "one.zarr", progress=False)
    assert main(["plot", str(tmp_path / "one.zarr"), "--outdir", str(tmp_path / "p"), "-q"]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["agents.png", "energy.png", "maps.png"]
    g = {"model": {"K": 3}, "population": {"n_agents": 3}, "integrator": {"dt": 0.1}, "run": {"n_steps": 1}}
    simulate(g, out=tmp_path / "g.zarr", progress=False)
    assert main(["plot", str(tmp_path / "g.zarr"), "--time", "0", "-q"]) == 1
    assert "maps at a chosen time are drawn for field runs" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["gradient_flow", "verlet"])
def test_dask_runs_equal_the_numpy_run(tmp_path, method):
    """A field run on the dask backend (agents in uneven chunks, every frame saved, two frames per
    checkpoint: the first checkpoint writes one frame into a two-frame time chunk) gives the numpy
    run's trajectory: Hamiltonian momenta at rest outside the supports as in memory."""
    d = read_toml(_toml(tmp_path, SMALL))
    d["integrator"]["method"] = method
    d["run"].update(n_steps=3, save_every=1, checkpoint_every=2)
    d["output"].pop("time_chunk")
    ref = simulate(d, out=tmp_path / "ref.zarr", progress=False)
    d["run"].update(backend="dask", chunks=3)
    run = simulate(d, out=tmp_path / "dask.zarr", progress=False)
    x, y = open_run(tmp_path / "ref.zarr").load(), open_run(tmp_path / "dask.zarr").load()
    assert json.loads(y.attrs["chunking"])["chunks"] == [3, 1]
    for k in ("mu_q", "sigma_q", "phi", "energy_total", "belief_spread"):
        np.testing.assert_allclose(y[k].values, x[k].values, rtol=1e-12, atol=1e-14, err_msg=k)
    assert run.step == ref.step == 3
