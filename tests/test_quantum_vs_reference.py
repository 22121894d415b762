"""The density-matrix implementation (issue 10, numpy backend, complex128) against the naive per-pair oracle
tests/reference/quantum.py: every term to 1e-10 relative, and every gradient against central finite
differences **of the oracle** (spec §4.3: h = 1e-6 max(1, |x|), <= 1e-7 relative), for d in {2, 3, 4, 5},
both aggregators, dense and sparse (ragged, one empty row) neighbours, each term alone and all together.

Gradient conventions tested (issue 10): grads["rho"] is the traceless Hermitian G with dF = tr(G drho) for
traceless Hermitian drho; grads["hamiltonian"] the Hermitian Hbar with dF = tr(Hbar dH) for Hermitian dH;
grads["temperature"], grads["phi"] plain partial derivatives.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference.quantum import (
    energy_terms,
    fd_gradient,
    oracle_config,
    random_hermitian,
    random_traceless_hermitian,
    reference_energy,
    state_arrays,
    unit_vector,
)

import vfesim

DS = (2, 3, 4, 5)
TERM_RTOL = 1e-10
FD_RTOL = 1e-7  # spec §4.3
FD_H = 1e-6

TERMS = {
    "self": dict(lambda_self=1.3, lambda_belief=0.0, lambda_prior=0.0, lambda_obs=0.0),
    "belief_align": dict(
        lambda_self=0.0, lambda_belief=0.9, lambda_prior=0.0, lambda_obs=0.0, kappa_beta=0.7
    ),
    "prior_align": dict(
        lambda_self=0.0, lambda_belief=0.0, lambda_prior=1.1, lambda_obs=0.0, kappa_gamma=1.4
    ),
    "observation": dict(lambda_self=0.0, lambda_belief=0.0, lambda_prior=0.0, lambda_obs=0.8),
    "all": dict(
        lambda_self=0.7,
        lambda_belief=1.2,
        lambda_prior=0.5,
        lambda_obs=0.6,
        kappa_beta=0.8,
        kappa_gamma=1.6,
    ),
}

# Sparse lists on 5 agents: ragged, agent 2 has no neighbour (masked slots hold arbitrary in-range indices).
SPARSE_INDEX = np.array([[1, 2, 0], [0, 4, 0], [0, 0, 0], [2, 1, 4], [3, 0, 0]])
SPARSE_MASK = np.array([[1, 1, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=bool)


def _setup(d, term, aggregator, neighbours, seed=0):
    """(qcfg, qs) with N = 4 (dense) or 5 (sparse) agents; beliefs mixed with I/d so that
    lambda_min(rho) >= 0.2/d and rho +- h E stays positive definite (spec §4.3)."""
    if neighbours == "dense":
        n, nb = 4, "dense"
    else:
        n, nb = 5, vfesim.SparseNeighbours(SPARSE_INDEX, SPARSE_MASK)
    qcfg = vfesim.QuantumConfig(d=d, aggregator=aggregator, neighbours=nb, **TERMS[term])
    qs = vfesim.random_state(qcfg, n_agents=n, seed=seed, dtype="complex128")
    rho = np.asarray(qs["rho"].values)
    qs = qs.copy(deep=True)
    qs["rho"] = qs["rho"].copy(data=0.8 * rho + 0.2 * np.eye(d, dtype=rho.dtype) / d)
    return qcfg, qs


def _grad(grads, name):
    return np.asarray(grads[name])


def _oracle_fn(a, cfg, which):
    """The oracle's total as a function of one variable, the others held at the state's values."""

    def fn(x):
        kw = dict(rho=a["rho"], H=a["hamiltonian"], T=a["temperature"], phi=a["phi"])
        kw[which] = x
        return energy_terms(kw["rho"], kw["H"], kw["T"], kw["phi"], a["outcome"], cfg, log="eigh")["total"]

    return fn


def _check(fd, an, total, what):
    """|fd - an| <= FD_RTOL |fd| + FD_RTOL * 1e-2 * max(1, |F|): relative, with an absolute floor for
    directions along which F does not change (exactly 0 by FD; the gradient must be ~0 too)."""
    fd, an = np.asarray(fd, float), np.asarray(an, float)
    err = np.abs(fd - an)
    bound = FD_RTOL * np.abs(fd) + 1e-2 * FD_RTOL * max(1.0, abs(total))
    assert np.all(err <= bound), f"{what}: fd {fd}, gradient {an}, error {err}"


# -------------------------------------------------------------------------------------------------- terms


@pytest.mark.parametrize("neighbours", ["dense", "sparse"])
@pytest.mark.parametrize("aggregator", ["softmin", "expected"])
@pytest.mark.parametrize("d", DS)
def test_terms_match_oracle_all_terms(d, aggregator, neighbours):
    """All four terms on; the oracle with scipy.linalg.logm and both transports."""
    qcfg, qs = _setup(d, "all", aggregator, neighbours, seed=d)
    got, _ = vfesim.energy_and_gradient(qs, qcfg, backend="numpy")
    ref = reference_energy(qs, qcfg, log="logm")
    assert set(ref) <= set(got), set(ref) - set(got)
    for k in ref:
        assert float(got[k]) == pytest.approx(ref[k], rel=TERM_RTOL, abs=1e-12), k
    if d == 3:
        ref_direct = reference_energy(qs, qcfg, log="logm", transport="direct")
        for k in ref:
            assert float(got[k]) == pytest.approx(ref_direct[k], rel=TERM_RTOL, abs=1e-12), k


# ------------------------------------------------------------------------------------------- gradients

# Every term alone and all together, x both aggregators x dense/sparse; d rotates across the cases so
# that each term meets several d and both parities (the full cross product is left to the terms test).
CASES = []
for _t, term in enumerate(TERMS):
    for _a, aggregator in enumerate(("softmin", "expected")):
        for _n, neighbours in enumerate(("dense", "sparse")):
            CASES.append((DS[(_t + 2 * _a + _n) % 4], term, aggregator, neighbours))


@pytest.mark.parametrize(("d", "term", "aggregator", "neighbours"), CASES)
def test_gradients_match_oracle_fd(d, term, aggregator, neighbours):
    qcfg, qs = _setup(d, term, aggregator, neighbours, seed=10 + d)
    got, grads = vfesim.energy_and_gradient(qs, qcfg, backend="numpy")
    a = state_arrays(qs)
    cfg = oracle_config(qcfg)
    ref = energy_terms(a["rho"], a["hamiltonian"], a["temperature"], a["phi"], a["outcome"], cfg, log="eigh")
    for k in ref:
        assert float(got[k]) == pytest.approx(ref[k], rel=TERM_RTOL, abs=1e-12), k
    total = ref["total"]
    n = a["rho"].shape[0]
    rng = np.random.default_rng(100 + d)

    # rho: traceless Hermitian G, dF = tr(G E) along traceless Hermitian E
    G = _grad(grads, "rho")
    assert G.shape == (n, d, d)
    scale = max(1.0, float(np.abs(G).max()))
    np.testing.assert_allclose(G, np.conj(np.swapaxes(G, -1, -2)), rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(np.trace(G, axis1=1, axis2=2), 0, rtol=0, atol=1e-12 * scale)
    dirs = [random_traceless_hermitian(rng, n, d) for _ in range(3)]
    fd = fd_gradient(_oracle_fn(a, cfg, "rho"), a["rho"], dirs, FD_H)
    an = [np.einsum("iab,iba->", G, E).real for E in dirs]
    _check(fd, an, total, "rho")

    # hamiltonian: Hermitian Hbar, dF = tr(Hbar E) along Hermitian E
    Hb = _grad(grads, "hamiltonian")
    assert Hb.shape == (n, d, d)
    scale = max(1.0, float(np.abs(Hb).max()))
    np.testing.assert_allclose(Hb, np.conj(np.swapaxes(Hb, -1, -2)), rtol=0, atol=1e-12 * scale)
    dirs = [random_hermitian(rng, n, d) for _ in range(3)]
    h = FD_H * max(1.0, float(np.linalg.norm(a["hamiltonian"])))
    fd = fd_gradient(_oracle_fn(a, cfg, "H"), a["hamiltonian"], dirs, h)
    an = [np.einsum("iab,iba->", Hb, E).real for E in dirs]
    _check(fd, an, total, "hamiltonian")

    # temperature and phi: partial derivatives, one coordinate at a time on a few agents
    gT = _grad(grads, "temperature")
    assert gT.shape == (n,)
    gphi = _grad(grads, "phi")
    assert gphi.shape == (n, 3)
    for i in (0, n - 1):
        e = unit_vector((n,), i)
        fd = fd_gradient(_oracle_fn(a, cfg, "T"), a["temperature"], [e], FD_H * max(1.0, a["temperature"][i]))
        _check(fd, [gT[i]], total, f"temperature[{i}]")
    for i in (0, 2):
        for c in range(3):
            e = unit_vector((n, 3), (i, c))
            h = FD_H * max(1.0, abs(a["phi"][i, c]))
            fd = fd_gradient(_oracle_fn(a, cfg, "phi"), a["phi"], [e], h)
            _check(fd, [gphi[i, c]], total, f"phi[{i}, {c}]")
