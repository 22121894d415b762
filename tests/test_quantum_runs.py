"""Density-matrix runs from scenario files (issue 13 "Runs"): validation of the [quantum] sections, run and
resume bitwise (also after SIGKILL), the guard naming step/agent/variable, complex Zarr trajectories, the
CLI on shipped scenarios by name, plots, and the shipped scenarios' claims (decoherence against its
closed form, consensus up to frames, Hamiltonian learning = vfesim.quantum.fit's Adam)."""

import json
import signal

import numpy as np
import pytest
import xarray as xr
from test_crash_resume import _cli

import vfesim.quantum.runs as qruns
from vfesim.cli import main
from vfesim.integrators import DynamicsError
from vfesim.io import RunStore, open_run
from vfesim.quantum import Schedule, fit
from vfesim.quantum.frames import frames, spin_generators
from vfesim.scenario import Scenario, ScenarioError, load_scenario, read_toml
from vfesim.simulate import resume, simulate

SMALL = """
[quantum]
d = 2
lambda_obs = 0.5
kappa_beta = 0.7
[population]
n_agents = 5
seed = 3
neighbours = "ring"
half_width = 1
[integrator]
method = "channels"
dt = 0.1
coupling_strength = 0.2
dephasing_rate = [0.1, 0.2, 0.3, 0.4, 0.5]
observe = "born"
mirror_steps = 1
[run]
n_steps = 12
save_every = 2
checkpoint_every = 4
seed = 7
[output]
time_chunk = 2
"""

FIT = """
[quantum]
d = 2
lambda_belief = 0.0
[population]
n_agents = 4
seed = 5
hamiltonian = "shared"
spectrum_spread = 6.0
[integrator]
method = "fit"
dt = 0.1
horizon = 8
lr = 0.05
coupling = "none"
dephasing_rate = 0.1
[run]
n_steps = 6
checkpoint_every = 3
seed = 2
"""


def _toml(tmp_path, text, name="s.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _equal(a, b):
    for k in a.data_vars:
        np.testing.assert_array_equal(a[k].values, b[k].values, err_msg=k)


def _assert_prefix_of(ds, ref):
    """The frames of ``ds`` are the first frames of ``ref``, bitwise (variables without time: equal)."""
    n = ds.sizes["time"]
    assert n <= ref.sizes["time"]
    for k in ref.data_vars:
        want = ref[k].values[:n] if "time" in ref[k].dims else ref[k].values
        np.testing.assert_array_equal(ds[k].values, want, err_msg=k)


# ------------------------------------------------------------------------------------------- scenarios


def test_every_problem_reported_at_once_with_suggestions():
    d = {
        "quantum": {"d": 2, "lamda_self": 1.0, "aggregator": "softmn", "kappa_beta": -1.0},
        "population": {"seed": 1, "neighbours": "ring"},
        "integrator": {
            "dt": 0.1,
            "coupling": "C11",
            "dephasing_rate": [0.1, 0.2],
            "horizon": 4,
            "dephasing_basis": "energy",
            "mirror_eta": 0.0,
        },
        "run": {"n_steps": 4, "dtype": "float64", "backend": "cupy"},
    }
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict(d)
    got = dict(exc.value.errors)
    assert "did you mean 'lambda_self'" in got["quantum.lamda_self"]
    assert "did you mean 'softmin'" in got["quantum.aggregator"]
    assert "> 0" in got["quantum.kappa_beta"]
    assert got["population.n_agents"] == "is required"
    assert "half_width" in str(exc.value) and "is required with neighbours = 'ring'" in str(exc.value)
    assert "did you mean 'C1'" in got["integrator.coupling"]
    assert got["integrator.horizon"] == "only valid with method = 'fit'"
    assert "integrator.mirror_eta" in got and "integrator.dephasing_basis" not in got
    assert "complex128" in got["run.dtype"] and "numba" in got["run.backend"]
    # a per-agent list of the wrong length is named once n_agents is known
    d["population"] = {"n_agents": 3}
    d["quantum"] = {"d": 2}
    d["integrator"] = {"dt": 0.1, "dephasing_rate": [0.1, 0.2], "methd": "fit"}
    d["run"] = {"n_steps": 4}
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict(d)
    got = dict(exc.value.errors)
    assert set(got) == {"integrator.dephasing_rate", "integrator.methd"}
    assert "2 values for 3 agents" in got["integrator.dephasing_rate"]
    assert "did you mean 'method'" in got["integrator.methd"]


def test_section_mixups_are_named():
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict({"model": {"K": 2}, "quantum": {"d": 2}, "population": {"n_agents": 2},
                            "integrator": {"dt": 0.1}, "run": {"n_steps": 1}})  # fmt: skip
    assert dict(exc.value.errors)["model"].startswith("a scenario has one model section")
    with pytest.raises(ScenarioError) as exc:
        Scenario.from_dict({"quantum": {"d": 2}, "population": {"n_agents": 2, "mu_scale": 1.0},
                            "integrator": {"dt": 0.1, "horizon": 3, "method": "fit", "observe": "born"},
                            "run": {"n_steps": 1}})  # fmt: skip
    got = dict(exc.value.errors)
    assert "population.mu_scale" in got
    assert "needs population.hamiltonian = 'shared'" in got["integrator.shared"]
    assert "'none' with method = 'fit'" in got["integrator.observe"]


def test_defaults_resolve_and_round_trip(tmp_path):
    s = Scenario.from_toml(_toml(tmp_path, SMALL))
    assert s.run["dtype"] == "complex128" and s.integrator["coupling"] == "C1"
    assert s.integrator["dephasing_rate"] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert s.model.neighbours.index.shape == (5, 2) and s.model.lambda_obs == 0.5
    again = Scenario.from_json(s.to_json())
    assert again.to_dict() == s.to_dict()
    text = s.to_toml()
    assert text.startswith("[quantum]\n")
    assert Scenario.from_toml(_toml(tmp_path, text, "back.toml")).to_dict() == s.to_dict()
    md = load_scenario(
        {
            "quantum": {"d": 3},
            "population": {"n_agents": 4},
            "integrator": {"method": "mirror_descent", "dt": 0.1},
            "run": {"n_steps": 1},
        }
    )
    assert md.integrator["coupling"] == "none" and md.integrator["mirror_steps"] == 1


# ------------------------------------------------------------------------------------------ run/resume


def test_run_then_resume_is_bitwise_with_rng_in_checkpoints(tmp_path):
    toml = _toml(tmp_path, SMALL)
    ref = simulate(read_toml(toml), out=tmp_path / "ref.zarr", progress=False)
    simulate(read_toml(toml), out=tmp_path / "a.zarr", steps=6, progress=False)
    ckpt = RunStore(tmp_path / "a.zarr").latest_checkpoint()
    assert ckpt.step == 6 and ckpt.rng_state["bit_generator"] == "PCG64"
    back = resume(tmp_path / "a.zarr", steps=12, progress=False)
    x, y = open_run(tmp_path / "ref.zarr").load(), open_run(tmp_path / "a.zarr").load()
    _equal(x, y)
    assert back.terms == ref.terms
    assert x["rho"].dtype == np.complex128 and x["outcome"].dims == ("time", "agent")
    assert len(np.unique(x["outcome"].values)) == 2  # outcomes drawn per step
    # plain xarray reads the complex trajectory
    raw = xr.open_zarr(tmp_path / "ref.zarr", consolidated=False)
    np.testing.assert_array_equal(raw["rho"].values, x["rho"].values)
    assert raw["rho"].dtype == np.complex128


def test_kill_9_then_resume_is_bitwise(tmp_path, monkeypatch):
    import zarr.storage

    toml = _toml(tmp_path, SMALL)
    count = {"n": 0}
    orig = zarr.storage.LocalStore.set

    async def counted(self, key, value):
        count["n"] += 1
        return await orig(self, key, value)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", counted)
    ref_run = simulate(read_toml(toml), out=tmp_path / "ref.zarr", progress=False)
    monkeypatch.undo()
    ref = open_run(tmp_path / "ref.zarr").load()
    out = tmp_path / "run.zarr"
    # killed between two of its store writes, past its first checkpoint (the Gaussian crash tests kill
    # at random writes; the store logic is shared)
    rc, err = _cli(["run", str(toml), "--out", str(out)], kill_at=int(0.6 * count["n"]))
    assert rc == -signal.SIGKILL, err
    assert RunStore(out).latest_checkpoint().step in (4, 8)
    _assert_prefix_of(open_run(out).load(), ref)
    rc, err = _cli(["resume", str(out)])
    assert rc == 0, err
    final = open_run(out).load()
    assert final.attrs["status"] == "complete" and final.sizes["time"] == ref.sizes["time"]
    _assert_prefix_of(final, ref)
    ckpt = RunStore(out).latest_checkpoint()
    assert ckpt.step == 12 and ckpt.terms == ref_run.terms
    _equal(ckpt.state, ref_run.state)


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda r: r.__setitem__((2, 0, 0), np.nan), r"step 3: rho\[agent=2\]: non-finite"),
        (lambda r: r.__setitem__(1, r[1] * 1.01), r"step 3: rho\[agent=1\]: trace drifted by 0.01"),
        (lambda r: r.__setitem__(0, np.diag([1.1, -0.1])), r"step 3: rho\[agent=0\]: lost positivity"),
    ],
    ids=["nan", "trace", "positivity"],
)
def test_guard_stops_the_run_naming_step_agent_and_variable(spoil, message, tmp_path, monkeypatch):
    real = qruns.step

    def spoiled(P, rho, dt, dyn, **kw):
        out, tape = real(P, rho, dt, dyn, **kw)
        if spoiled.calls == 2:
            spoil(out)
        spoiled.calls += 1
        return out, tape

    spoiled.calls = 0
    monkeypatch.setattr(qruns, "step", spoiled)
    d = read_toml(_toml(tmp_path, SMALL))
    d["integrator"] |= {"observe": "none", "mirror_steps": 0}
    with pytest.raises(DynamicsError, match=message):
        simulate(d, out=tmp_path / "r.zarr", progress=False)
    assert open_run(tmp_path / "r.zarr").attrs["status"].startswith("failed: step 3: rho[agent=")


def test_a_state_the_kernels_refuse_stops_the_run_like_the_guard(tmp_path, monkeypatch):
    """The channel step kernels refuse a coupled state the gate cannot take (ValueError naming the agent,
    where the array code gives NaN): the run stops with a DynamicsError naming step, agent and variable."""
    real = qruns.step

    def refusing(P, rho, dt, dyn, **kw):
        refusing.calls += 1
        if refusing.calls == 3:
            raise ValueError("rho[agent=2]: not positive semidefinite (floored eigenvalue -1e-13)")
        return real(P, rho, dt, dyn, **kw)

    refusing.calls = 0
    monkeypatch.setattr(qruns, "step", refusing)
    with pytest.raises(DynamicsError, match=r"^step 3: rho\[agent=2\]: not positive semidefinite") as e:
        simulate(read_toml(_toml(tmp_path, SMALL)), out=tmp_path / "r.zarr", progress=False)
    assert e.value.agent == 2 and e.value.variable == "rho"


def test_numba_run_follows_the_numpy_run(tmp_path):
    """Backend numba: the channel step in the CPU kernels, F in the per-agent kernels and pair kernels."""
    d = read_toml(_toml(tmp_path, SMALL))
    d["run"]["n_steps"] = 4
    runs = {b: simulate(d, out=tmp_path / f"{b}.zarr", backend=b, progress=False) for b in ("numpy", "numba")}
    a, b = (open_run(runs[k].path).load() for k in ("numba", "numpy"))
    assert a.attrs["backend"] == "numba"
    for k in b.data_vars:
        np.testing.assert_allclose(a[k].values, b[k].values, rtol=1e-12, atol=1e-12, err_msg=k)


# ------------------------------------------------------------------------------------ CLI and plots


def test_cli_runs_shipped_scenario_by_name_inspects_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "decoherence", "--out", "d.zarr", "--steps", "6", "-q"]) == 0
    assert main(["inspect", "d.zarr"]) == 0
    out = capsys.readouterr().out
    assert "family       quantum" in out and "(d = 2)" in out and "integrator   channels, dt = 0.05\n" in out
    assert "[quantum]\n" in out
    assert main(["inspect", "d.zarr", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "quantum"
    assert main(["plot", "d.zarr", "--outdir", "p"]) == 0
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert names == ["attention.png", "bloch.png", "energy.png", "purity_entropy.png"]
    assert all((tmp_path / "p" / n).stat().st_size > 10_000 for n in names)
    assert main(["resume", "d.zarr", "--steps", "8", "-q"]) == 0
    assert open_run("d.zarr")["step"].values[-1] == 8


def test_fit_run_plots(tmp_path):
    simulate(read_toml(_toml(tmp_path, FIT)), out=tmp_path / "f.zarr", steps=2, progress=False)
    assert main(["plot", str(tmp_path / "f.zarr"), "--outdir", str(tmp_path / "p"), "-q"]) == 0
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["fit.png"]


# ----------------------------------------------------------------------------------- scenario claims


def test_decoherence_matches_its_closed_form(tmp_path):
    """Energy-basis dephasing commutes with the unitary step: in the eigenbasis (lam, V) of H_i,
    rho_kl(t) = rho_kl(0) exp(-i (lam_k - lam_l) t) exp(-gamma t) for k != l, populations fixed; so
    purity(t) = sum_k |rho_kk|^2 + sum_{k != l} |rho_kl(0)|^2 exp(-2 gamma t)."""
    s = load_scenario("decoherence")
    run = simulate(s, out=tmp_path / "d.zarr", steps=40, progress=False)
    ds = open_run(run.path).load()
    gamma = s.integrator["dephasing_rate"]
    lam, V = np.linalg.eigh(ds["hamiltonian"].values)
    R0 = np.conj(np.swapaxes(V, 1, 2)) @ ds["rho"].values[0] @ V
    off = 1.0 - np.eye(2)
    for t, rho in zip(ds["time"].values, ds["rho"].values, strict=True):
        phase = np.exp(-1j * (lam[:, :, None] - lam[:, None, :]) * t) * np.exp(-gamma * t * off)
        expect = V @ (R0 * phase) @ np.conj(np.swapaxes(V, 1, 2))
        np.testing.assert_allclose(rho, expect, atol=1e-12, rtol=0)
    t = ds["time"].values[-1]
    purity = np.einsum("nkl,nlk->n", ds["rho"].values[-1], ds["rho"].values[-1]).real
    diag = np.sum(np.abs(np.diagonal(R0, axis1=1, axis2=2)) ** 2, axis=1)
    coh = np.sum(np.abs(R0 * off) ** 2, axis=(1, 2))
    np.testing.assert_allclose(purity, diag + coh * np.exp(-2 * gamma * t), atol=1e-12)
    F = ds["energy_total"].values
    assert np.all(np.diff(F) <= 1e-12) and F[-1] < F[0]  # Gibbs-preserving channel: D(rho||sigma) falls


def test_quantum_consensus_agrees_up_to_frames(tmp_path):
    s = load_scenario("quantum_consensus")
    run = simulate(s, out=tmp_path / "c.zarr", steps=60, progress=False)
    ds = open_run(run.path).load()
    U, _ = frames(ds["phi"].values, spin_generators(3), np.complex128)
    rho = ds["rho"].values
    pulled = np.conj(np.swapaxes(U, 1, 2))[None] @ rho @ U[None]
    spread = np.abs(pulled - pulled.mean(axis=1, keepdims=True)).max(axis=(1, 2, 3))
    raw = np.abs(rho - rho.mean(axis=1, keepdims=True)).max(axis=(1, 2, 3))
    assert spread[-1] < 0.01 * spread[0]  # agreement in the pulled-back coordinates
    assert raw[-1] > 0.1 * raw[0]  # ... not of the raw states: the frames differ
    F = ds["energy_total"].values
    assert F[-1] < F[0] - 15


def test_fit_run_is_fits_adam_and_resumes_bitwise(tmp_path):
    toml = _toml(tmp_path, FIT)
    full = simulate(read_toml(toml), out=tmp_path / "full.zarr", progress=False)
    simulate(read_toml(toml), out=tmp_path / "half.zarr", steps=3, progress=False)
    back = resume(tmp_path / "half.zarr", steps=6, progress=False)
    _equal(open_run(tmp_path / "full.zarr").load(), open_run(tmp_path / "half.zarr").load())
    assert back.terms == full.terms
    # the run's Adam steps are vfesim.quantum.fit's, from the start the run drew
    ck = RunStore(tmp_path / "full.zarr").checkpoint_steps()
    ckpt = RunStore(tmp_path / "full.zarr").load_checkpoint(ck[-1])
    s = full.scenario
    start = open_run(tmp_path / "full.zarr").isel(time=0).load()
    start_state = full.state.assign(hamiltonian=(("agent", "bra", "ket"), start["hamiltonian"].values))
    sched = Schedule(qruns.dynamics(s.integrator), s.integrator["dt"], 8, ckpt.aux["outcomes"])
    res = fit(start_state, s.model, sched, "hamiltonian", "adam", shared="hamiltonian", n_iter=6, lr=0.05)
    np.testing.assert_allclose(full.state["hamiltonian"].values, res.state["hamiltonian"].values, atol=1e-13)
    assert full.terms["born_loss"] == pytest.approx(res.loss, rel=1e-12)
    errs = open_run(tmp_path / "full.zarr")["energy_hamiltonian_error"].values
    assert errs[0] == pytest.approx(0.4)  # the start: perturbation 0.4 (the default) away


def test_hamiltonian_learning_error_falls(tmp_path):
    s = load_scenario("hamiltonian_learning")
    simulate(s, out=tmp_path / "h.zarr", steps=20, progress=False)
    err = open_run(tmp_path / "h.zarr")["energy_hamiltonian_error"].values
    assert err[0] == pytest.approx(0.6) and err[-1] < 0.3


def test_simulate_takes_a_quantum_config(tmp_path):
    from vfesim import QuantumConfig

    sections = dict(population={"n_agents": 3}, integrator={"dt": 0.1}, run={"n_steps": 2})
    run = simulate(QuantumConfig(d=3, dtype="complex64"), tmp_path / "q.zarr", progress=False, **sections)
    assert run.step == 2 and run.state["rho"].dtype == np.complex64
    assert open_run(run.path).attrs["agent_family"] == "quantum"
