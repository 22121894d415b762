"""Runs tests/cudasim under the Numba CUDA simulator in subprocesses, so one plain ``pytest`` covers the
CUDA code path on a machine without a GPU (NUMBA_ENABLE_CUDASIM must be set before numba is imported).
One subprocess per file, so that pytest-xdist spreads them over the workers (tests/conftest.py puts them
first: they are the longest). They need numba-cuda (the ``cudasim`` extra): without it they skip saying so,
or fail where ``VFESIM_REQUIRE_CUDASIM=1`` (CI, tox)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_numba_cuda

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p.name for p in (ROOT / "tests" / "cudasim").glob("test_*.py"))


def test_every_simulator_file_is_run():
    assert len(FILES) >= 6 and "test_cuda_backend_sim.py" in FILES


@pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
    reason="simulator active: tests/cudasim is collected directly",
)
@pytest.mark.parametrize("name", FILES)
def test_cuda_simulator_suite(name):
    needs_numba_cuda()  # skips naming the `cudasim` extra; fails under VFESIM_REQUIRE_CUDASIM=1
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONUNBUFFERED="1")
    # One process each: the outer run already has a worker per core (pytest-xdist).
    cmd = [sys.executable, "-m", "pytest", f"tests/cudasim/{name}", "-q", "-p", "no:cacheprovider", "-n", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"simulator tests failed (exit {proc.returncode}):\n{out[-20000:]}"
    assert " passed" in out and "no tests ran" not in out, out[-5000:]


def test_missing_numba_cuda_skips_naming_the_extra_or_fails_where_required(monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "HAVE_NUMBA_CUDA", False)
    monkeypatch.delenv("VFESIM_REQUIRE_CUDASIM", raising=False)
    with pytest.raises(pytest.skip.Exception, match="install the 'cudasim' extra"):
        conftest.needs_numba_cuda()
    monkeypatch.setenv("VFESIM_REQUIRE_CUDASIM", "1")
    with pytest.raises(pytest.fail.Exception, match="'cudasim' extra.*VFESIM_REQUIRE_CUDASIM=1"):
        conftest.needs_numba_cuda()
