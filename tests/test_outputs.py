"""The output schema (docs/outputs.md): energy names, CF attributes, coordinates, population labels,
attention, observables, agent chunks, reading without Dask and old store formats."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import vfesim
from tests.reference.loop import reference_attention
from vfesim import schema
from vfesim.family import families
from vfesim.io import open_run, store
from vfesim.observables import BUILTINS, Observables, attention_entropy, rotation_angle
from vfesim.scenario import Scenario, ScenarioError
from vfesim.simulate import RunError, resume, simulate

DOCS = Path(__file__).resolve().parents[1] / "docs" / "outputs.md"
GAUSSIAN_TERMS = ("self", "belief_align", "prior_align", "observation")

BASE = {
    "model": {"K": 3, "lambda_belief": 1.0, "kappa_beta": 2.0},
    "population": {"n_agents": 6, "seed": 1},
    "integrator": {"method": "gradient_flow", "dt": 0.02},
    "run": {"n_steps": 8, "save_every": 2, "checkpoint_every": 4},
}


def scenario(**changes) -> Scenario:
    d = {k: dict(v) for k, v in BASE.items()}
    for sec, kv in changes.items():
        d.setdefault(sec, {}).update(kv)
    return Scenario.from_dict(d)


def assert_labelled(ds):
    """Every variable and coordinate carries a non-empty long_name and units."""
    for name, v in ds.variables.items():
        assert v.attrs.get("long_name") and v.attrs.get("units"), f"{name}: attrs {v.attrs}"


# --- names and attributes ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gradient_flow", "verlet"])
def test_gaussian_history_uses_the_energy_names_over_time(method):
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 5, seed=2)
    final, hist = vfesim.run_dynamics(state, cfg, method, dt=0.01, n_steps=5, record_every=2)
    extra = ["kinetic", "hamiltonian"] if method == "verlet" else []
    assert set(hist.data_vars) == {f"energy_{t}" for t in ("total", *GAUSSIAN_TERMS, *extra)}
    assert hist.energy_total.dims == ("time",)
    np.testing.assert_array_equal(hist.step.values, [0, 2, 4, 5])
    np.testing.assert_allclose(hist.time.values, 0.01 * np.array([0, 2, 4, 5]), rtol=0, atol=1e-15)
    assert hist.energy_total.attrs == {"long_name": "free energy F (sum of its terms)", "units": "nats"}
    assert hist.time.attrs["units"] == "model time units"
    assert_labelled(hist)
    assert_labelled(final)  # integrator states keep the attributes of make_state


def test_quantum_history_uses_the_same_names():
    cfg = vfesim.QuantumConfig(d=2)
    qs = vfesim.random_state(cfg, 4, seed=0)
    final, hist = vfesim.run_dynamics(qs, cfg, "mirror_descent", dt=0.05, n_steps=3)
    energies = {k for k in hist.data_vars if k.startswith("energy_")}
    assert energies == {f"energy_{t}" for t in ("total", *GAUSSIAN_TERMS)}
    assert hist.agent_purity.dims == ("time", "agent") and hist.step.values.tolist() == [0, 1, 2, 3]
    assert hist.agent_entropy.attrs["units"] == "nats"
    assert_labelled(hist)
    assert_labelled(final)


def test_store_energies_match_history_names(tmp_path):
    scn = scenario(integrator={"method": "verlet", "dt": 0.02})
    ds = simulate(scn, out=tmp_path / "r.zarr", progress=False).open()
    state = scn.initial_state()
    _, hist = vfesim.run_dynamics(state, scn.model, "verlet", dt=0.02, n_steps=8, record_every=2)
    energies = sorted(k for k in ds.data_vars if k.startswith("energy_"))
    assert energies == sorted(hist.data_vars)
    np.testing.assert_allclose(ds.energy_total.values, hist.energy_total.values, rtol=1e-12)
    np.testing.assert_array_equal(ds.step.values, hist.step.values)
    assert_labelled(ds)
    assert ds.phi.attrs["units"] == "rad" and ds.energy_kinetic.attrs["units"] == "nats"


@pytest.mark.parametrize("family", ["gaussian", "quantum"])
def test_states_and_gradients_carry_attrs_and_coordinates(family):
    if family == "gaussian":
        cfg = vfesim.ModelConfig(K=3, lambda_obs=1.0, W=np.ones((2, 3)), R=np.eye(2))
        dims = {"latent": 3, "latent_b": 3, "gauge": 3, "obs_dim": 2}
    else:
        cfg = vfesim.QuantumConfig(d=3)
        dims = {"bra": 3, "ket": 3, "gauge": 3}
    state = vfesim.random_state(cfg, 4, seed=1)
    assert_labelled(state)
    for d, n in dims.items():
        np.testing.assert_array_equal(state[d].values, np.arange(n))
    assert "agent" not in state.coords
    _, grads = vfesim.energy_and_gradient(state, cfg)
    assert_labelled(grads)
    assert grads.phi.attrs["units"] == "nats rad-1"
    assert grads[next(iter(grads.data_vars))].attrs["long_name"].startswith("gradient of F")
    again = vfesim.make_state(cfg, *(state[k].values for k in state.data_vars))
    assert all(again[k].attrs == state[k].attrs for k in state.data_vars)


def test_gradient_dataset_has_the_state_coordinates_and_no_file_encoding(tmp_path):
    """A gradient Dataset keeps every coordinate of the state (also when a variable has no gradient) and
    none of the state's file encoding (a state opened from a store names that store in its encoding)."""
    from vfesim.backends import gradient_dataset

    cfg = vfesim.ModelConfig(K=3, lambda_obs=1.0, W=np.ones((2, 3)), R=np.eye(2))
    state = vfesim.random_state(cfg, 4, seed=2)
    state.to_zarr(tmp_path / "s.zarr", zarr_format=3, consolidated=False)
    opened = xr.open_zarr(tmp_path / "s.zarr", zarr_format=3, consolidated=False).load()
    assert opened.encoding  # the store's path
    _, grads = vfesim.energy_and_gradient(opened, cfg)
    assert grads.encoding == {} and all(grads[k].encoding == {} for k in grads.data_vars)
    assert grads.coords.to_dataset().identical(opened.coords.to_dataset())
    some = gradient_dataset(state, {k: np.zeros_like(state[k].values) for k in ("mu_q", "phi")})
    assert list(some.data_vars) == ["mu_q", "phi"] and list(some.coords) == list(state.coords)
    assert dict(some.sizes) == dict(state.sizes)


def _docs_rows() -> dict[str, tuple[str, str]]:
    """name -> (long_name, units) of every table row of docs/outputs.md whose name is one backticked word."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = (
            [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            if line.startswith("|")
            else []
        )
        if len(cells) >= 4 and (m := re.fullmatch(r"`(\w+)`( \(density-matrix\))?", cells[0])):
            key = m[1] + ("/quantum" if m[2] else "")
            rows[key] = (cells[-2].replace("\\|", "|"), cells[-1])
    return rows


def test_docs_table_lists_every_variable_with_its_attributes():
    rows = _docs_rows()
    expected = {schema.term_var(t): schema.attrs_of(schema.term_var(t)) for t in schema.ENERGIES}
    expected.update({k: schema.attrs_of(k) for k in (*schema.OUTPUTS, *schema.DIMS)})
    for fam in families():
        for k, a in fam.attributes.items():
            key = f"{k}/quantum" if fam.name == "quantum" and f"{k}/quantum" in rows else k
            expected[key] = a
    for name, a in expected.items():
        assert name in rows, f"docs/outputs.md has no row for {name}"
        assert rows[name] == (a["long_name"], a["units"]), name
    for fam in families():
        assert set(fam.attributes) == set(fam.variables), fam.name


# --- population labels ------------------------------------------------------------------------


def test_camps_are_saved_as_a_coordinate(tmp_path):
    scn = Scenario.from_toml(Path(__file__).resolve().parents[1] / "scenarios" / "polarization.toml")
    scn = scn.replace("population", n_agents=9).replace("run", n_steps=2, save_every=1, checkpoint_every=2)
    ds = simulate(scn, out=tmp_path / "p.zarr", progress=False).open()
    np.testing.assert_array_equal(ds.camp.values, np.arange(9) % 2)
    assert ds.camp.dims == ("agent",) and ds.camp.attrs["units"] == "1"
    # The labels are the camps the prior means were drawn around (+-offset/2 on the first latent axis).
    means = ds.mu_p.isel(time=0).groupby("camp").mean("agent").values[:, 0]
    assert means[0] > 2 and means[1] < -2
    one = simulate(scenario(), out=tmp_path / "one.zarr", progress=False).open()
    np.testing.assert_array_equal(one.camp.values, np.zeros(6))


# --- attention --------------------------------------------------------------------------------


def test_attention_dataset_level_dense_matches_the_loop_reference():
    cfg = vfesim.ModelConfig(K=3, kappa_beta=0.7, lambda_prior=1.0, kappa_gamma=1.3)
    state = vfesim.random_state(cfg, 7, seed=3)
    for which in ("belief", "prior"):
        beta = vfesim.attention(state, cfg, which)
        assert beta.dims == ("agent", "agent_j") and beta.shape == (7, 7)
        np.testing.assert_allclose(
            beta.values, reference_attention(state, cfg, which), rtol=1e-12, atol=1e-15
        )
        np.testing.assert_allclose(beta.sum("agent_j").values, 1.0, rtol=1e-14)
        assert beta.attrs["units"] == "1" and beta.agent_j.attrs["long_name"] == "sender agent j"
    assert vfesim.attention(state, cfg).name == "attention"
    with pytest.raises(ValueError, match="which"):
        vfesim.attention(state, cfg, "both")


def test_attention_sparse_form_aligns_with_the_neighbour_lists():
    nb = vfesim.SparseNeighbours.ring(8, 2)
    cfg = vfesim.ModelConfig(K=3, neighbours=nb)
    state = vfesim.random_state(cfg, 8, seed=4)
    beta = vfesim.attention(state, cfg)
    assert beta.dims == ("agent", "neighbour") and beta.shape == (8, nb.width)
    dense = np.zeros((8, 8))
    for i in range(8):
        for k in range(nb.width):
            if nb.mask[i, k]:
                assert beta.sender.values[i, k] == nb.index[i, k]
                dense[i, nb.index[i, k]] = beta.values[i, k]
            else:
                assert beta.sender.values[i, k] == -1 and beta.values[i, k] == 0
    np.testing.assert_allclose(dense, reference_attention(state, cfg), rtol=1e-12, atol=1e-15)


def test_attention_of_density_matrix_agents():
    cfg = vfesim.QuantumConfig(d=2)
    qs = vfesim.random_state(cfg, 5, seed=0)
    beta = vfesim.attention(qs, cfg)
    assert beta.dims == ("agent", "agent_j")
    np.testing.assert_allclose(beta.sum("agent_j").values, 1.0, rtol=1e-13)
    assert np.all(np.diag(beta.values) == 0)


@pytest.mark.parametrize("neighbours", ["dense", "ring"])
def test_runs_save_attention_per_frame(tmp_path, neighbours):
    ring = {"neighbours": "ring", "half_width": 1} if neighbours == "ring" else {}
    scn = scenario(population=ring)
    ds = simulate(scn, out=tmp_path / "r.zarr", progress=False).open().load()
    assert ds.attention_entropy.dims == ("time", "agent") and ds.attention.dims == (
        "time",
        "agent",
        "agent_j",
    )
    assert ds.attention_entropy.attrs["units"] == "nats"
    required = vfesim.family_of(scn.model).required
    for f in (0, ds.sizes["time"] - 1):
        frame = vfesim.make_state(scn.model, **{k: ds[k].isel(time=f).values for k in required})
        want = reference_attention(frame, scn.model)  # 0 off the neighbour lists
        np.testing.assert_allclose(ds.attention.isel(time=f).values, want, rtol=1e-10, atol=1e-14)
        H = -np.sum(np.where(want > 0, want * np.log(np.where(want > 0, want, 1)), 0), axis=1)
        np.testing.assert_allclose(ds.attention_entropy.isel(time=f).values, H, rtol=1e-10)
    n_neighbours = 2 if neighbours == "ring" else 5
    assert (ds.attention_entropy.values <= np.log(n_neighbours) + 1e-12).all()


def test_attention_defaults_follow_the_population_size():
    assert scenario().observables() == ["attention_entropy", "attention"]
    assert scenario(population={"n_agents": 300}).observables() == ["attention_entropy"]
    assert scenario(population={"n_agents": 2000}).observables() == []
    assert scenario(output={"observables": []}).observables() == []


# --- observables ------------------------------------------------------------------------------


def test_builtin_observables_on_known_states():
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 4, seed=0)
    mu = np.zeros((4, 3))
    mu[:, 0] = [1.0, -1.0, 3.0, -3.0]  # mean 0, squared distances 1, 1, 9, 9: RMS sqrt(5)
    phi = np.zeros((4, 3))
    phi[:, 2] = [0.5, 2 * np.pi - 0.5, 0.1, -0.3]  # angles 0.5, 0.5, 0.1, 0.3
    st = state.assign(mu_q=(state.mu_q.dims, mu), phi=(state.phi.dims, phi))
    obs = Observables(["belief_spread", "mean_frame_angle", "attention_entropy"], cfg, 4)
    v = obs.evaluate(st)
    assert v["belief_spread"] == pytest.approx(np.sqrt(5.0), rel=1e-14)
    assert v["mean_frame_angle"] == pytest.approx(0.35, rel=1e-14)
    beta = reference_attention(st, cfg)
    np.testing.assert_allclose(v["attention_entropy"], attention_entropy(beta), rtol=1e-12)
    np.testing.assert_allclose(rotation_angle(phi), [0.5, 0.5, 0.1, 0.3], rtol=1e-14)
    assert obs.var_attrs["mean_frame_angle"]["units"] == "rad"


def test_run_dynamics_records_observables_each_step():
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 5, seed=2)
    seen = []

    def centre(s):
        seen.append(s)
        return s.mu_q.values.mean(axis=1)  # one value per agent

    spec = {"centre": centre, "spread": "belief_spread", "m": vfesim.Observable(lambda s: 2.0, "two", "nats")}
    final, hist = vfesim.run_dynamics(
        state, cfg, "gradient_flow", dt=0.05, n_steps=4, record_every=2, observables=spec
    )
    assert len(seen) == 3 and all(isinstance(s.mu_q.data, np.ndarray) for s in seen)
    assert hist.centre.dims == ("time", "agent") and hist.spread.dims == ("time",)
    np.testing.assert_array_equal(hist.centre.values[-1], final.mu_q.values.mean(axis=1))
    np.testing.assert_array_equal(hist.centre.values[0], state.mu_q.values.mean(axis=1))
    assert hist.m.attrs == {"long_name": "two", "units": "nats"} and (hist.m.values == 2).all()
    assert hist.centre.attrs == {"long_name": "centre", "units": "1"}


def test_quantum_run_dynamics_records_observables():
    cfg = vfesim.QuantumConfig(d=2)
    qs = vfesim.random_state(cfg, 4, seed=0)
    final, hist = vfesim.run_dynamics(
        qs, cfg, "mirror_descent", dt=0.05, n_steps=2,
        observables={"spread": "belief_spread", "p00": lambda s: s.rho.values[:, 0, 0].real},
    )  # fmt: skip
    np.testing.assert_array_equal(hist.p00.values[-1], final.rho.values[:, 0, 0].real)
    rho = final.rho.values.reshape(4, -1)
    want = np.sqrt(np.mean(np.sum(np.abs(rho - rho.mean(axis=0)) ** 2, axis=1)))
    assert hist.spread.values[-1] == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (
            {"x": lambda s: np.zeros(3)},
            ValueError,
            r"observables.x: must return a scalar or one value per agent",
        ),
        ({"x": lambda s: 1j}, TypeError, r"observables.x: must return real numbers"),
        ({"mu_q": lambda s: 1.0}, ValueError, r"observables.mu_q: the name is taken"),
        ({"energy_x": lambda s: 1.0}, ValueError, r"observables.energy_x: the name is taken"),
        ({"x": "belief_sprad"}, ValueError, r"did you mean 'belief_spread'"),
        ({"x y": lambda s: 1.0}, ValueError, r"must be an identifier"),
        ({"x": 3}, TypeError, r"observables.x: expected a function"),
        ("belief_spread", TypeError, r"observables: expected a mapping"),
    ],
)
def test_bad_observables_are_named(spec, error, match):
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 5, seed=2)
    with pytest.raises(error, match=match):
        vfesim.run_dynamics(state, cfg, "gradient_flow", dt=0.05, n_steps=1, observables=spec)


def test_an_observable_that_raises_is_named():
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 5, seed=2)
    with pytest.raises(KeyError) as e:
        vfesim.run_dynamics(
            state, cfg, "gradient_flow", dt=0.05, n_steps=1, observables={"bad": lambda s: s["nope"]}
        )
    assert "observable 'bad'" in "".join(e.value.__notes__)


def test_scenario_observables_are_validated_all_at_once():
    with pytest.raises(ScenarioError) as e:
        scenario(output={"observables": ["belief_sprad", "mean_frame_angle", "mean_frame_angle", 3]})
    keys = [k for k, _ in e.value.errors]
    assert keys == ["output.observables[0]", "output.observables[3]", "output.observables[2]"]
    assert "did you mean 'belief_spread'?" in e.value.errors[0][1]
    assert "listed twice" in e.value.errors[2][1]
    with pytest.raises(ScenarioError, match="output.observables: must be a list"):
        scenario(output={"observables": "belief_spread"})
    with pytest.raises(ScenarioError, match="at most 4096 agents"):
        scenario(population={"n_agents": 5000}, output={"observables": ["attention"]})
    assert scenario(output={"observables": list(BUILTINS)}).observables() == list(BUILTINS)


def test_simulate_saves_observables_and_resume_needs_python_ones(tmp_path):
    spread = lambda s: float(s.mu_q.std("agent").mean())
    scn = scenario(output={"observables": ["belief_spread", "mean_frame_angle"]})
    full = simulate(scn, out=tmp_path / "full.zarr", progress=False, observables={"sd": spread}).open()
    assert set(full.data_vars) >= {"belief_spread", "mean_frame_angle", "sd"} and "attention" not in full
    assert full.sd.dims == ("time",) and full.sd.attrs["long_name"] == "sd"
    part = tmp_path / "part.zarr"
    simulate(scn, out=part, steps=4, progress=False, observables={"sd": spread})
    with pytest.raises(RunError, match=r"Python observables \['sd'\]"):
        resume(part, steps=8, progress=False)
    resumed = resume(part, steps=8, progress=False, observables={"sd": spread}).open()
    for k in ("sd", "belief_spread", "mean_frame_angle", "mu_q", "energy_total"):
        np.testing.assert_array_equal(resumed[k].values, full[k].values, err_msg=k)
    with pytest.raises(ScenarioError, match="also given as observables"):
        simulate(scn, out=tmp_path / "x.zarr", progress=False, observables={"belief_spread": spread})
    with pytest.raises(ValueError, match="observables.phi: the name is taken"):
        simulate(scn, out=tmp_path / "x.zarr", progress=False, observables={"phi": spread})
    with pytest.raises(TypeError, match="observables: expected a mapping"):
        simulate(scn, out=tmp_path / "x.zarr", progress=False, observables="sd")
    assert not (tmp_path / "x.zarr").exists()
    # A built-in asked for from Python is a Python observable of the run: resume asks for it again.
    simulate(scenario(), out=tmp_path / "b.zarr", steps=4, progress=False, observables={"s": "belief_spread"})
    with pytest.raises(RunError, match=r"Python observables \['s'\]"):
        resume(tmp_path / "b.zarr", steps=8, progress=False)
    assert resume(tmp_path / "b.zarr", steps=8, progress=False, observables={"s": "belief_spread"}).step == 8


# --- chunks, reading without Dask, old formats -----------------------------------------------


def test_trajectories_are_chunked_along_agent(tmp_path, monkeypatch):
    ref = simulate(scenario(), out=tmp_path / "ref.zarr", progress=False).open()
    monkeypatch.setattr(store, "DEFAULT_AGENT_CHUNK", 4)
    ds = simulate(scenario(), out=tmp_path / "c.zarr", progress=False).open()
    for k, tail in (("mu_q", (3,)), ("sigma_q", (3, 3)), ("attention_entropy", ()), ("attention", (6,))):
        chunks = zarr.open_array(tmp_path / "c.zarr" / k, mode="r").chunks
        assert chunks[1:] == (4, *tail), k
        assert ds[k].encoding["preferred_chunks"]["agent"] == 4
    assert zarr.open_array(tmp_path / "c.zarr" / "energy_total", mode="r").chunks == (
        zarr.open_array(tmp_path / "c.zarr" / "mu_q", mode="r").chunks[0],
    )
    for k in ref.data_vars:
        np.testing.assert_array_equal(ds[k].values, ref[k].values, err_msg=k)
    assert all(r.intact for r in store.RunStore(tmp_path / "c.zarr").verify())


def test_open_run_without_dask(tmp_path):
    out = tmp_path / "r.zarr"
    simulate(scenario(), out=out, progress=False)
    code = f"""
import sys
for m in ("dask", "dask.array", "distributed"):
    sys.modules[m] = None  # as if not installed
import numpy as np, vfesim
ds = vfesim.open_run({str(out)!r})
a = ds.mu_q.variable._data
assert not isinstance(a, np.ndarray) and type(a).__module__.startswith("xarray"), type(a)
print(float(ds.energy_total.values[-1]), ds.mu_q.isel(time=-1, agent=slice(0, 2)).values.shape)
"""
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    assert res.returncode == 0, res.stderr
    F, shape = res.stdout.split(" ", 1)
    assert float(F) == float(open_run(out).energy_total.values[-1]) and shape.strip() == "(2, 3)"


def _as_format_1(path: Path) -> None:
    """Turn a run store into the layout of format vfesim-run/1 (its energy names and format attr)."""
    for k in [p.name for p in path.iterdir() if p.name.startswith("energy_")]:
        old = "system_free_energy" if k == "energy_total" else "system_" + k
        shutil.move(path / k, path / old)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"]["format"] = "vfesim-run/1"
    (path / "zarr.json").write_text(json.dumps(meta))


def test_format_1_stores_open_with_new_names_and_refuse_resume(tmp_path):
    out = tmp_path / "old.zarr"
    ref = simulate(scenario(), out=out, steps=4, progress=False).open().load()
    _as_format_1(out)
    assert (out / "system_free_energy").is_dir() and (out / "system_energy_self").is_dir()
    ds = open_run(out)
    assert ds.attrs["format"] == "vfesim-run/1"
    for k in ("energy_total", "energy_self", "energy_belief_align"):
        np.testing.assert_array_equal(ds[k].values, ref[k].values)
        assert ds[k].attrs["units"] == "nats"
    assert not any(k.startswith("system_") for k in ds.data_vars)
    with pytest.raises(RunError, match=r"store format vfesim-run/1 .*resumes vfesim-run/2 stores only"):
        resume(out, steps=8, progress=False)
