"""Every registered backend that runs in this process matches the numpy backend (SPEC §4); the matrix is
tests/parity.py. "cuda" runs it under the CUDA simulator (tests/cudasim) and on a GPU."""

from __future__ import annotations

import pytest
from parity import CASES, case_id, check_parity

from vfesim.backends import cuda_available, names

BACKENDS = [b for b in names() if b != "numpy" and (b != "cuda" or cuda_available())]


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_numpy(backend, case):
    check_parity(backend, *case)
