"""The registry's parity matrix (tests/parity.py) for the cuda backend under the CUDA simulator."""

import pytest
from parity import CASES, case_id, check_parity

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_matches_numpy(case):
    check_parity("cuda", *case)
