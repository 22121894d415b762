"""CUDA-simulator tests: collected only when NUMBA_ENABLE_CUDASIM=1 (it must be set before numba loads).

A plain ``pytest`` run executes them through ``tests/test_cudasim_suite.py`` in a subprocess. The folder
is a package (``__init__.py``), so this file is imported as ``cudasim.conftest`` and does not shadow
``tests/conftest.py``, which the tests import as ``conftest``.
"""

import os

collect_ignore_glob = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["test_*.py"]
