"""Finite-difference checks of the Gaussian adjoints beyond the small cases of test_energy.py: larger K
(5 and 21), N >= 50, frames near the identity (|phi| < 0.1: the series branch of the exp-map
derivative), on every CPU backend; per term and per variable (SPEC §2.3)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FD_RTOL, random_sym

import vfesim
from vfesim.backends import energy_and_gradient_arrays

TERMS = {
    "self": dict(lambda_self=1.3, lambda_belief=0.0),
    "belief_align": dict(lambda_self=0.0, lambda_belief=0.9, kappa_beta=0.7),
    "prior_align": dict(lambda_self=0.0, lambda_belief=0.0, lambda_prior=1.1, kappa_gamma=1.4),
    "observation": dict(lambda_self=0.0, lambda_belief=0.0, lambda_obs=0.8),
}


def _config(irreps, term, aggregator):
    kw = dict(TERMS[term])
    K = sum(2 * l + 1 for l in irreps)
    if term == "observation":
        rng = np.random.default_rng(3)
        kw["W"] = rng.standard_normal((2, K)) / np.sqrt(K)
        kw["R"] = np.array([[0.8, 0.1], [0.1, 0.6]])
    return vfesim.ModelConfig(irreps=irreps, aggregator=aggregator, **kw)


def _state(cfg, n):
    """n agents; every third frame is scaled to |phi| in [1e-4, 0.1) and agent 0 has phi = 0."""
    st = vfesim.random_state(cfg, n, seed=7, mu_scale=0.6, eig_range=(0.7, 1.5), phi_radius=2.5)
    arrays = {k: st[k].values.copy() for k in st.data_vars}
    phi = arrays["phi"]
    small = np.arange(n) % 3 == 1
    t = np.linalg.norm(phi[small], axis=1, keepdims=True)
    phi[small] *= np.geomspace(1e-4, 0.09, small.sum())[:, None] / t
    phi[0] = 0.0
    return arrays


def _fd(cfg, arrays, var, d, backend, eps=1e-5):
    f = lambda s: energy_and_gradient_arrays({**arrays, var: arrays[var] + s * d}, cfg, backend)[0]["total"]
    return (f(eps) - f(-eps)) / (2 * eps)


# The aggregator enters only the alignment terms.
CASES = [(t, a) for t in TERMS for a in ("expected", "softmin") if t.endswith("align") or a == "expected"]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("term, aggregator", CASES)
@pytest.mark.parametrize("irreps, n", [((2,), 64), ((10,), 50)], ids=["K5-N64", "K21-N50"])
def test_gradient_matches_finite_differences_wide(irreps, n, term, aggregator, backend):
    cfg = _config(irreps, term, aggregator)
    arrays = _state(cfg, n)
    _, grads = energy_and_gradient_arrays(arrays, cfg, backend)
    rng = np.random.default_rng(11)
    for var in arrays:
        shape = arrays[var].shape
        d = random_sym(rng, shape) if var.startswith("sigma") else rng.standard_normal(shape)
        if var == "phi":
            d[np.arange(n) % 3 == 1] *= 1e-3  # stay in the series branch for the small frames
        fd = _fd(cfg, arrays, var, d, backend)
        an = float((grads[var] * d).sum())
        err = abs(fd - an) / max(abs(fd), abs(an), 1e-300)
        if abs(fd) < 1e-9 and abs(an) < 1e-9:
            continue  # a variable the term does not touch: both zero
        assert err <= FD_RTOL, (term, var, err, fd, an)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_phi_gradient_in_the_series_branch(backend):
    """Only small frames (|phi| < 0.1) and the alignment term: the exp-map derivative's series branch
    alone decides the phi gradient."""
    cfg = vfesim.ModelConfig(irreps=(2,), lambda_self=0.0, lambda_belief=1.0, kappa_beta=0.5)
    arrays = _state(cfg, 12)
    rng = np.random.default_rng(2)
    arrays["phi"] = rng.standard_normal((12, 3))
    arrays["phi"] *= np.geomspace(1e-6, 0.08, 12)[:, None] / np.linalg.norm(arrays["phi"], axis=1)[:, None]
    _, grads = energy_and_gradient_arrays(arrays, cfg, backend)
    for a in range(12):
        d = np.zeros((12, 3))
        d[a] = rng.standard_normal(3)
        fd = _fd(cfg, arrays, "phi", d, backend, eps=1e-7)
        an = float((grads["phi"] * d).sum())
        assert abs(fd - an) <= FD_RTOL * max(abs(fd), abs(an)) + 1e-12, (a, fd, an)
