"""Store integrity and safety: checksummed chunks, verify before resume with fallback, `vfesim verify`,
one writer per store, no writes through links, SIGTERM, leftovers of killed creations (issue 9)."""

import errno
import importlib
import json
import logging
import os
import shutil
import signal

import numpy as np
import pytest
import zarr.storage

from vfesim.cli import main
from vfesim.io import RunStore, StoreError, open_run
from vfesim.io.lock import store_lock
from vfesim.scenario import Scenario, ScenarioError
from vfesim.simulate import RunError, resume, run_info, simulate

sim = importlib.import_module("vfesim.simulate")  # the module (vfesim.simulate is also a function)

SCN = {
    "model": {"K": 3, "kappa_beta": 2.0},
    "population": {"n_agents": 4, "seed": 2},
    "integrator": {"method": "verlet", "dt": 0.05},
    "run": {"n_steps": 12, "save_every": 2, "checkpoint_every": 4},
    "output": {"time_chunk": 3},
}
CK12 = "checkpoints/step-000000000012"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 12-step run (checkpoints at steps 8 and 12) and the same run resumed intact to 16."""
    d = tmp_path_factory.mktemp("integrity")
    simulate(Scenario.from_dict(SCN), out=d / "base.zarr", progress=False)
    shutil.copytree(d / "base.zarr", d / "ref.zarr")
    ref = resume(d / "ref.zarr", steps=16, progress=False)
    return d / "base.zarr", ref, open_run(d / "ref.zarr").load()


@pytest.fixture
def run(base, tmp_path):
    out = tmp_path / "r.zarr"
    shutil.copytree(base[0], out)
    return out


def snapshot(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def flip(p):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(bytes(b))
    return bytes(b)


def cli(*args):
    """``vfesim ARGS`` in this process; the logger is handed back to pytest afterwards."""
    log = logging.getLogger("vfesim")
    try:
        return main([str(a) for a in args])
    finally:
        log.handlers.clear()
        log.propagate, log.level = True, logging.NOTSET


def verify_cli(path, capsys):
    rc = cli("verify", path)
    return rc, capsys.readouterr().out


def assert_same_as_intact_resume(out, base):
    _, ref, ref_ds = base
    ckpt = RunStore(out).latest_checkpoint()
    assert ckpt.step == 16
    for k in ref.state.data_vars:
        np.testing.assert_array_equal(ckpt.state[k].values, ref.state[k].values, err_msg=k)
    ds = open_run(out).load()
    for k in ref_ds.data_vars:
        np.testing.assert_array_equal(ds[k].values, ref_ds[k].values, err_msg=k)


def test_every_array_is_checksummed_and_verifies(run, capsys):
    metas = [json.loads(p.read_text()) for p in run.rglob("zarr.json")]
    arrays = [m for m in metas if m["node_type"] == "array"]
    assert len(arrays) > 20
    assert all(any(c["name"] == "crc32c" for c in m["codecs"]) for m in arrays)
    assert all(r.intact and not r.unchecksummed for r in RunStore(run).verify())
    rc, out = verify_cli(run, capsys)
    assert rc == 0 and out.strip().endswith("intact")
    assert "ok      checkpoint step-000000000008" in out


@pytest.mark.parametrize("damage", ["bit flip", "deleted chunk", "truncated chunk", "bad zarr.json"])
def test_damaged_latest_checkpoint_falls_back_and_keeps_the_damage(damage, run, base, capsys, caplog):
    chunk = run / CK12 / "mu_q" / "c" / "0" / "0"
    if damage == "bit flip":
        kept, key = flip(chunk), "c/0/0"
    elif damage == "deleted chunk":
        chunk.unlink()
        kept, key = None, "c/0/0"
    elif damage == "truncated chunk":
        kept, key = chunk.read_bytes()[:20], "c/0/0"
        chunk.write_bytes(kept)
    else:
        chunk = run / CK12 / "mu_q" / "zarr.json"
        kept, key = b'{"shape": [4, 3], "data_ty', "zarr.json"
        chunk.write_bytes(kept)
    rc, out = verify_cli(run, capsys)
    assert rc == 5 and "DAMAGED checkpoint step-000000000012" in out
    assert f"{CK12}/mu_q {key}:" in out

    resume(run, steps=16, progress=False)
    assert f"checkpoint at step 12 is damaged: {CK12}/mu_q {key}" in caplog.text
    assert "resuming from the checkpoint at step 8, the newest intact one" in caplog.text
    assert_same_as_intact_resume(run, base)
    # The damaged checkpoint is still there, byte for byte, set aside (and not pruned).
    aside = (
        run / "checkpoints" / "damaged-step-000000000012" / "mu_q" / chunk.relative_to(run / CK12 / "mu_q")
    )
    assert aside.read_bytes() == kept if kept is not None else not aside.exists()
    assert RunStore(run).checkpoint_steps() == [12, 16]


def test_no_intact_checkpoint_refuses_and_changes_nothing(run, capsys):
    (run / CK12 / "sigma_q" / "c" / "0" / "0" / "0").unlink()  # reads back as NaN without a check
    p8 = run / "checkpoints" / "step-000000000008" / "phi" / "c" / "0" / "0"
    p8.write_bytes(p8.read_bytes()[:-3])
    before = snapshot(run)
    with pytest.raises(RunError, match=r"no intact checkpoint.*step 8: .*phi c/0/0: checksum mismatch"):
        resume(run, steps=16, progress=False)
    assert snapshot(run) == before  # not extended, scenario not rewritten, nothing set aside
    assert cli("resume", run, "--steps", 16) == 4
    assert "vfesim verify" in capsys.readouterr().err


def test_damaged_trajectory_chunk_refuses_resume(run, capsys):
    flip(run / "mu_q" / "c" / "1" / "0" / "0")
    before = snapshot(run)
    with pytest.raises(RunError, match=r"trajectory is damaged: mu_q c/1/0/0: checksum mismatch"):
        resume(run, steps=16, progress=False)
    assert snapshot(run) == before
    rc, out = verify_cli(run, capsys)
    assert rc == 5 and "DAMAGED trajectory" in out and "mu_q c/1/0/0: checksum mismatch" in out
    assert "ok      checkpoint step-000000000012" in out


def test_deleted_trajectory_chunk_is_damage_not_nan(run, capsys):
    (run / "energy_total" / "c" / "0").unlink()
    with pytest.raises(RunError, match=r"energy_total c/0: missing"):
        resume(run, steps=16, progress=False)
    assert verify_cli(run, capsys)[0] == 5


def test_damaged_root_zarr_json(run, capsys):
    (run / "zarr.json").write_bytes(b"\x00garbage")
    before = snapshot(run)
    with pytest.raises(StoreError, match=r"r.zarr: zarr.json is damaged"):
        resume(run, steps=16, progress=False)
    assert snapshot(run) == before
    rc, out = verify_cli(run, capsys)
    assert rc == 5 and "/ zarr.json:" in out and "ok      checkpoint step-000000000012" in out


def test_store_without_checksums_resumes_with_a_note(tmp_path, monkeypatch, caplog, capsys):
    from zarr.codecs import ZstdCodec

    plain = lambda names: {k: {"compressors": (ZstdCodec(level=0),)} for k in names}  # noqa: E731
    monkeypatch.setattr("vfesim.io.store.checksummed_encoding", plain)
    out = tmp_path / "old.zarr"
    simulate(Scenario.from_dict(SCN), out=out, steps=8, progress=False)
    monkeypatch.undo()
    run = resume(out, steps=12, progress=False)
    assert run.step == 12 and "without chunk checksums" in caplog.text
    rc, text = verify_cli(out, capsys)
    assert rc == 0 and "cannot be detected" in text


def test_missing_version_attribute_is_named(run):
    meta = json.loads((run / "zarr.json").read_text())
    del meta["attributes"]["vfesim_version"]
    (run / "zarr.json").write_text(json.dumps(meta))
    for call in (lambda: resume(run, progress=False), lambda: run_info(run)):
        with pytest.raises(StoreError, match=r"r.zarr: zarr.json has no attribute 'vfesim_version'"):
            call()


def test_second_writer_on_the_same_path_is_refused(run, tmp_path):
    before = snapshot(run)
    with store_lock(run):  # as another process holding the store does
        with pytest.raises(StoreError, match=r"r.zarr: in use by another vfesim process"):
            resume(run, steps=16, progress=False)
        with pytest.raises(StoreError, match="in use by another vfesim process"):
            simulate(Scenario.from_dict(SCN), out=run, overwrite=True, progress=False)
    assert snapshot(run) == before
    assert resume(run, steps=16, progress=False).step == 16  # the lock is gone with its holder


def test_lock_is_held_while_running(tmp_path, monkeypatch):
    """A second run on the same path (even with overwrite) fails at every moment of the first:
    while its store is being created and while it runs."""
    seen = []

    def probe(*args):
        with pytest.raises(StoreError, match="in use"):
            simulate(Scenario.from_dict(SCN), out=tmp_path / "r.zarr", overwrite=True, progress=False)
        seen.append(args[2].step)
        return orig(*args)

    orig = sim._checkpoint
    monkeypatch.setattr(sim, "_checkpoint", probe)
    simulate(Scenario.from_dict(SCN), out=tmp_path / "r.zarr", progress=False)
    assert seen == [0, 4, 8, 12]


def test_links_and_foreign_entries_in_a_store_are_refused(run, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.move(run / "checkpoints", outside)
    (run / "checkpoints").symlink_to(outside)
    before = snapshot(outside)
    with pytest.raises(StoreError, match=r"r.zarr: checkpoints is a symbolic link"):
        resume(run, steps=16, progress=False)
    assert snapshot(outside) == before
    (run / "checkpoints").unlink()
    shutil.move(outside, run / "checkpoints")
    (run / "checkpoints" / "notes").mkdir()
    with pytest.raises(StoreError, match=r"checkpoints/notes is not a vfesim checkpoint"):
        resume(run, steps=16, progress=False)


def test_deletes_stay_inside_the_store(run, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("x")
    link = run / "checkpoints" / ".trash-deadbeef"
    link.symlink_to(victim)
    with pytest.raises(StoreError, match="not inside the store"):
        RunStore(run).clean()
    assert (victim / "keep.txt").exists()


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_interrupt_marks_the_store_and_can_be_resumed(how, tmp_path, monkeypatch, base):
    out = tmp_path / "r.zarr"
    orig = sim._checkpoint

    def stop_after_step_4(store, scn, carry, *args):
        orig(store, scn, carry, *args)
        if carry.step == 4:
            if how == "sigterm":  # a real signal, handled in the main thread: deferred to the step's end
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise KeyboardInterrupt

    monkeypatch.setattr(sim, "_checkpoint", stop_after_step_4)
    with pytest.raises(KeyboardInterrupt) as err:
        simulate(Scenario.from_dict(SCN), out=out, progress=False)
    assert isinstance(err.value, sim.Terminated) == (how == "sigterm")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    assert open_run(out).attrs["status"] == "interrupted"
    assert RunStore(out).checkpoint_steps() == [0, 4]
    monkeypatch.undo()
    resume(out, steps=16, progress=False)
    assert_same_as_intact_resume(out, base)


def test_cli_exit_codes_and_message_on_interrupt(tmp_path, monkeypatch, capsys):
    toml = tmp_path / "s.toml"
    toml.write_text(
        '[model]\nK = 3\n[population]\nn_agents = 4\n[integrator]\nmethod = "verlet"\ndt = 0.05\n'
        "[run]\nn_steps = 12\nsave_every = 2\ncheckpoint_every = 4\n"
    )
    orig = sim._checkpoint
    for exc, code, word in (
        (sim.Terminated, 143, "terminated (SIGTERM)"),
        (KeyboardInterrupt, 130, "interrupted"),
    ):

        def stop(store, scn, carry, *args, exc=exc):
            orig(store, scn, carry, *args)
            if carry.step == 4:
                raise exc

        monkeypatch.setattr(sim, "_checkpoint", stop)
        out = tmp_path / f"{code}.zarr"
        assert cli("run", toml, "--out", out, "-q") == code
        err = capsys.readouterr().err
        assert f"{word} at step 4" in err
        assert f"`vfesim resume {out} --steps 12` continues the run" in err
        monkeypatch.setattr(sim, "_checkpoint", orig)
        assert cli("resume", out, "-q") == 0


def test_kill_before_first_checkpoint_is_explained_and_cleaned(tmp_path, caplog):
    out = tmp_path / "r.zarr"

    def leftover():  # what a run killed before its first checkpoint leaves
        st = Scenario.from_dict(SCN).initial_state()
        RunStore.create(out, st, ["total"], trajectory=("mu_q",), n_steps=2, save_every=1, dt=0.1,
                        time_chunk=1, attrs={})  # fmt: skip
        (made,) = tmp_path.glob(".r.zarr.creating-*")
        return made

    made = leftover()
    with store_lock(out), pytest.raises(StoreError, match="in use"):
        resume(out, progress=False)  # its owner may still be alive: left alone
    assert made.exists()
    with pytest.raises(StoreError, match="killed before its first checkpoint.*start it again"):
        resume(out, progress=False)
    assert not made.exists() and not out.exists()
    made = leftover()
    simulate(Scenario.from_dict(SCN), out=out, steps=4, progress=False)
    assert "killed before its first checkpoint; removed its unfinished store" in caplog.text
    assert not made.exists() and not list(tmp_path.glob(".r.zarr.creating-*"))


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), MemoryError()])
def test_failed_creation_names_the_users_path_and_cleans_up(error, tmp_path, monkeypatch):
    out = tmp_path / "r.zarr"

    async def fail(self, key, value):
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, str(self.root / key))
        raise error

    monkeypatch.setattr(zarr.storage.LocalStore, "set", fail)
    with pytest.raises(StoreError if isinstance(error, OSError) else MemoryError) as e:
        simulate(Scenario.from_dict(SCN), out=out, progress=False)
    if isinstance(error, OSError):
        assert str(out) in str(e.value) and "creating" not in str(e.value)
        assert "No space left on device" in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".r.zarr.*-*"))


def test_huge_time_chunk_is_refused_naming_the_key(tmp_path):
    scn = Scenario.from_dict({**SCN, "output": {"time_chunk": 10**8}})
    with pytest.raises(ScenarioError, match=r"output.time_chunk.*GiB per Zarr chunk"):
        simulate(scn, out=tmp_path / "r.zarr", progress=False)
    assert not list(tmp_path.iterdir()) or [p.name for p in tmp_path.iterdir()] == [".r.zarr.lock"]
