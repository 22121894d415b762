"""The cooperative batched eigensolver's schedule (vfesim_kernels.cuda.eigh), on the CPU: its round-robin
ordering and the order its eigenvalues are ranked in. The kernel itself runs in tests/cudasim (the
simulator) and tests/test_cuda_gpu.py."""

import itertools

import numpy as np
import pytest
from vfesim_kernels.cuda.eigh import COOP_LANES, _nan_last_less, round_robin_pair


@pytest.mark.parametrize("m", [2, 4, 6, 8])
def test_round_robin_steps_pair_every_two_indices_once(m):
    seen = []
    for step in range(m - 1):
        pairs = [round_robin_pair(m, step, k) for k in range(m // 2)]
        assert all(p < q for p, q in pairs)
        assert sorted(i for pq in pairs for i in pq) == list(range(m)), step  # disjoint, all indices
        seen += pairs
    assert sorted(seen) == list(itertools.combinations(range(m), 2))
    assert 2 * (m // 2) <= COOP_LANES


def test_ranks_are_a_permutation_with_nan_last():
    nan = float("nan")
    for w in (
        [3.0, 1.0, 2.0],
        [1.0, 1.0, 0.0, 1.0],
        [nan, 2.0, nan, -1.0],
        [nan] * 3,
        [np.inf, nan, -np.inf],
    ):
        ranks = [sum(_nan_last_less(w[i], w[j], i, j) for i in range(len(w))) for j in range(len(w))]
        assert sorted(ranks) == list(range(len(w))), w
        out = [None] * len(w)
        for j, r in enumerate(ranks):
            out[r] = w[j]
        numbers = [x for x in out if x == x]
        assert numbers == sorted(numbers) and all(x != x for x in out[len(numbers) :]), w
        ties = [j for j in range(len(w)) if w[j] == 1.0]
        assert [ranks[j] for j in ties] == sorted(ranks[j] for j in ties)  # ties keep their order
