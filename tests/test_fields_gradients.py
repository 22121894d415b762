"""Field agents: central finite-difference checks of the hand-written gradient, per term and per
variable (supports included), on 1-D and 2-D, periodic and bounded grids, with the numpy and numba
point-agent stages; and the one-point grid as the point-agent special case."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FD_RTOL, random_sym

import vfesim
from vfesim.backends.numba_backend import AGENT_OPS as NUMBA_OPS
from vfesim.fields import FieldConfig, energy_and_gradient_arrays
from vfesim.fields.supports import neighbour_lists
from vfesim.gaussian.energy import NUMPY_AGENT_OPS

OPS = {"numpy": NUMPY_AGENT_OPS, "numba": NUMBA_OPS}

TERMS = {
    "self": dict(lambda_self=1.3, lambda_belief=0.0),
    "belief_align": dict(lambda_self=0.0, lambda_belief=0.9, kappa_beta=0.7),
    "prior_align": dict(lambda_self=0.0, lambda_belief=0.0, lambda_prior=1.1, kappa_gamma=1.4),
    "observation": dict(lambda_self=0.0, lambda_belief=0.0, lambda_obs=0.8),
    "gauge_smoothness": dict(lambda_self=0.0, lambda_belief=0.0, lambda_phi=0.6),
}
GRIDS = {
    "1d-periodic": dict(grid=(9,), boundary="periodic"),
    "2d-bounded": dict(grid=(5, 4), boundary="bounded", spacing=0.5, cell_volume="grid"),
    "2d-periodic": dict(grid=(4, 5), boundary="periodic", cell_volume=0.3),
}
# Bump area per agent as a fraction of the grid's area: supports overlap and leave points uncovered.
AREA = {1: 0.2, 2: 0.12}


def _config(term, aggregator="expected", grid="2d-bounded", **kw):
    kw = {**TERMS[term], **GRIDS[grid], **kw}
    if term == "observation":
        rng = np.random.default_rng(3)
        kw["W"] = rng.standard_normal((2, 3)) / np.sqrt(3)
        kw["R"] = np.array([[0.8, 0.1], [0.1, 0.6]])
    return FieldConfig(K=3, aggregator=aggregator, overlap_threshold=0.05, **kw)


def _arrays(cfg, n=5, seed=4):
    """Bump supports large enough to overlap, with uncovered points (chi = 0) on the grid."""
    extent = np.asarray(cfg.grid) * cfg.spacing
    area = AREA[cfg.ndim] * float(np.prod(extent))
    st = vfesim.random_state(cfg, n, seed=seed, mu_scale=0.6, eig_range=(0.7, 1.5), phi_radius=2.0, area=area)
    arrays = {k: st[k].values.copy() for k in st.data_vars}
    chi = arrays["support"]
    assert (chi == 0).any() and (chi > 0).reshape(n, -1).any(axis=1).all()
    return arrays


def _energy(cfg, arrays, ops, nbrs):
    return energy_and_gradient_arrays(arrays, cfg, agent_ops=ops, neighbours=nbrs)


def _direction(rng, var, arrays):
    a = arrays[var]
    d = random_sym(rng, a.shape) if var.startswith("sigma") else rng.standard_normal(a.shape)
    if var == "support":
        d = np.where(a > 0, d, 0.0)  # the support gradient is exact where chi > 0
    return d


def _check(cfg, arrays, ops, eps=1e-5):
    nbrs = neighbour_lists(arrays["support"], cfg)  # fixed lists: the overlap rule is piecewise constant
    terms, grads = _energy(cfg, arrays, ops, nbrs)
    assert set(grads) == set(arrays)
    rng = np.random.default_rng(11)
    checked = 0
    for var in arrays:
        d = _direction(rng, var, arrays)
        f = lambda s, var=var, d=d: _energy(cfg, {**arrays, var: arrays[var] + s * d}, ops, nbrs)[0]["total"]
        fd = (f(eps) - f(-eps)) / (2 * eps)
        an = float((grads[var] * d).sum())
        if abs(fd) < 1e-9 and abs(an) < 1e-9:
            continue  # a variable the term does not touch: both zero
        err = abs(fd - an) / max(abs(fd), abs(an))
        assert err <= FD_RTOL, (var, err, fd, an)
        checked += 1
    return terms, checked


CASES = [(t, a) for t in TERMS for a in ("expected", "softmin") if t.endswith("align") or a == "expected"]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("grid", list(GRIDS))
@pytest.mark.parametrize("term, aggregator", CASES)
def test_field_gradient_matches_finite_differences(term, aggregator, grid, backend):
    cfg = _config(term, aggregator, grid)
    arrays = _arrays(cfg)
    terms, checked = _check(cfg, arrays, OPS[backend])
    assert terms[term] != 0.0 and terms["total"] == pytest.approx(terms[term])
    # every variable the term depends on was checked (support always; obs only for observation)
    expect = {
        "self": 5,
        "belief_align": 4,
        "prior_align": 4,
        "observation": 4,
        "gauge_smoothness": 2,
    }[term]
    assert checked == expect


def test_field_gradient_all_terms_sparse_list():
    """All terms at once with an explicit neighbour list and jitter."""
    nb = vfesim.SparseNeighbours.from_lists([[1, 2], [0], [3, 0, 4], [2], [0, 3]])
    cfg = _config("belief_align", "expected", "2d-periodic", neighbours=nb, lambda_self=0.7, lambda_prior=0.4)
    cfg = cfg.replace(lambda_phi=0.2, jitter=0.05)
    arrays = _arrays(cfg)
    _, checked = _check(cfg, arrays, NUMPY_AGENT_OPS)
    assert checked == 6


def test_support_gradient_is_zero_outside_the_support():
    cfg = _config("belief_align", "expected", "1d-periodic", lambda_self=1.0, lambda_phi=0.5)
    arrays = _arrays(cfg)
    _, grads = _energy(cfg, arrays, NUMPY_AGENT_OPS, None)
    out = arrays["support"] == 0
    for k, g in grads.items():
        assert not np.any(g[out]), k  # no term and no gradient where chi = 0
    assert np.all(grads["support"][~out] != 0)


def _point_state(n=6, seed=2, **kw):
    cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5, **kw)
    return cfg, vfesim.random_state(cfg, n, seed=seed)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("grid", [(1,), (1, 1)])
@pytest.mark.parametrize("boundary", ["periodic", "bounded"])
def test_one_point_field_is_the_point_agent(grid, boundary, aggregator, backend):
    rng = np.random.default_rng(5)
    W, A = rng.standard_normal((2, 3)), rng.standard_normal((2, 2))
    obs = dict(W=W, R=A @ A.T + 2 * np.eye(2), lambda_obs=0.6)
    pcfg, pst = _point_state(aggregator=aggregator, jitter=0.01, **obs)
    fcfg = FieldConfig(
        K=3, lambda_prior=0.5, aggregator=aggregator, jitter=0.01, grid=grid, boundary=boundary,
        lambda_phi=1.0, **obs,
    )  # fmt: skip
    n = pst.sizes["agent"]
    expand = lambda a: a.reshape(n, *grid, *a.shape[1:])
    arrays = {k: expand(pst[k].values) for k in pst.data_vars}
    fst = vfesim.make_state(fcfg, *(arrays[k] for k in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")),
                            np.ones((n, *grid)), arrays["obs"])  # fmt: skip
    pt, pg = vfesim.energy_and_gradient(pst, pcfg, backend=backend)
    ft, fg = vfesim.energy_and_gradient(fst, fcfg, backend=backend)
    for k in pt:
        assert ft[k] == pytest.approx(pt[k], rel=1e-13, abs=1e-13), k
    assert ft["gauge_smoothness"] == 0.0
    for k in pg.data_vars:
        np.testing.assert_allclose(fg[k].values.reshape(pg[k].shape), pg[k].values, rtol=1e-12, atol=1e-13)


def test_one_point_field_sparse_list_is_the_point_agent():
    nb = vfesim.SparseNeighbours.ring(6, 1)
    pcfg, pst = _point_state(neighbours=nb)
    fcfg = FieldConfig(K=3, lambda_prior=0.5, neighbours=nb, grid=(1,))
    arrays = {k: pst[k].values[:, None] for k in pst.data_vars}
    fst = vfesim.make_state(fcfg, *arrays.values(), np.ones((6, 1)))
    pt, pg = vfesim.energy_and_gradient(pst, pcfg)
    ft, fg = vfesim.energy_and_gradient(fst, fcfg)
    assert ft["total"] == pytest.approx(pt["total"], rel=1e-13)
    for k in pg.data_vars:
        np.testing.assert_allclose(fg[k].values[:, 0], pg[k].values, rtol=1e-12, atol=1e-13)
