"""The run loop: frames, checkpoints, resume, guards (tiny populations)."""

import importlib
import json

import numpy as np
import pytest
import xarray as xr

import vfesim
from vfesim.io import RunStore, StoreError, open_run
from vfesim.scenario import Scenario, ScenarioError
from vfesim.simulate import RunError, resume, simulate

BASE = {
    "model": {"K": 3, "lambda_belief": 1.0, "kappa_beta": 2.0},
    "population": {"n_agents": 6, "seed": 1},
    "integrator": {"method": "gradient_flow", "dt": 0.02},
    "run": {"n_steps": 12, "save_every": 2, "checkpoint_every": 4},
}


def scenario(**changes):
    d = {k: dict(v) for k, v in BASE.items()}
    for sec, kv in changes.items():
        d.setdefault(sec, {}).update(kv)
    return Scenario.from_dict(d)


def test_run_writes_every_frame_and_checkpoints(tmp_path):
    out = tmp_path / "r.zarr"
    run = simulate(scenario(), out=out, progress=False)
    assert run.step == 12
    ds = run.open()
    assert ds.sizes["time"] == 7
    np.testing.assert_array_equal(ds["step"].values, np.arange(0, 13, 2))
    for k in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi", "energy_total"):
        assert k in ds and np.isfinite(ds[k].values).all()
    np.testing.assert_array_equal(ds["mu_q"].values[-1], run.state["mu_q"].values)
    assert ds["energy_total"].values[-1] == run.terms["total"]
    assert ds.attrs["status"] == "complete"
    assert RunStore(out).checkpoint_steps() == [8, 12]  # newest two kept
    plain = xr.open_zarr(out, consolidated=False)
    assert plain.sizes["time"] == 7
    assert json.loads(ds.attrs["scenario"])["scenario"]["run"]["n_steps"] == 12


@pytest.mark.parametrize("time_chunk", [1, 3, 50])
def test_resume_extends_bitwise(tmp_path, time_chunk, monkeypatch):
    full = simulate(scenario(), out=tmp_path / "a.zarr", progress=False)
    writes = []
    real = RunStore.write_frames

    def spy(self, start, frames):
        writes.append((start, len(frames)))
        return real(self, start, frames)

    monkeypatch.setattr(RunStore, "write_frames", spy)
    part = simulate(
        scenario(output={"time_chunk": time_chunk}), out=tmp_path / "b.zarr", steps=6, progress=False
    )
    assert part.step == 6
    resumed = resume(tmp_path / "b.zarr", steps=12, progress=False)
    a, b = open_run(tmp_path / "a.zarr"), open_run(tmp_path / "b.zarr")
    for k in a.data_vars:
        np.testing.assert_array_equal(a[k].values, b[k].values, err_msg=k)
    assert resumed.terms == full.terms
    # Every write starts on a chunk boundary and stays inside one chunk.
    assert writes and all(s % time_chunk == 0 and 0 < n <= time_chunk for s, n in writes if n)


def test_resume_complete_run_is_a_no_op(tmp_path):
    simulate(scenario(), out=tmp_path / "a.zarr", progress=False)
    run = resume(tmp_path / "a.zarr", progress=False)
    assert run.step == 12


def test_existing_output_refused_then_overwritten(tmp_path):
    out = tmp_path / "a.zarr"
    simulate(scenario(), out=out, steps=2, progress=False)
    with pytest.raises(StoreError, match="already exists"):
        simulate(scenario(), out=out, progress=False)
    run = simulate(scenario(), out=out, steps=4, progress=False, overwrite=True)
    assert open_run(out).sizes["time"] == 3 and run.step == 4


def test_overwrite_refuses_foreign_directory(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("x")
    with pytest.raises(StoreError, match="not a vfesim run"):
        simulate(scenario(), out=tmp_path / "data", overwrite=True, progress=False)
    assert (tmp_path / "data" / "precious.txt").exists()


def test_unwritable_output_fails_before_computing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="not writable"):
        simulate(scenario(), out=blocker / "r.zarr", progress=False)


def test_resume_refuses_other_version_and_config(tmp_path, monkeypatch):
    out = tmp_path / "a.zarr"
    simulate(scenario(), out=out, steps=4, progress=False)
    with pytest.raises(RunError, match=r"model\.kappa_beta"):
        resume(out, scenario=scenario(model={"kappa_beta": 3.0}), progress=False)
    monkeypatch.setattr(importlib.import_module("vfesim.simulate"), "__version__", "99.0")
    with pytest.raises(RunError, match="written by vfesim 0.1.0, this is 99.0"):
        resume(out, progress=False)
    run = resume(out, steps=12, progress=False, allow_version_change=True)
    assert run.step == 12


def test_model_config_with_sections(tmp_path):
    cfg = vfesim.ModelConfig(K=3)
    run = simulate(
        cfg,
        out=tmp_path / "c.zarr",
        population={"n_agents": 4},
        integrator={"dt": 0.01},
        run={"n_steps": 3},
        progress=False,
    )
    assert run.step == 3 and open_run(run.path).sizes["time"] == 4


def test_unknown_backend_names_key(tmp_path):
    with pytest.raises(ScenarioError, match="run.backend"):
        simulate(scenario(), out=tmp_path / "x.zarr", backend="fortran", progress=False)
    assert not (tmp_path / "x.zarr").exists()


def test_nan_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from vfesim.integrators.base import DynamicsError, guard_state

    mod = importlib.import_module("vfesim.simulate")
    real = mod._make_integrator

    def poisoned(scn, backend, state):
        integ = real(scn, backend, state)

        def step(c):
            c = integ.step(c)
            if c.step == 7:
                arrays = {k: c.state[k].values.copy() for k in c.state.data_vars}
                arrays["mu_q"][2, 1] = np.nan
                guard_state(c.step, arrays, scn.model, c.aux)
            return c

        return integ._replace(step=step)

    clean = simulate(scenario(), out=tmp_path / "clean.zarr", progress=False)
    monkeypatch.setattr(mod, "_make_integrator", poisoned)
    out = tmp_path / "bad.zarr"
    with pytest.raises(DynamicsError, match=r"step 7: mu_q\[agent=2\]: contains NaN or Inf"):
        simulate(scenario(), out=out, progress=False)
    store = RunStore(out)
    assert store.checkpoint_steps() == [0, 4]
    ckpt = store.latest_checkpoint()
    ref = open_run(clean.path).sel(time=ckpt.step * 0.02, method="nearest")
    np.testing.assert_array_equal(ckpt.state["mu_q"].values, ref["mu_q"].values)
    ds = open_run(out)
    assert ds.attrs["status"].startswith("failed: step 7")
    assert int(ds["step"].values[-1]) >= 4 and np.isfinite(ds["mu_q"].values).all()
    monkeypatch.setattr(mod, "_make_integrator", real)
    run = resume(out, progress=False)
    np.testing.assert_array_equal(run.state["mu_q"].values, clean.state["mu_q"].values)


def test_write_failure_mid_run_is_reported_and_resumable(tmp_path, monkeypatch):
    import errno
    import os

    clean = simulate(scenario(), out=tmp_path / "clean.zarr", progress=False)
    real = os.replace
    calls = {"n": 0}

    def full_disk(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            calls["n"] += 1
            if calls["n"] == 3:  # checkpoints at steps 0 and 4 land, step 8 hits a full disk
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    out = tmp_path / "full.zarr"
    with pytest.raises(StoreError, match="No space left"):
        simulate(scenario(), out=out, progress=False)
    monkeypatch.undo()
    assert RunStore(out).checkpoint_steps() == [0, 4]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert open_run(out).attrs["status"].startswith("failed: StoreError")
    run = resume(out, progress=False)
    np.testing.assert_array_equal(run.state["mu_q"].values, clean.state["mu_q"].values)
    a, b = open_run(out), open_run(clean.path)
    np.testing.assert_array_equal(a["sigma_q"].values, b["sigma_q"].values)
