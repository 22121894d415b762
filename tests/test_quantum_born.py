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


def test_a_schedules_observations_are_made_once_and_its_outcomes_are_its_own():
    """Rollouts of one schedule (and of schedules made from its outcomes, as a fitting loop makes them)
    check and move the outcomes once; a schedule copies outcomes it is given, so later changes to the
    caller's array reach neither the schedule nor the kept observations."""
    import copy
    import gc

    from vfesim.quantum import born
    from vfesim.quantum.evolve import QuantumDynamics
    from vfesim.quantum.rollout import Schedule

    rng = np.random.default_rng(4)
    y = rng.integers(-1, 3, size=(4, 5))
    s = Schedule(QuantumDynamics(), 0.1, 4, y)
    assert s.outcomes is not y and not s.outcomes.flags.writeable
    y[0, 0] = 2 if s.outcomes[0, 0] != 2 else 1
    assert s.outcomes[0, 0] != y[0, 0]
    again = Schedule(QuantumDynamics(), 0.2, 4, s.outcomes)
    assert again.outcomes is s.outcomes
    kept = observed_outcomes(s.outcomes, 3, np, keep=True)
    assert observed_outcomes(again.outcomes, 3, np, keep=True) is kept
    assert observed_outcomes(s.outcomes, 4, np, keep=True) is not kept  # one per d
    assert observed_outcomes(s.outcomes, 3, np) is not kept  # keep=False: made anew
    other = Schedule(QuantumDynamics(), 0.1, 4, y)
    assert other.outcomes is not s.outcomes
    assert observed_outcomes(other.outcomes, 3, np, keep=True) is not kept
    # a copy that is no schedule's own (a deep copy: writable) is never kept
    clone = copy.deepcopy(s)
    first = observed_outcomes(clone.outcomes, 3, np, keep=True)
    clone.outcomes[0, 0] = (clone.outcomes[0, 0] + 1) % 3
    again_clone = observed_outcomes(clone.outcomes, 3, np, keep=True)
    assert again_clone is not first and again_clone.Y[0, 0] == clone.outcomes[0, 0]
    # an entry goes with its outcomes, also outcomes already in the narrowest type (int8 here)
    narrow = Schedule(QuantumDynamics(), 0.1, 4, y.astype(np.int8))
    observed_outcomes(narrow.outcomes, 3, np, keep=True)
    n_kept = len(born._OBSERVED)
    del s, again, kept, narrow
    gc.collect()
    assert len(born._OBSERVED) == n_kept - 3
