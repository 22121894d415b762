"""Density-matrix agents on the cuda backend under the Numba CUDA simulator: the family's array stages
with the CUDA pair path (GEMMs and the row kernel) against the numpy backend."""

import numpy as np
import pytest

import vfesim

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
def test_cuda_matches_numpy(aggregator):
    cfg = vfesim.QuantumConfig(d=3, aggregator=aggregator, lambda_prior=0.5, lambda_obs=0.2)
    qs = vfesim.random_state(cfg, n_agents=9, seed=1)
    t_ref, g_ref = vfesim.energy_and_gradient(qs, cfg, backend="numpy")
    t, g = vfesim.energy_and_gradient(qs, cfg, backend="cuda")
    for k in t_ref:
        np.testing.assert_allclose(t[k], t_ref[k], rtol=1e-10, atol=1e-10 * abs(t_ref["total"]), err_msg=k)
    for k in g_ref.data_vars:
        b = g_ref[k].values
        np.testing.assert_allclose(g[k].values, b, rtol=1e-10, atol=1e-10 * float(np.abs(b).max()), err_msg=k)
