"""CUDA-simulator tests: collected only when NUMBA_ENABLE_CUDASIM=1 (it must be set before numba loads).

A plain ``pytest`` run executes them through ``tests/test_cudasim_suite.py`` in a subprocess. This file
shadows ``tests/conftest.py`` as the module ``conftest`` here, so it re-exports the shared tolerance
table and builders from there.
"""

import importlib.util
import os
from pathlib import Path

collect_ignore_glob = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["test_*.py"]

_spec = importlib.util.spec_from_file_location(
    "_vfesim_tests_conftest", Path(__file__).parents[1] / "conftest.py"
)
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
TOL = _shared.TOL
FD_RTOL = _shared.FD_RTOL
make_obs_config = _shared.make_obs_config
