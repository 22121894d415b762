"""vfesim.quantum.born: the Born terms of rollouts (rule R7), by the array code and by the kernels (the CPU
kernels here; the CUDA kernels under the simulator in tests/cudasim/test_quantum_sim.py), against naive
per-agent sums."""

import numpy as np
import pytest
from quantum_stages import check_born_ops
from vfesim_kernels import quantum_cpu

from vfesim.config import ConfigError
from vfesim.quantum.born import ARRAY_BORN, observed_outcomes
from vfesim.quantum.kernel_ops import kernel_born

BORN_OPS = {"array": ARRAY_BORN, "cpu kernels": kernel_born(lambda: np, quantum_cpu.launch)}


@pytest.mark.parametrize("name", BORN_OPS)
@pytest.mark.parametrize("dtype, tol", [("complex128", 1e-13), ("complex64", 1e-6)])
def test_born_terms_read_any_layout_and_any_unobserved_code(name, dtype, tol):
    """The gathers and scatters (flat offsets into one dense block, or an index triple for an array with
    gaps) agree with the naive per-agent sums; any negative outcome is unobserved, also below the narrow
    integer type the outcomes travel in."""
    check_born_ops(BORN_OPS[name], dtype, tol)


def test_observations_index_the_observed_agents():
    rng = np.random.default_rng(3)
    n, d = 7, 4
    y = rng.integers(0, d, size=(3, n))
    y[1, [0, 3]] = [-1, -1000]
    y[2] = -7
    obs = observed_outcomes(y, d, np)
    assert obs[2] is None and obs[0][0].size == n and obs[1][0].tolist() == [1, 2, 4, 5, 6]
    assert obs[0][1].tolist() == y[0].tolist() and obs[1][1].tolist() == y[1, [1, 2, 4, 5, 6]].tolist()
    y[0, 2] = d
    with pytest.raises(ConfigError, match="^outcomes: agent 2 has outcome 4 at step 0"):
        observed_outcomes(y, d, np)
