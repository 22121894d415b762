"""The run store: layout readable by plain xarray, checkpoints round-trip exactly, fallbacks."""

import json
import os
import shutil

import numpy as np
import pytest
import xarray as xr

from vfesim.io import RunStore, StoreError, open_run
from vfesim.scenario import Scenario
from vfesim.simulate import simulate

SCN = {
    "model": {"K": 3},
    "population": {"n_agents": 4, "seed": 2},
    "integrator": {"method": "verlet", "dt": 0.05},
    "run": {"n_steps": 12, "save_every": 2, "checkpoint_every": 4},
    "output": {"time_chunk": 3},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return simulate(Scenario.from_dict(SCN), out=tmp_path_factory.mktemp("io") / "r.zarr", progress=False)


def test_plain_xarray_reads_the_store(run):
    ds = xr.open_zarr(run.path, consolidated=False)
    assert ds["mu_q"].dims == ("time", "agent", "latent")
    assert ds["sigma_q"].dims == ("time", "agent", "latent", "latent_b")
    assert ds["phi"].dims == ("time", "agent", "gauge")
    assert ds["mu_q"].encoding["chunks"][0] == 3
    assert "step" in ds.coords and ds["time"].values[1] == pytest.approx(0.1)
    for k in ("format", "scenario", "model_config", "vfesim_version", "dtype", "backend"):
        assert k in ds.attrs
    assert ds.attrs["dtype"] == "float64" and ds["mu_q"].dtype == np.float64
    assert {
        "energy_total",
        "energy_self",
        "energy_kinetic",
        "energy_hamiltonian",
    } <= set(ds.data_vars)
    assert bool(ds["saved"].all())


def test_open_run_trims_to_written_frames(run, tmp_path):
    out = tmp_path / "short.zarr"
    simulate(Scenario.from_dict(SCN), out=out, steps=6, progress=False)
    store = RunStore(out)
    store.extend(12, 2, 0.05)  # room for 12 steps, nothing written there yet
    plain = xr.open_zarr(out, consolidated=False)
    assert plain.sizes["time"] == 7 and np.isnan(plain["mu_q"].values[4:]).all()
    assert plain["saved"].values.tolist() == [True] * 4 + [False] * 3
    ds = open_run(out)
    assert ds.sizes["time"] == 4 and ds["step"].values.tolist() == [0, 2, 4, 6]


def test_checkpoint_round_trip_is_exact(run):
    store = RunStore(run.path)
    ckpt = store.latest_checkpoint()
    assert ckpt.step == 12 and ckpt.attrs["backend"] == "numpy"
    for k in run.state.data_vars:
        np.testing.assert_array_equal(ckpt.state[k].values, run.state[k].values)
    assert ckpt.terms == run.terms  # JSON floats round-trip exactly
    assert set(ckpt.aux) and all(a.dtype == np.float64 for a in ckpt.aux.values())
    assert json.loads(ckpt.attrs["scenario"])["scenario"]["run"]["n_steps"] == 12
    assert ckpt.attrs["vfesim_version"] and ckpt.attrs["frames_saved"] == 7


def test_rng_state_and_odd_aux_round_trip(tmp_path, run):
    store = RunStore(tmp_path / "s.zarr")
    (tmp_path / "s.zarr" / "checkpoints").mkdir(parents=True)
    rng = np.random.default_rng(123)
    rng.standard_normal(5)
    aux = {
        "p_mu_q": np.arange(12.0).reshape(4, 3),
        "count": np.array([3], np.int64),
        "m": np.ones((2, 2, 2), np.float32),
    }
    store.write_checkpoint(run.state, 5, aux, rng.bit_generator.state, {"total": 0.1 + 0.2}, {})
    ck = store.load_checkpoint(5)
    again = np.random.default_rng()
    again.bit_generator.state = ck.rng_state
    assert again.standard_normal() == rng.standard_normal()
    for k, a in aux.items():
        np.testing.assert_array_equal(ck.aux[k], a)
        assert ck.aux[k].dtype == a.dtype
    assert ck.terms["total"] == 0.1 + 0.2


def test_damaged_newest_checkpoint_falls_back(run, tmp_path, caplog):
    out = tmp_path / "copy.zarr"
    shutil.copytree(run.path, out)
    store = RunStore(out)
    newest = store.ckpt_dir / "step-000000000012"
    shutil.rmtree(newest / "mu_q")
    ckpt = store.latest_checkpoint()
    assert ckpt.step == 8
    assert "step 12 is damaged: checkpoints/step-000000000012/mu_q zarr.json: missing" in caplog.text


def test_zarr_local_store_replaces_files_atomically(tmp_path, monkeypatch):
    """Crash safety rests on zarr's LocalStore writing temp files and renaming them into place."""
    import zarr

    renamed = []
    real = os.replace

    def spy(src, dst):
        renamed.append((str(src), str(dst)))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    a = zarr.create_array(tmp_path / "a.zarr", shape=(4,), chunks=(2,), dtype="f8")
    a[:2] = 1.0
    assert any(src.endswith(".partial") and dst.endswith("c/0") for src, dst in renamed)


def test_not_a_run(tmp_path):
    with pytest.raises(StoreError, match="not a vfesim run store"):
        open_run(tmp_path)


def test_extend_killed_half_way_is_repaired_by_the_next_resume(tmp_path):
    import zarr

    from vfesim.simulate import resume

    full = simulate(Scenario.from_dict(SCN), out=tmp_path / "full.zarr", progress=False)
    out = tmp_path / "part.zarr"
    simulate(Scenario.from_dict(SCN), out=out, steps=4, progress=False)
    zarr.open_array(out / "mu_q", mode="r+").resize((7, 4, 3))  # as if killed inside extend()
    with pytest.raises(ValueError):
        xr.open_zarr(out, consolidated=False)
    run = resume(out, steps=12, progress=False)
    np.testing.assert_array_equal(run.state["mu_q"].values, full.state["mu_q"].values)
    ds = open_run(out)
    assert ds.sizes["time"] == 7 and ds["step"].values.tolist() == list(range(0, 13, 2))
