"""The per-agent Numba kernels (kernels/agent_cpu.py) against the NumPy stages they replace.

Each stage (frames, features, features_vjp, phi_grad, self KL) matches the NumPy code to 1e-12 relative
in float64 and 1e-5 in float32, on single and multi-irrep generators, |phi| at 0, near 0 and near pi,
and N = 1; the kernels are bitwise independent of the thread count and of the serial/parallel build.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from vfesim_kernels import agent_cpu

import vfesim
from vfesim.gaussian import features as np_features
from vfesim.gaussian import terms as np_terms
from vfesim.groups import expm_so3, generators, phi_grad_from_R

RTOL = {"float64": 1e-12, "float32": 1e-5}
IRREPS = [(1,), (10,), (0, 1, 2), (3, 4)]


def _close(a, b, dtype, rtol=None):
    """Relative to the array's scale (entries cross zero)."""
    r = RTOL[np.dtype(dtype).name] if rtol is None else rtol
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=r, atol=r * float(np.max(np.abs(b), initial=0.0)))


def _phis(rng, n, dtype):
    """Frames with |phi| = 0, 1e-9, 1e-3, 0.0999/0.1001 (series switch), pi - 1e-7, and random in the ball."""
    phi = rng.standard_normal((n, 3))
    phi /= np.linalg.norm(phi, axis=1, keepdims=True)
    radii = rng.uniform(0, np.pi, n)
    radii[:6] = [0.0, 1e-9, 1e-3, 0.0999, 0.1001, np.pi - 1e-7]
    return (phi * radii[:, None]).astype(dtype)


def _state(irreps, n, dtype, seed=0):
    cfg = vfesim.ModelConfig(irreps=irreps)
    st = vfesim.random_state(cfg, n, seed=seed, dtype=dtype, mu_scale=2.0, phi_radius=3.0)
    return st.mu_q.values, st.sigma_q.values, st.mu_p.values, st.sigma_p.values


@pytest.mark.parametrize("irreps", IRREPS)
def test_frames_match_expm_so3(irreps, dtype, rng):
    G = generators(irreps)
    phi = _phis(rng, 40, dtype)
    ref = expm_so3(phi, G, max(irreps))
    out = agent_cpu.frames(phi, G, max(irreps))
    # Same algorithm, same squarings: float64 to ~1e-15 (R is O(1)).
    _close(out, ref, dtype, rtol=1e-14 if dtype == "float64" else 1e-5)
    if dtype == "float64":
        np.testing.assert_array_equal(out[0], np.eye(G.shape[1]))  # phi = 0: exactly the identity


@pytest.mark.parametrize("irreps", IRREPS)
def test_features_and_vjp_match_numpy(irreps, dtype, rng):
    n = 37
    mu, sigma, _, _ = _state(irreps, n, dtype)
    R = expm_so3(_phis(rng, n, dtype), generators(irreps), max(irreps))
    A0, B0, c0, cache0 = np_features.agent_features(mu, sigma, R)
    A1, B1, c1, cache1, ok = agent_cpu.features(mu, sigma, R)
    assert ok.all()
    for a, b in zip((A1, B1, c1, *cache1[3:]), (A0, B0, c0, *cache0[3:]), strict=True):
        _close(a, b, dtype)
    gA, gB = (rng.standard_normal(A0.shape).astype(dtype) for _ in range(2))
    gc = rng.standard_normal(n).astype(dtype)
    ref = np_features.features_vjp(gA, gB, gc, cache0)
    out = agent_cpu.features_vjp(gA, gB, gc, cache1)
    for a, b in zip(out, ref, strict=True):
        _close(a, b, dtype)
    np.testing.assert_array_equal(out[1], np.swapaxes(out[1], 1, 2))  # g_sigma exactly symmetric


@pytest.mark.parametrize("irreps", IRREPS)
def test_phi_grad_matches_numpy(irreps, dtype, rng):
    G = generators(irreps)
    K = G.shape[1]
    phi = _phis(rng, 40, dtype)
    R = expm_so3(phi, G, max(irreps))
    g_R = rng.standard_normal((40, K, K)).astype(dtype)
    _close(agent_cpu.phi_grad(g_R, R, phi, G), phi_grad_from_R(g_R, R, phi, G), dtype)


@pytest.mark.parametrize("irreps", IRREPS)
def test_self_kl_matches_numpy(irreps, dtype, rng):
    mu_q, sigma_q, mu_p, sigma_p = _state(irreps, 29, dtype, seed=4)
    g = rng.uniform(0.5, 2.0, 29).astype(dtype)
    kl0, cache = np_terms.self_kl(mu_q, sigma_q, mu_p, sigma_p)
    ref = np_terms.self_kl_vjp(g, cache)
    kl, *out, ok = agent_cpu.self_kl(mu_q, sigma_q, mu_p, sigma_p, g)
    assert ok.all()
    _close(kl, kl0, dtype)
    for a, b in zip(out, ref, strict=True):
        _close(a, b, dtype)


def test_one_agent(dtype, rng):
    """N = 1: the centred mean is 0, the features and their adjoint still match."""
    mu, sigma, _, _ = _state((2,), 1, dtype)
    R = expm_so3(np.array([[0.3, -1.1, 2.0]], dtype), generators((2,)), 2)
    A0, B0, c0, cache0 = np_features.agent_features(mu, sigma, R)
    A1, B1, c1, cache1, ok = agent_cpu.features(mu, sigma, R)
    assert ok.all() and not np.any(cache1[3])
    for a, b in zip((A1, B1, c1), (A0, B0, c0), strict=True):
        _close(a, b, dtype)
    gA, gB, gc = np.ones_like(A0), np.ones_like(B0), np.ones_like(c0)
    for a, b in zip(
        agent_cpu.features_vjp(gA, gB, gc, cache1), np_features.features_vjp(gA, gB, gc, cache0), strict=True
    ):
        _close(a, b, dtype)


def test_not_positive_definite_is_flagged():
    mu, sigma, mu_p, sigma_p = _state((1,), 5, "float64")
    sigma = sigma.copy()
    sigma[3] = -sigma[3]
    R = np.broadcast_to(np.eye(3), (5, 3, 3)).copy()
    *_, ok = agent_cpu.features(mu, sigma, R)
    np.testing.assert_array_equal(ok, [True, True, True, False, True])
    *_, ok = agent_cpu.self_kl(mu, sigma_p, mu_p, sigma, np.ones(5))
    np.testing.assert_array_equal(ok, [True, True, True, False, True])


def test_backend_names_the_agent_when_not_positive_definite():
    """Past validation (validate=False) the numba backend still reports the agent and the variable."""
    cfg = vfesim.ModelConfig(K=3, lambda_self=0.0)
    st = vfesim.random_state(cfg, 6, seed=0)
    sq = st.sigma_q.values.copy()
    sq[4] = -sq[4]
    bad = st.assign(sigma_q=(st.sigma_q.dims, sq))
    with pytest.raises(vfesim.StateError, match=r"sigma_q\[agent=4\].*positive definite"):
        vfesim.energy_and_gradient(bad, cfg, backend="numba", validate=False)
    cfg = vfesim.ModelConfig(K=3, lambda_belief=0.0)
    with pytest.raises(vfesim.StateError, match=r"sigma_q\[agent=4\].*positive definite"):
        vfesim.energy_and_gradient(bad, cfg, backend="numba", validate=False)


def _all_stages(irreps, n, dtype, rng):
    G = generators(irreps)
    mu, sigma, mu_p, sigma_p = _state(irreps, n, dtype, seed=7)
    phi = _phis(rng, n, dtype)
    R = agent_cpu.frames(phi, G, max(irreps))
    A, B, c, cache, _ = agent_cpu.features(mu, sigma, R)
    gm, gs, gR = agent_cpu.features_vjp(B, A, c, cache)
    gphi = agent_cpu.phi_grad(gR, R, phi, G)
    skl = agent_cpu.self_kl(mu, sigma, mu_p, sigma_p, c)
    return (R, A, B, c, gm, gs, gR, gphi, *skl)


@pytest.mark.parametrize("irreps", [(1,), (10,)])
def test_bitwise_independent_of_threads_and_build(irreps, monkeypatch):
    n = 160  # parallel builds for both K (N K^3 >= SERIAL_WORK at K = 21; forced below for K = 3)
    monkeypatch.setattr(agent_cpu, "SERIAL_WORK", 0)
    ref = _all_stages(irreps, n, "float64", np.random.default_rng(1))
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        one = _all_stages(irreps, n, "float64", np.random.default_rng(1))
    finally:
        numba.set_num_threads(threads)
    monkeypatch.setattr(agent_cpu, "SERIAL_WORK", 1 << 60)
    serial = _all_stages(irreps, n, "float64", np.random.default_rng(1))
    for a, b, s in zip(ref, one, serial, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, s)


def test_bad_dtype_is_an_error():
    with pytest.raises(TypeError, match="float32 or float64"):
        agent_cpu.frames(np.zeros((2, 3), np.int64), generators((1,)), 1)
