"""Runs tests/cudasim under the Numba CUDA simulator in a subprocess, so one plain ``pytest`` covers the
CUDA code path on a machine without a GPU (NUMBA_ENABLE_CUDASIM must be set before numba is imported)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") == "1",
    reason="simulator active: tests/cudasim is collected directly",
)
def test_cuda_simulator_suite():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONUNBUFFERED="1")
    # One process: the outer run already has a worker per core (pytest-xdist).
    cmd = [sys.executable, "-m", "pytest", "tests/cudasim", "-q", "-p", "no:cacheprovider", "-n", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"simulator suite failed (exit {proc.returncode}):\n{out[-20000:]}"
    assert " passed" in out and "no tests ran" not in out, out[-5000:]
