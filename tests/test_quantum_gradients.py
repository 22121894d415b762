"""Central finite differences of the density-matrix free energy (spec/quantum.md §4.3).

Every term x every variable (rho along traceless Hermitian directions, hamiltonian along Hermitian
directions, temperature and phi along random directions over all agents) x both aggregators x dense /
sparse neighbours, d in {2, 3, 4, 5}; the same for the per-agent kernels' fused passes (the numba
backend's QuantumOps, whose CUDA build runs the same source). Step h = 1e-6 (spec §4.3); error relative to
max(|analytic|, ||gradient of the variable||_F) (the directional derivative along a unit direction is at
most that norm).
"""

import itertools

import numpy as np
import pytest

import vfesim
from vfesim.quantum.energy import NUMPY_OPS, energy_and_gradient_arrays

N = 5
H_STEP = 1e-6
TOL = 1e-7
TERM_LAMBDAS = {
    "self": dict(lambda_self=1.0, lambda_belief=0.0),
    "belief_align": dict(lambda_self=0.0, lambda_belief=1.0),
    "prior_align": dict(lambda_self=0.0, lambda_belief=0.0, lambda_prior=1.0),
    "observation": dict(lambda_self=0.0, lambda_belief=0.0, lambda_obs=1.0),
    "total": dict(lambda_self=0.7, lambda_belief=1.3, lambda_prior=0.6, lambda_obs=0.4),
}
PAIR_TERMS = ("belief_align", "prior_align", "total")


def _direction(rng, var, arrays):
    shape = arrays[var].shape
    if var in ("rho", "hamiltonian"):
        Z = rng.normal(size=shape) + 1j * rng.normal(size=shape)
        E = 0.5 * (Z + Z.conj().swapaxes(1, 2))
        if var == "rho":
            d = shape[-1]
            E -= (np.trace(E, axis1=1, axis2=2) / d)[:, None, None] * np.eye(d)
    else:
        E = rng.normal(size=shape)
    return E / np.linalg.norm(E)


def _inner(G, E):
    if np.iscomplexobj(G):
        return float(np.einsum("nkl,nlk->", G, E).real)  # sum_i tr(G_i E_i)
    return float((G * E).sum())


def _check(term, d, aggregator, sparse, seed, ops=NUMPY_OPS):
    neighbours = vfesim.SparseNeighbours.ring(N, 1) if sparse else "dense"
    cfg = vfesim.QuantumConfig(
        d=d,
        aggregator=aggregator,
        neighbours=neighbours,
        kappa_beta=0.7,
        kappa_gamma=1.3,
        **TERM_LAMBDAS[term],
    )
    arrays = {k: v.data for k, v in vfesim.random_state(cfg, N, seed=seed, outcome=True).items()}
    terms, grads = energy_and_gradient_arrays(arrays, cfg, ops=ops)
    expected = terms["total"] if term == "total" else terms[term]
    assert terms["total"] == pytest.approx(expected, rel=1e-15)
    rng = np.random.default_rng(seed)
    G = grads["rho"]
    np.testing.assert_allclose(G, G.conj().swapaxes(1, 2), atol=1e-14)
    np.testing.assert_allclose(np.trace(G, axis1=1, axis2=2), 0, atol=1e-13)
    worst = {}
    for var in ("rho", "hamiltonian", "temperature", "phi"):
        for _ in range(2):
            E = _direction(rng, var, arrays)
            plus = {**arrays, var: arrays[var] + H_STEP * E}
            minus = {**arrays, var: arrays[var] - H_STEP * E}
            fd = (
                energy_and_gradient_arrays(plus, cfg, ops=ops)[0]["total"]
                - energy_and_gradient_arrays(minus, cfg, ops=ops)[0]["total"]
            ) / (2 * H_STEP)
            an = _inner(grads[var], E)
            scale = max(abs(an), np.linalg.norm(grads[var]))
            err = abs(fd - an) / scale if scale > 0 else abs(fd)
            worst[var] = max(worst.get(var, 0.0), err)
    assert max(worst.values()) <= TOL, worst


@pytest.mark.parametrize("d", [2, 3, 4, 5])
@pytest.mark.parametrize("term", ["self", "observation"])
def test_per_agent_terms(term, d):
    _check(term, d, "softmin", False, seed=d)


@pytest.mark.parametrize(
    "term, d, aggregator, sparse",
    [
        (t, d, agg, sp)
        for t, (agg, sp), d in itertools.product(
            PAIR_TERMS, itertools.product(("softmin", "expected"), (False, True)), (2, 3, 4, 5)
        )
    ],
)
def test_pair_terms(term, d, aggregator, sparse):
    _check(term, d, aggregator, sparse, seed=10 * d + sparse)


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("term", list(TERM_LAMBDAS))
def test_kernel_passes_per_term(term, d):
    """The fused per-agent kernels' adjoint (energy_prep / energy_features / energy_backward) against
    central differences of their own energy, every term and variable."""
    from vfesim.backends.numba_backend import QUANTUM_OPS

    _check(term, d, "softmin", False, seed=20 + d, ops=QUANTUM_OPS)


def test_complex64_matches_complex128():
    cfg = vfesim.QuantumConfig(d=4, lambda_prior=0.5, lambda_obs=0.3)
    qs = vfesim.random_state(cfg, 6, seed=1)
    t64, g64 = vfesim.energy_and_gradient(qs, cfg)
    cast = {"rho": "complex64", "hamiltonian": "complex64", "temperature": "float32", "phi": "float32"}
    qs32 = qs.copy(data={k: qs[k].data.astype(cast.get(k, qs[k].dtype)) for k in qs.data_vars})
    t32, g32 = vfesim.energy_and_gradient(qs32, cfg)
    for k in t64:
        assert t32[k] == pytest.approx(t64[k], rel=1e-4, abs=1e-4)
    for k in ("rho", "hamiltonian", "temperature", "phi"):
        assert g32[k].dtype == {"rho": np.complex64, "hamiltonian": np.complex64}.get(k, np.float32)
        np.testing.assert_allclose(g32[k].data, g64[k].data, atol=2e-4 * np.abs(g64[k].data).max())
