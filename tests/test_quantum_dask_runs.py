"""Density-matrix runs on the dask backend (vfesim.quantum.chunked): equal to the in-process numpy run for
both methods, dense / ring / causal windows, both orders, Born outcomes and mirror steps, for one, two,
three and uneven chunkings; the state chunked on the workers; bitwise resume; the guard naming the global
agent; method "fit" refused; the CLI on a shipped scenario. A run on a LocalCluster of worker processes is
in tests/test_dask_runs.py (its cluster fixture)."""

from __future__ import annotations

import dataclasses
import json

import dask.array as da
import numpy as np
import pytest

import vfesim
import vfesim.quantum.chunked as qchunked
from vfesim.backends import get
from vfesim.cli import main
from vfesim.integrators.base import DynamicsError
from vfesim.io import open_run
from vfesim.io.store import RunStore
from vfesim.scenario import Scenario, ScenarioError
from vfesim.simulate import resume, run_info, simulate

pytest.importorskip("dask")

N = 7
CHUNKINGS = [N, (4, 3), (3, 3, 1), (1, 4, 2)]  # one, two, three chunks, uneven


def _scenario(method="channels", neighbours="dense", backend="numpy", **integrator) -> dict:
    pop = {"n_agents": N, "seed": 3, "hamiltonian": "random"}
    if neighbours == "ring":
        pop |= {"neighbours": "ring", "half_width": 2}
    elif neighbours == "causal":
        pop |= {"neighbours": "causal", "window": 2}
    return {
        "quantum": {"d": 2, "lambda_self": 0.3, "lambda_belief": 1.0, "kappa_beta": 0.5, "lambda_obs": 0.2},
        "population": pop,
        "integrator": {"method": method, "dt": 0.1, **integrator},
        "run": {"n_steps": 4, "save_every": 1, "checkpoint_every": 2, "backend": backend, "seed": 5},
    }


rng = np.random.default_rng(0)
CASES = {
    "dense-C1-positions-rates": dict(
        coupling="C1", coupling_strength=0.3, positions=rng.uniform(0, 2, (N, 2)).tolist(),
        dephasing_rate=[0.1 * i for i in range(N)], thermal_rate=0.2, mirror_steps=1,
    ),
    "ring-C2-born-gate": dict(
        neighbours="ring", coupling="C2", coupling_strength=0.4, observe="born", gate="soft",
        dephasing_rate=0.3, dephasing_basis="energy", mirror_steps=2,
    ),
    "causal-gauss_seidel": dict(
        neighbours="causal", coupling="C1", coupling_strength=0.5, order="gauss_seidel",
    ),
    "dense-gauss_seidel-born": dict(
        coupling="C1", coupling_strength=0.2, order="gauss_seidel", observe="born", mirror_steps=1,
    ),
    "ring-mirror_descent-backtracking": dict(method="mirror_descent", neighbours="ring", mirror_eta=40.0),
    "dense-mirror_descent-rejected": dict(method="mirror_descent", mirror_eta=1e4, max_backtracks=0),
}  # fmt: skip


def _steppers(case: dict, chunks):
    case = dict(case)
    method, neighbours = case.pop("method", "channels"), case.pop("neighbours", "dense")
    scn = Scenario.from_dict(_scenario(method, neighbours, **case))
    make = lambda backend: scn.spec.make_integrator(scn.model, scn.integrator, backend=backend, seed=5)
    return scn.initial_state(), make("numpy"), make(dataclasses.replace(get("dask"), chunks=chunks))


def _close(a, b, err_msg=""):
    a, b = np.asarray(a), np.asarray(b)
    assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max(), err_msg


@pytest.mark.parametrize("name", list(CASES))
def test_dask_steps_equal_the_numpy_run_for_every_chunking(name):
    state, ref, _ = _steppers(CASES[name], N)
    carries = [ref.init(state)]
    for _ in range(3):
        carries.append(ref.step(carries[-1]))
    for chunks in CHUNKINGS:
        _, _, dk = _steppers(CASES[name], chunks)
        assert dk.trajectory == ref.trajectory
        c = dk.init(state)
        for k, want in enumerate(carries):
            if k:
                c = dk.step(c)
            where = f"{name}, chunks {chunks}, step {k}"
            rho = c.state["rho"].data
            assert isinstance(rho, da.Array) and len(rho.chunks[0]) == len(dk.layout.sizes), where
            _close(rho.compute(), want.state["rho"].values, where)
            assert c.terms.keys() == want.terms.keys()
            _close([c.terms[t] for t in want.terms], list(want.terms.values()), where)
            if "outcome" in ref.trajectory:
                np.testing.assert_array_equal(c.state["outcome"].values, want.state["outcome"].values)
                assert c.rng_state == want.rng_state


def test_mirror_line_search_backtracks_and_rejects(monkeypatch):
    """The two mirror_descent cases above take the backtracking and the no-step branches."""
    etas = []
    real = qchunked._trial_task

    def trial(log_x, G, rho, eta, n_step, r0):
        etas.append(eta)
        return real(log_x, G, rho, eta, n_step, r0)

    monkeypatch.setattr(qchunked, "_trial_task", trial)
    runs = (("ring-mirror_descent-backtracking", (3, 3, 1)), ("dense-mirror_descent-rejected", 4))
    for name, chunks in runs:
        state, ref, dk = _steppers(CASES[name], chunks)
        etas.clear()
        c = dk.step(dk.init(state))
        assert len(set(etas)) > 1 if "backtracking" in name else set(etas) == {1e4}, etas
        if "rejected" in name:  # no step accepted: the state after the channels stays
            _, _, channels_only = _steppers({**CASES[name], "mirror_steps": 0}, chunks)
            want = channels_only.step(channels_only.init(state))
            np.testing.assert_array_equal(c.state["rho"].values, want.state["rho"].values)
            assert c.terms == want.terms


def _run(tmp_path, name, **kw):
    d = _scenario(**kw)
    d["run"] |= {"backend": "dask", "chunks": 3}
    return simulate(d, out=tmp_path / name, progress=False)


def test_run_writes_chunked_frames_and_resumes_bitwise(tmp_path):
    kw = dict(neighbours="ring", coupling="C1", coupling_strength=0.3, observe="born", mirror_steps=1)
    full = _run(tmp_path, "full.zarr", **kw)
    info = run_info(full.path)
    assert info["backend"] == "dask" and info["chunking"]["chunks"] == [3, 3, 1]
    d = _scenario(**kw)
    d["run"]["n_steps"] = 3  # stops off the checkpoint grid (its last step is checkpointed)
    d["run"] |= {"backend": "dask", "chunks": 3}
    simulate(d, out=tmp_path / "r.zarr", progress=False)
    resume(tmp_path / "r.zarr", steps=4, progress=False)
    a, b = open_run(full.path).load(), open_run(tmp_path / "r.zarr").load()
    assert a["step"].values.tolist() == b["step"].values.tolist() == [0, 1, 2, 3, 4]
    for k in a.data_vars:
        np.testing.assert_array_equal(a[k].values, b[k].values, err_msg=k)
    assert all(r.intact for r in RunStore(tmp_path / "r.zarr").verify())
    d["run"] |= {"backend": "numpy", "n_steps": 4}
    del d["run"]["chunks"]
    ref = open_run(simulate(d, out=tmp_path / "n.zarr", progress=False).path).load()
    for k in ("rho", "energy_total", "energy_belief_align"):
        _close(a[k].values, ref[k].values, k)
    np.testing.assert_array_equal(a["outcome"].values, ref["outcome"].values)


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda r: r.__setitem__((0, 0), np.nan), r"step 2: rho\[agent=5\]: non-finite"),
        (lambda r: r.__setitem__(..., r * 1.01), r"step 2: rho\[agent=5\]: trace drifted by 0.01"),
        (lambda r: r.__setitem__(..., np.diag([1.1, -0.1])), r"step 2: rho\[agent=5\]: lost positivity"),
    ],
    ids=["nan", "trace", "positivity"],
)  # fmt: skip
def test_guard_names_the_global_agent(spoil, message, tmp_path, monkeypatch):
    real = qchunked._finish_chunk

    def spoiled(new, n_step, r0, u):
        if n_step == 2 and r0 <= 5 < r0 + new.shape[0]:
            spoil(new[5 - r0])
        return real(new, n_step, r0, u)

    monkeypatch.setattr(qchunked, "_finish_chunk", spoiled)
    with pytest.raises(DynamicsError, match=message):
        _run(tmp_path, "g.zarr", neighbours="causal", coupling="C1", coupling_strength=0.2, mirror_steps=1)
    assert open_run(tmp_path / "g.zarr").attrs["status"].startswith("failed: step 2: rho[agent=5]")


def test_fit_is_refused_on_dask(tmp_path):
    d = _scenario("fit", horizon=2)
    d["quantum"]["lambda_obs"] = 0.0
    d["population"]["hamiltonian"] = "shared"
    d["run"]["backend"] = "dask"
    with pytest.raises(ScenarioError, match=r"integrator.method = 'fit' runs on the 'numpy' and 'numba'"):
        simulate(d, out=tmp_path / "f.zarr", progress=False)


def test_cli_runs_a_shipped_quantum_scenario_on_dask(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["run", "quantum_consensus", "--backend", "dask", "--steps", "2", "--out", "q.zarr", "-q"]
    assert main(args) == 0
    assert main(["inspect", "q.zarr", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backend"] == "dask" and info["chunking"]["inner"] == "numba" and info["last_saved_step"] == 2
    assert main(["verify", "q.zarr", "-q"]) == 0


@pytest.mark.parametrize("chunked_input", [False, True])
def test_run_dynamics_on_dask_matches_numpy(chunked_input):
    """vfesim.run_dynamics of density-matrix agents on dask (the runs' chunked stepper): final state
    chunked in, chunked out (in memory in, in memory out) and the history equal the numpy run's."""
    nb = vfesim.SparseNeighbours.ring(7, 1)
    cfg = vfesim.QuantumConfig(d=3, lambda_self=0.3, lambda_belief=1.0, neighbours=nb)
    state = vfesim.random_state(cfg, 7, seed=1)
    kw = {"method": "channels", "dt": 0.1, "n_steps": 3, "coupling": "C1", "coupling_strength": 0.3,
          "mirror_steps": 1, "dephasing_rate": 0.2}  # fmt: skip
    ref, h_ref = vfesim.run_dynamics(state, cfg, backend="numpy", **kw)
    given = state.chunk(agent=4) if chunked_input else state
    out, h = vfesim.run_dynamics(given, cfg, backend="dask", **kw)
    assert isinstance(out["rho"].data, da.Array) == chunked_input
    np.testing.assert_allclose(out["rho"].values, ref["rho"].values, rtol=0, atol=1e-13)
    for k in h_ref.data_vars:
        if k != "system_mirror_eta":
            np.testing.assert_allclose(h[k].values, h_ref[k].values, rtol=1e-12, atol=1e-13, err_msg=k)
    with pytest.raises(ValueError, match="neighbours: a coupling window other than the config's"):
        vfesim.run_dynamics(state, cfg, backend="dask", neighbours="dense", **kw)


def test_jacobi_chunks_step_in_the_cpu_kernels(monkeypatch):
    """A Jacobi step of a chunk runs the channel step's serial CPU kernels with the window's senders given
    (not the array code's agent_update, which Gauss-Seidel keeps), and equals the numpy run."""
    import importlib

    qc = importlib.import_module("vfesim.quantum.chunked")
    qe = importlib.import_module("vfesim.quantum.evolve")  # vfesim.quantum.evolve is also a function

    def refuse(*args, **kwargs):
        raise AssertionError("array code")

    state, ref, dk = _steppers(CASES["ring-C2-born-gate"], (3, 3, 1))
    want = ref.step(ref.init(state))
    monkeypatch.setattr(qc, "agent_update", refuse)
    monkeypatch.setattr(qe, "agent_update", refuse)
    got = dk.step(dk.init(state))
    _close(got.state["rho"].values, want.state["rho"].values)


def test_jacobi_chunks_above_the_kernels_largest_d_run_the_array_code():
    """Above the CPU kernels' largest d the chunk's step falls back to the array code, the window's
    senders given as the kernels get them: the numpy run's states."""
    from vfesim.backends.numba_backend import QUANTUM_JACOBI_MAX_D

    d = dict(_scenario("channels", "ring", coupling="C1", coupling_strength=0.3, dephasing_rate=0.2))
    d["quantum"] = {**d["quantum"], "d": QUANTUM_JACOBI_MAX_D + 1}
    scn = Scenario.from_dict(d)
    make = lambda backend: scn.spec.make_integrator(scn.model, scn.integrator, backend=backend, seed=5)  # noqa: E731
    state = scn.initial_state()
    ref = make("numpy")
    want = ref.step(ref.init(state))
    dk = make(dataclasses.replace(get("dask"), chunks=(3, 3, 1)))
    got = dk.step(dk.init(state))
    _close(got.state["rho"].values, want.state["rho"].values)
