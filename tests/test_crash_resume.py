"""SIGKILL a run at random moments (also inside trajectory and checkpoint writes), resume it, and
check the final store is bitwise identical to an uninterrupted run.

Kills come two ways: (1) a wrapper counts the Zarr store's key writes and SIGKILLs its own process
just before the n-th one (n random): this lands between any two file operations of the run,
including the middle of a checkpoint (temporary store half written, not yet renamed) and between
the trajectory flush and the checkpoint; (2) an external SIGKILL after a random fraction of the
time an uninterrupted run takes on this machine.
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr.storage

from vfesim.io import RunStore, open_run
from vfesim.scenario import read_toml
from vfesim.simulate import simulate

WRAPPER = r"""
import os, signal, sys
import zarr.storage
# Ctrl-C as in a terminal: a background job of a non-interactive shell (a CI script's `cmd &`) starts with
# SIGINT ignored, which vfesim respects (it routes only signals whose handler is Python's default).
signal.signal(signal.SIGINT, signal.default_int_handler)
kill_at = int(os.environ.get("VFESIM_TEST_KILL_AT", "0"))
n = 0
orig = zarr.storage.LocalStore.set
async def counted_set(self, key, value):
    global n
    n += 1
    if n == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return await orig(self, key, value)
zarr.storage.LocalStore.set = counted_set
# VFESIM_TEST_SIGNAL_AT = "STEP,SIGNUM[,SETS]": send SIGNUM once step STEP is done; with SETS, send it
# again at the SETS-th store write after that (inside the checkpoint the first signal asks for).
signal_at = os.environ.get("VFESIM_TEST_SIGNAL_AT")
if signal_at:
    import vfesim.progress
    step_at, signum, *again = map(int, signal_at.split(","))
    update, sent = vfesim.progress.Progress.update, {"sets": None}
    def update_then_signal(self, step, F=None):
        update(self, step, F)
        if step == step_at and sent["sets"] is None:
            sent["sets"] = 0
            os.kill(os.getpid(), signum)
    vfesim.progress.Progress.update = update_then_signal
    def set_then_signal(self, key, value):
        if again and sent["sets"] is not None:
            sent["sets"] += 1
            if sent["sets"] == again[0]:
                os.kill(os.getpid(), signum)
        return counted_set(self, key, value)
    zarr.storage.LocalStore.set = set_then_signal
from vfesim.cli import main
sys.exit(main(sys.argv[1:]))
"""

SCENARIOS = {
    "verlet": """
[model]
K = 3
kappa_beta = 2.0
[population]
n_agents = 6
seed = 4
[integrator]
method = "verlet"
dt = 0.05
friction = 0.2
[run]
n_steps = 24
save_every = 2
checkpoint_every = 6
seed = 11
[output]
time_chunk = 4
""",
    "adam": """
[model]
K = 3
lambda_prior = 0.5
[population]
n_agents = 5
seed = 5
[integrator]
method = "gradient_flow"
dt = 0.01
options = { rule = "adam" }
[run]
n_steps = 24
save_every = 3
checkpoint_every = 6
[output]
time_chunk = 2
""",
}


def _cli(args, kill_at=0, kill_after_s=None, signal_at=""):
    env = {**os.environ, "VFESIM_TEST_KILL_AT": str(kill_at), "VFESIM_TEST_SIGNAL_AT": signal_at}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, *args, "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if kill_after_s is not None:
        try:
            proc.wait(kill_after_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _assert_prefix_of(ds, ref):
    n = ds.sizes["time"]
    assert n <= ref.sizes["time"]
    for k in ref.data_vars:
        np.testing.assert_array_equal(ds[k].values, ref[k].values[:n], err_msg=k)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_kill_anywhere_then_resume_is_bitwise(name, tmp_path, monkeypatch):
    toml = tmp_path / f"{name}.toml"
    toml.write_text(SCENARIOS[name])
    count = {"n": 0}
    orig = zarr.storage.LocalStore.set

    async def counted_set(self, key, value):
        count["n"] += 1
        return await orig(self, key, value)

    monkeypatch.setattr(zarr.storage.LocalStore, "set", counted_set)
    ref_run = simulate(read_toml(toml), out=tmp_path / "ref.zarr", progress=False)
    monkeypatch.undo()
    n_sets = count["n"]
    ref = open_run(tmp_path / "ref.zarr").load()

    # Calibrate the timed kill on this machine: one uninterrupted CLI run (imports included).
    t0 = time.perf_counter()
    rc, err = _cli(["run", str(toml), "--out", str(tmp_path / "timing.zarr")])
    assert rc == 0, err
    t_full = time.perf_counter() - t0

    rng = random.Random(f"crash-{name}")
    out = tmp_path / "run.zarr"
    kills, attempts, n_steps = 0, 0, ref_run.step
    modes = ["set", "time", "set", "set"]
    while True:
        attempts += 1
        assert attempts <= 30, "the run did not finish"
        done = RunStore(out).checkpoint_steps()[-1] if out.exists() else 0
        left = max(3, int(n_sets * (1 - done / n_steps)))
        how = modes[kills] if kills < len(modes) else "none"
        cmd = ["resume", str(out)] if out.exists() else ["run", str(toml), "--out", str(out)]
        rc, err = _cli(
            cmd,
            kill_at=rng.randint(2, left) if how == "set" else 0,
            kill_after_s=rng.uniform(0.4, 0.95) * t_full if how == "time" else None,
        )
        if rc == 0:
            if RunStore(out).checkpoint_steps()[-1] == n_steps and kills >= len(modes):
                break
            # Finished before the kill: start again from a fresh store.
            if kills < len(modes):
                shutil.rmtree(out)
            continue
        assert rc == -signal.SIGKILL, err
        kills += 1
        if out.exists():
            _assert_prefix_of(open_run(out).load(), ref)
            ckpt = RunStore(out).latest_checkpoint()
            assert ckpt is not None and ckpt.step <= n_steps
            saved = open_run(out).sizes["time"]
            assert saved >= ckpt.step // ref_run.scenario.run["save_every"] + 1
    assert kills >= 3
    final = open_run(out).load()
    assert final.attrs["status"] == "complete"
    assert final.sizes["time"] == ref.sizes["time"]
    _assert_prefix_of(final, ref)
    ckpt = RunStore(out).latest_checkpoint()
    assert ckpt.step == ref_run.step
    for k in ref_run.state.data_vars:
        np.testing.assert_array_equal(ckpt.state[k].values, ref_run.state[k].values, err_msg=k)
    assert ckpt.terms == ref_run.terms
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name or ".partial" in p.name]


def test_kill_during_creation_leaves_no_store(tmp_path):
    toml = tmp_path / "s.toml"
    toml.write_text(SCENARIOS["verlet"])
    out = tmp_path / "run.zarr"
    rc, _ = _cli(["run", str(toml), "--out", str(out)], kill_at=3)
    assert rc == -signal.SIGKILL
    assert not out.exists()
    rc, err = _cli(["resume", str(out)])
    assert rc == 4 and "killed before its first checkpoint" in err
    assert not list(tmp_path.glob(".run.zarr.creating-*"))  # the leftover is cleaned up
    rc, _ = _cli(["run", str(toml), "--out", str(out)], kill_at=3)
    rc, err = _cli(["run", str(toml), "--out", str(out)])
    assert rc == 0, err
    assert "killed before its first checkpoint" in err
    assert open_run(out).attrs["status"] == "complete"
    assert not list(tmp_path.glob(".run.zarr.creating-*"))


@pytest.mark.parametrize(
    "signum, again, rc_want, ckpt_want",
    [
        (signal.SIGTERM, 0, 143, 15),  # checkpoints step 15 (between the checkpoints at 12 and 18)
        (signal.SIGINT, 3, 130, 12),  # a second Ctrl-C inside that checkpoint write: step 12 stays
    ],
    ids=["sigterm", "sigint-twice"],
)
def test_signal_checkpoints_the_current_step_then_resume_is_bitwise(
    signum, again, rc_want, ckpt_want, tmp_path
):
    toml = tmp_path / "verlet.toml"
    toml.write_text(SCENARIOS["verlet"])  # 24 steps, a frame every 2, a checkpoint every 6
    ref_run = simulate(read_toml(toml), out=tmp_path / "ref.zarr", progress=False)
    ref = open_run(tmp_path / "ref.zarr").load()
    out = tmp_path / "run.zarr"
    signal_at = f"15,{int(signum)}" + (f",{again}" if again else "")
    rc, err = _cli(["run", str(toml), "--out", str(out)], signal_at=signal_at)
    assert rc == rc_want, err
    assert f"at step 15; the last checkpoint is at step {ckpt_want}: `vfesim resume {out} --steps 24`" in err
    assert "Traceback" not in err
    assert RunStore(out).checkpoint_steps()[-1] == ckpt_want
    stopped = open_run(out).load()
    assert stopped.attrs["status"] == "interrupted"
    assert stopped.sizes["time"] >= ckpt_want // 2 + 1
    _assert_prefix_of(stopped, ref)
    rc, err = _cli(["resume", str(out)])
    assert rc == 0, err
    final = open_run(out).load()
    assert final.attrs["status"] == "complete" and final.sizes["time"] == ref.sizes["time"]
    _assert_prefix_of(final, ref)
    ckpt = RunStore(out).latest_checkpoint()
    assert ckpt.step == 24 and ckpt.terms == ref_run.terms
    for k in ref_run.state.data_vars:
        np.testing.assert_array_equal(ckpt.state[k].values, ref_run.state[k].values, err_msg=k)
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
