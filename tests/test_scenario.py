"""Scenario validation: every bad key is named, defaults resolve, scenarios/*.toml load."""

import tomllib
from pathlib import Path

import numpy as np
import pytest

from vfesim.scenario import Scenario, ScenarioError, load_scenario, to_toml

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"

GOOD = {
    "model": {"K": 3},
    "population": {"n_agents": 5},
    "integrator": {"dt": 0.1},
    "run": {"n_steps": 4},
}


def with_(section, **kv):
    d = {k: dict(v) for k, v in GOOD.items()}
    d.setdefault(section, {}).update(kv)
    return d


def test_defaults_resolve_and_round_trip():
    s = Scenario.from_dict(GOOD)
    assert s.run["checkpoint_every"] == 4 and s.run["backend"] == "numpy"
    assert s.integrator["method"] == "gradient_flow" and s.output["keep_checkpoints"] == 2
    again = Scenario.from_json(s.to_json())
    assert again.to_dict() == s.to_dict() and again.model == s.model


@pytest.mark.parametrize(
    "section, kv, key",
    [
        ("integrator", {"dt": 0.0}, "integrator.dt: must be > 0"),
        ("integrator", {"dt": -1}, "integrator.dt: must be > 0"),
        ("integrator", {"dt": "fast"}, "integrator.dt: must be a real number"),
        ("integrator", {"method": "rk4"}, "integrator.method: must be one of"),
        ("integrator", {"friction": -0.1}, "integrator.friction: must be >= 0"),
        ("integrator", {"stepsize": 1}, "integrator.stepsize: unknown key"),
        ("integrator", {"options": {"x": [1, 2]}}, "integrator.options.x"),
        ("run", {"n_steps": 0}, "run.n_steps: must be >= 1"),
        ("run", {"n_steps": 2.5}, "run.n_steps: must be an integer"),
        ("run", {"n_steps": True}, "run.n_steps: must be an integer"),
        ("run", {"save_every": 0}, "run.save_every: must be >= 1"),
        ("run", {"checkpoint_every": 0}, "run.checkpoint_every: must be >= 1"),
        ("run", {"dtype": "float16"}, "run.dtype: must be one of"),
        ("run", {"backend": "fortran"}, "run.backend: must be one of"),
        ("run", {"seed": -1}, "run.seed: must be >= 0"),
        ("model", {"lambda_self": -1.0}, "model.lambda_self: must be >= 0"),
        ("model", {"kappa_beta": 0}, "model.kappa_beta: must be > 0"),
        ("model", {"K": 4}, "model.K: a single so(3) irrep"),
        ("model", {"lambda_obs": 1.0}, "model.W: lambda_obs > 0 needs"),
        ("model", {"temperature": 1.0}, "model.temperature: unknown key"),
        ("model", {"dtype": "float32"}, "model.dtype: set the dtype in run.dtype"),
        ("model", {"W": [[1.0, 0, 0]], "R": [[-1.0]]}, "model.R: must be positive definite"),
        ("population", {"n_agents": 1}, "population.n_agents: must be >= 2"),
        ("population", {"phi_radius": 4.0}, "population.phi_radius: must be < pi"),
        ("population", {"eig_range": [2.0, 1.0]}, "population.eig_range: needs lo <= hi"),
        ("population", {"eig_range": [0.0, 1.0]}, "population.eig_range: must be > 0"),
        ("population", {"neighbours": "ring"}, "population.half_width: is required"),
        ("population", {"neighbours": "ring", "half_width": 3}, "population.half_width: 2*half"),
        ("population", {"neighbours": "knn"}, "population.neighbours: must be one of"),
        ("population", {"camps": 2}, "population.camp_offset: must be > 0"),
        ("output", {"keep_checkpoints": 1}, "output.keep_checkpoints: must be >= 2"),
        ("output", {"path": 3}, "output.path: must be a string"),
        ("extra", {"a": 1}, "extra: unknown section"),
    ],
)
def test_bad_values_name_the_key(section, kv, key):
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict(with_(section, **kv))
    assert key in str(e.value)


def test_required_keys():
    for section, key in (
        ("model", "K"),
        ("population", "n_agents"),
        ("integrator", "dt"),
        ("run", "n_steps"),
    ):
        d = {k: dict(v) for k, v in GOOD.items()}
        del d[section][key]
        with pytest.raises(ScenarioError, match=f"{section}.{key}"):
            Scenario.from_dict(d)


def test_toml_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nK = 3")
    with pytest.raises(ScenarioError, match="invalid TOML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "missing.toml")


def test_binary_scenario_file_is_named(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(
        ScenarioError, match=r"model.bin: not a text \(UTF-8\) TOML file: byte 0x80 at offset 128"
    ):
        load_scenario(binary)


def test_population_too_large_for_memory_names_the_key(monkeypatch):
    import vfesim.scenario as sc

    monkeypatch.setattr(sc, "physical_memory", lambda: 16 * 2**30)
    with pytest.raises(ScenarioError, match=r"^model.K: 5 agents with K = 100001 .* need at least 2.4 TiB"):
        Scenario.from_dict(with_("model", K=100001))
    with pytest.raises(ScenarioError, match=r"^population.n_agents: 10000000000 agents with K = 3 .* 16 GiB"):
        Scenario.from_dict(with_("population", n_agents=10**10))
    assert sc.run_memory_bytes(5, 3, 0, "float64") < 2**20
    Scenario.from_dict(with_("population", n_agents=10**6))  # 0.5 GiB: fits


@pytest.mark.parametrize(
    "key, value, variable",
    [("mu_scale", 1e308, "mu_q"), ("prior_mu_scale", 1e308, "mu_p"), ("eig_range", [1.0, 1e308], "sigma_q")],
)
def test_bad_population_scale_blames_the_key_written(key, value, variable):
    s = Scenario.from_dict(with_("population", n_agents=50, **{key: value}))
    with pytest.raises(ScenarioError, match=rf"^population.{key}: {key} = .* gives {variable}\[agent="):
        s.initial_state()


def test_ring_and_camps_build_the_population():
    s = Scenario.from_dict(
        with_(
            "population", n_agents=6, neighbours="ring", half_width=1, camps=2, camp_offset=4.0, mu_scale=0.0
        )
    )
    assert s.model.neighbours.width == 2
    state = s.initial_state()
    mu_p = state["mu_p"].values
    np.testing.assert_allclose(mu_p[0::2, 0] - mu_p[1::2, 0], 4.0)
    assert s.initial_state().identical(state)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_scenarios_validate(path):
    s = load_scenario(path)
    assert s.name == path.stem and s.run["n_steps"] >= 1


@pytest.mark.parametrize("name", ["consensus", "polarization", "inertia", "observation"])
def test_shipped_scenarios_run_a_few_steps(name, tmp_path):
    from vfesim.io import open_run
    from vfesim.simulate import simulate

    s = load_scenario(SCENARIOS / f"{name}.toml")
    steps = 2 * s.run["save_every"]
    run = simulate(s, out=tmp_path / "r.zarr", steps=steps, progress=False)
    ds = open_run(run.path)
    assert run.step == steps and ds.sizes["time"] == 3
    F = ds["energy_total"].values
    assert np.isfinite(F).all() and F[-1] < F[0]
    if name == "inertia":
        assert ds["energy_kinetic"].values[-1] > 0
    if name == "observation":
        assert ds["energy_observation"].values[0] > 0 and "obs" in ds
    if name == "polarization":
        mu_p = ds["mu_p"].values[0]
        assert abs(mu_p[0::2, 0].mean() - mu_p[1::2, 0].mean()) > 6


def test_all_mistakes_reported_at_once_with_suggestions(tmp_path):
    toml = tmp_path / "many.toml"
    toml.write_text(
        "[modle]\nK = 3\n"
        "[population]\nn_agents = 1\nmu_scale = -2.0\n"
        "[integrator]\nmethod = 'verlett'\ndt = 0.1\n"
        "[run]\nn_step = 4\nbackend = 'numpy'\n"
        "[output]\nkeep_checkpoint = 3\ndt = 0.5\n"
    )
    with pytest.raises(ScenarioError) as e:
        load_scenario(toml)
    msg = str(e.value)
    assert msg.startswith(f"{toml}: 9 problems:\n")
    want = [
        ("modle", "unknown section; did you mean 'model'?"),
        ("population.n_agents", "must be >= 2, got 1"),
        ("population.mu_scale", "must be >= 0, got -2.0"),
        ("integrator.method", "got 'verlett'; did you mean 'verlet'?"),
        ("run.n_step", "unknown key; did you mean 'n_steps'?"),
        ("run.n_steps", "is required"),
        ("output.keep_checkpoint", "unknown key; did you mean 'keep_checkpoints'?"),
        ("output.dt", "unknown key; it belongs in [integrator] (integrator.dt)"),
        ("model.K", "is required (or model.irreps)"),
    ]
    assert [k for k, _ in e.value.errors] == [k for k, _ in want]
    for (key, text), (_, message) in zip(want, e.value.errors, strict=True):
        assert text in message, key
        assert f"\n  {key}: {message}" in msg
    assert e.value.key == "modle" and e.value.source == str(toml)


def test_one_mistake_reads_as_before_and_names_the_file(tmp_path):
    toml = tmp_path / "one.toml"
    toml.write_text("[model]\nK = 3\n[population]\nn_agents = 5\n[integrator]\ndt = -1.0\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(toml)
    assert (
        str(e.value)
        == f"{toml}: 2 problems:\n  integrator.dt: must be > 0, got -1.0\n  run.n_steps: is required"
    )
    toml.write_text(toml.read_text() + "[run]\nn_steps = 2\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(toml)
    assert str(e.value) == f"{toml}: integrator.dt: must be > 0, got -1.0"
    assert e.value.errors == [("integrator.dt", "must be > 0, got -1.0")]


def test_model_value_and_unknown_model_key_together():
    d = with_("model", kappa_beta=0, temprature=1.0)
    d["run"]["dtype"] = "float16"
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict(d)
    keys = [k for k, _ in e.value.errors]
    # A bad run.dtype leaves the model unbuilt: its unknown keys are still reported.
    assert keys == ["run.dtype", "model.temprature"]
    d["run"]["dtype"] = "float64"
    with pytest.raises(ScenarioError) as e:
        Scenario.from_dict(d)
    assert [k for k, _ in e.value.errors] == ["model.temprature"]
    del d["model"]["temprature"]
    with pytest.raises(ScenarioError, match="^model.kappa_beta: must be > 0"):
        Scenario.from_dict(d)


def test_to_toml_round_trips_matrices_nested_options_and_odd_strings(tmp_path):
    s = Scenario.from_dict(
        {
            **GOOD,
            "model": {
                "K": 3,
                "lambda_obs": 1.0,
                "W": [[1.0, 0.0, 0.0], [0.0, 1e-300, 0.5]],
                "R": [[1.0, 0], [0, 2]],
            },
            "integrator": {
                "method": "verlet",
                "dt": 0.1,
                "options": {"mass": {"mu_q": 2.0}, "momenta": "zero"},
            },
            "output": {"path": 'a "quoted" dir\\r.zarr'},
        }
    )
    text = s.to_toml()
    assert "[[" not in text.replace("W = [[", "").replace(
        "R = [[", ""
    )  # matrices inline, no arrays of tables
    assert tomllib.loads(text) == s.to_dict()
    (tmp_path / "s.toml").write_text(text)
    again = Scenario.from_toml(tmp_path / "s.toml")
    assert again.to_dict() == s.to_dict() and again.model == s.model
    assert to_toml({"run": {"x": float("inf"), "y": True, "odd key": -3}}) == (
        '[run]\nx = inf\ny = true\n"odd key" = -3\n'
    )
    with pytest.raises(TypeError, match="cannot write object"):
        to_toml({"run": {"x": object()}})
