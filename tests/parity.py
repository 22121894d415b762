"""One backend-parity matrix for every backend in the registry (imported by test_backend_parity.py and by
cudasim/test_backend_parity_sim.py, which runs it for "cuda" under the CUDA simulator).

Each case compares a backend's terms and gradients with the numpy backend's on the same inputs, to the
dtype tolerances of SPEC §4 (TOL): every term switched on (observation and jitter included), both
aggregators, dense, ring and ragged neighbours, one or several irreps."""

from __future__ import annotations

import numpy as np
from conftest import TOL, make_obs_config

import vfesim
from vfesim.backends import get

N = 9
NEIGHBOURS = {
    "dense": lambda: "dense",
    "ring": lambda: vfesim.SparseNeighbours.ring(N, 2),
    "ragged": lambda: vfesim.SparseNeighbours.from_lists(
        [[1, 2], [], [0, 4], [0, 1, 4], [3], [0, 2, 3], [5], [8], [6]]
    ),
}
IRREPS = [(1,), (0, 1, 1)]
CASES = [
    (irreps, aggregator, neighbours, dtype)
    for irreps in IRREPS
    for aggregator in ("expected", "softmin")
    for neighbours in NEIGHBOURS
    for dtype in ("float64", "float32")
]


def case_id(case) -> str:
    irreps, aggregator, neighbours, dtype = case
    return f"l{''.join(map(str, irreps))}-{aggregator}-{neighbours}-{dtype}"


def check_parity(backend: str, irreps, aggregator: str, neighbours: str, dtype: str) -> None:
    K = sum(2 * l + 1 for l in irreps)
    cfg = make_obs_config(
        K=K, irreps=irreps, aggregator=aggregator, neighbours=NEIGHBOURS[neighbours](),
        lambda_prior=0.6, kappa_beta=0.7, kappa_gamma=1.3, lambda_obs=0.4, jitter=0.01,
    )  # fmt: skip
    state = vfesim.random_state(cfg, N, seed=3, dtype=dtype, phi_radius=2.5)
    arrays = {k: state[k].values.copy() for k in state.data_vars}
    be = get(backend)
    t_b, g_b = be.energy_and_gradient(be.to_device(arrays), cfg)
    g_b = be.to_host(g_b)
    t_n, g_n = get("numpy").energy_and_gradient(arrays, cfg)
    rtol = TOL[dtype]["rtol"]
    assert set(t_b) == set(t_n) and set(g_b) == set(g_n) == set(arrays)
    for k in t_n:
        np.testing.assert_allclose(t_b[k], t_n[k], rtol=rtol, atol=rtol * abs(t_n["total"]), err_msg=k)
    for k in g_n:
        assert g_b[k].dtype == arrays[k].dtype and g_b[k].shape == arrays[k].shape, k
        scale = float(np.abs(g_n[k]).max())
        np.testing.assert_allclose(g_b[k], g_n[k], rtol=rtol, atol=rtol * scale, err_msg=k)
