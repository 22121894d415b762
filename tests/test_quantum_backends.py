"""Density-matrix agents on every backend: the numba backend (the family's array stages with the streaming
Numba pair kernels over the d^2 Hermitian feature rows) against numpy, in complex128 (1e-10) and complex64
(1e-4); the cuda backend runs the same code path under the CUDA simulator (tests/cudasim)."""

import numpy as np
import pytest

import vfesim

N = 24


def _config(d, aggregator, sparse, **kw):
    neighbours = "dense"
    if sparse:
        rng = np.random.default_rng(d)
        index = np.stack([rng.choice(np.delete(np.arange(N), i), 4, replace=False) for i in range(N)])
        mask = rng.random(index.shape) < 0.8
        mask[3] = False  # an agent without neighbours
        neighbours = vfesim.SparseNeighbours(index, mask)
    return vfesim.QuantumConfig(d=d, aggregator=aggregator, neighbours=neighbours, **kw)


def _parity(cfg, dtype, backend, rtol):
    qs = vfesim.random_state(cfg, n_agents=N, seed=3, dtype=dtype)
    t_ref, g_ref = vfesim.energy_and_gradient(qs, cfg, backend="numpy")
    t, g = vfesim.energy_and_gradient(qs, cfg, backend=backend)
    assert set(t) == set(t_ref)
    for k in t_ref:
        np.testing.assert_allclose(t[k], t_ref[k], rtol=rtol, atol=rtol * abs(t_ref["total"]), err_msg=k)
    assert set(g.data_vars) == set(g_ref.data_vars)
    for k in g_ref.data_vars:
        a, b = g[k].values, g_ref[k].values
        assert a.dtype == b.dtype and a.shape == b.shape, k
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()), err_msg=k)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("d", [2, 4])
def test_numba_matches_numpy(d, aggregator, sparse):
    cfg = _config(d, aggregator, sparse, lambda_prior=0.7, lambda_obs=0.3)
    _parity(cfg, "complex128", "numba", 1e-10)


def test_numba_matches_numpy_complex64():
    _parity(_config(3, "softmin", False, lambda_prior=1.0), "complex64", "numba", 1e-4)


def test_complex64_phi_gradient_keeps_its_precision_in_a_large_population():
    """In a large population the pair cotangents are sums over many unit-trace states: a large identity
    part and a small traceless one, which alone reaches the phi gradient (rule R2 maps the identity part
    to 0). With the identity spread over every diagonal coordinate, and carried through the frames'
    cotangent U_bar, the complex64 phi gradient lost precision as N grew (numba, against complex128 at the
    same state: 2.1e-5 at N = 4096, 4.5e-5 at 16 384, 1.2e-4 at 65 536, over the 1e-4 of complex64). With
    the trace as the features' own coordinate, kept out of U_bar: 3.9e-6 at 16 384."""
    cfg = vfesim.QuantumConfig(d=4)
    s64 = vfesim.random_state(cfg, n_agents=16384, seed=0, dtype="complex64")
    wide = {np.dtype(np.complex64): np.complex128, np.dtype(np.float32): np.float64}
    s128 = s64.copy()
    for k, v in s64.data_vars.items():
        s128[k] = v.astype(wide.get(v.dtype, v.dtype))
    assert {v.dtype for v in s128.data_vars.values()} == {np.dtype(np.complex128), np.dtype(np.float64)}
    # the complex64 state's trace is 1 to its own precision: the complex128 call skips validation
    _, g = vfesim.energy_and_gradient(s128, cfg, backend="numba", validate=False)
    _, g64 = vfesim.energy_and_gradient(s64, cfg, backend="numba")
    for k, tol in (("phi", 1e-5), ("rho", 1.5e-5)):
        a, b = g64[k].values, g[k].values
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), k
