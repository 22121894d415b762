"""Field agents: energies against the loop oracle (tests/reference/fields.py), attention, backend parity
(numpy / numba point-agent stages), the weighted pairwise layer, and gauge invariance."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOL
from reference.fields import reference_field_attention, reference_field_energy, reference_neighbours

import vfesim
from vfesim.fields import FieldConfig, attention, gauge_smoothness
from vfesim.fields.supports import neighbour_lists
from vfesim.groups import expm_so3, generators
from vfesim.pairwise.reference import pairwise_sparse
from vfesim.pairwise.weighted import pairwise_sparse_weighted


def _obs(K=3, D=2, seed=3):
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((D, D))
    return dict(W=rng.standard_normal((D, K)), R=A @ A.T + D * np.eye(D), lambda_obs=0.7)


CONFIGS = {
    "1d-periodic-expected": dict(grid=(8,), boundary="periodic", lambda_phi=0.4, **_obs()),
    "1d-bounded-softmin": dict(grid=(8,), boundary="bounded", aggregator="softmin", lambda_phi=0.4),
    "2d-bounded-expected": dict(
        grid=(4, 5), boundary="bounded", spacing=0.5, cell_volume="grid", lambda_phi=1.0
    ),
    "2d-periodic-softmin": dict(grid=(5, 4), aggregator="softmin", cell_volume=0.7, jitter=0.02, **_obs()),
    "2d-dense": dict(grid=(3, 4), neighbours="dense", lambda_phi=0.3),
}


def _case(name, n=5, seed=1, **kw):
    cfg = FieldConfig(K=3, lambda_prior=0.6, kappa_beta=0.8, kappa_gamma=1.3, **{**CONFIGS[name], **kw})
    area = (0.25 if cfg.ndim == 1 else 0.15) * cfg.n_points * cfg.spacing**cfg.ndim
    return cfg, vfesim.random_state(cfg, n, seed=seed, area=area, phi_radius=2.5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_energy_matches_the_loop_oracle(name):
    cfg, st = _case(name)
    assert (st.support.values == 0).any()
    terms, _ = vfesim.energy_and_gradient(st, cfg)
    ref = reference_field_energy(st, cfg)
    assert terms.keys() == ref.keys()
    for k in ref:
        assert terms[k] == pytest.approx(ref[k], rel=1e-10, abs=1e-12), k
    assert terms["belief_align"] != 0 and terms["prior_align"] != 0


def test_energy_matches_the_oracle_with_a_sparse_list_and_lattice_discs():
    nb = vfesim.SparseNeighbours.from_lists([[1, 3], [0, 2], [1], [0, 1, 2]])
    cfg = FieldConfig(K=3, lambda_prior=0.5, grid=(6, 6), neighbours=nb, lambda_phi=0.2)
    st = vfesim.random_state(cfg, 4, seed=2, support="disc", placement="lattice", radius=2.5)
    terms, _ = vfesim.energy_and_gradient(st, cfg)
    ref = reference_field_energy(st, cfg)
    for k in ref:
        assert terms[k] == pytest.approx(ref[k], rel=1e-10, abs=1e-12), k


@pytest.mark.parametrize("name", ["1d-periodic-expected", "2d-periodic-softmin"])
def test_neighbours_and_attention_match_the_oracle(name):
    cfg, st = _case(name)
    arrays = {k: st[k].values for k in st.data_vars}
    index, mask = neighbour_lists(arrays["support"], cfg)
    lists = [list(index[i][mask[i]]) for i in range(index.shape[0])]
    assert lists == reference_neighbours(arrays["support"], cfg)
    for which in ("belief", "prior"):
        beta = attention(arrays, cfg, which)  # (N, *grid, k)
        ref = reference_field_attention(st, cfg, which)  # (N, *grid, N)
        dense = np.zeros_like(ref)
        for i, row in enumerate(lists):
            dense[i][..., row] = beta[i][..., : len(row)]
        np.testing.assert_allclose(dense, ref, rtol=1e-10, atol=1e-13)
    # each covered receiver with a covered neighbour attends with total weight 1
    s = beta.sum(axis=-1)
    assert np.allclose(s[s > 0], 1.0)


def test_threshold_selects_overlapping_pairs():
    cfg = FieldConfig(K=3, grid=(20,), boundary="bounded", overlap_threshold=0.5)
    chi = np.zeros((3, 20))
    chi[0, 0:6] = 1.0
    chi[1, 5:10] = 0.6  # overlaps agent 0 at x=5 with product 0.6
    chi[2, 9:20] = 0.8  # overlaps agent 1 at x=9 with product 0.48 < 0.5
    index, mask = neighbour_lists(chi, cfg)
    assert [list(index[i][mask[i]]) for i in range(3)] == [[1], [0], []]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_numba_stages_match_numpy(name):
    cfg, st = _case(name, n=6, seed=3)
    t0, g0 = vfesim.energy_and_gradient(st, cfg, backend="numpy")
    t1, g1 = vfesim.energy_and_gradient(st, cfg, backend="numba")
    for k in t0:
        assert t1[k] == pytest.approx(t0[k], **{"rel": TOL["float64"]["rtol"], "abs": 1e-12}), k
    for k in g0.data_vars:
        np.testing.assert_allclose(g1[k].values, g0[k].values, **TOL["float64"])


def test_float32_matches_float64():
    cfg, st = _case("2d-bounded-expected")
    t64, g64 = vfesim.energy_and_gradient(st, cfg)
    t32, g32 = vfesim.energy_and_gradient(st.astype("float32"), cfg)
    assert g32["mu_q"].dtype == np.float32
    assert t32["total"] == pytest.approx(t64["total"], rel=1e-4)
    for k in g64.data_vars:
        scale = float(np.abs(g64[k].values).max())
        np.testing.assert_allclose(g32[k].values, g64[k].values, rtol=0, atol=1e-4 * scale)


def test_gauge_covariance_per_agent_and_point():
    """New frames phi' at every (agent, point) with beliefs and priors carried along (Q = R' R^T:
    mu -> Q mu, Sigma -> Q Sigma Q^T) leave the self and alignment terms unchanged."""
    cfg, st = _case("2d-periodic-softmin", lambda_obs=0.0, W=None, R=None)
    arrays = {k: st[k].values for k in st.data_vars}
    G, lmax = generators(cfg.irreps), max(cfg.irreps)
    shape = arrays["mu_q"].shape[:-1]
    rng = np.random.default_rng(0)
    phi_new = rng.uniform(-1.5, 1.5, arrays["phi"].shape)
    R = expm_so3(arrays["phi"].reshape(-1, 3), G, lmax).reshape(*shape, 3, 3)
    R_new = expm_so3(phi_new.reshape(-1, 3), G, lmax).reshape(*shape, 3, 3)
    Q = R_new @ np.swapaxes(R, -1, -2)
    new = dict(arrays, phi=phi_new)
    for kmu, ksig in (("mu_q", "sigma_q"), ("mu_p", "sigma_p")):
        new[kmu] = np.einsum("...kl,...l->...k", Q, arrays[kmu])
        new[ksig] = Q @ arrays[ksig] @ np.swapaxes(Q, -1, -2)
    t0, _ = vfesim.fields.energy_and_gradient_arrays(arrays, cfg)
    t1, _ = vfesim.fields.energy_and_gradient_arrays(new, cfg)
    for k in ("self", "belief_align", "prior_align"):
        assert t1[k] == pytest.approx(t0[k], rel=1e-10), k


def test_gauge_smoothness_of_a_constant_and_a_ramp():
    cfg = FieldConfig(K=3, grid=(6, 3), boundary="bounded", spacing=0.5)
    chi = np.ones((2, 6, 3))
    phi = np.zeros((2, 6, 3, 3))
    E, _, _ = gauge_smoothness(phi + 0.3, chi, cfg)
    assert E == 0.0
    phi[..., 0] = np.arange(6)[None, :, None] * 0.1  # slope 0.1 per step along x: |grad|^2 = (0.1/0.5)^2
    E, _, _ = gauge_smoothness(phi, chi, cfg)
    assert E == pytest.approx(2 * 5 * 3 * 0.04)  # 5 edges along x per column, 3 columns, 2 agents
    E_p, _, _ = gauge_smoothness(phi, chi, cfg.replace(boundary="periodic"))
    assert E_p == pytest.approx(E + 2 * 3 * (0.5 / 0.5) ** 2)  # the wrap edge jumps by 0.5


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_weighted_pairs_with_unit_weights_are_the_plain_layer(aggregator):
    rng = np.random.default_rng(1)
    N, D, k = 7, 5, 4
    A, B, c = rng.standard_normal((N, D)), rng.standard_normal((N, D)), rng.standard_normal(N)
    index = np.array([[(i + s + 1) % N for s in range(k)] for i in range(N)])
    mask = rng.uniform(size=(N, k)) > 0.3
    plain = pairwise_sparse(A, B, c, index, mask, 0.8, aggregator, return_beta=True)
    ones = np.ones(N)
    weighted = pairwise_sparse_weighted(A, B, c, index, mask, ones, ones, 0.8, aggregator, return_beta=True)
    assert weighted[0] == pytest.approx(plain[0], rel=1e-14)
    for a, b in zip(weighted[1:4] + weighted[6:], plain[1:4] + plain[4:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
def test_weighted_pairs_gradients_match_finite_differences(aggregator):
    rng = np.random.default_rng(2)
    N, D, k = 6, 4, 3
    args = dict(
        A=rng.standard_normal((N, D)), B=rng.standard_normal((N, D)), c=rng.standard_normal(N),
        u=rng.uniform(0.1, 1, N), v=rng.uniform(0.1, 1, N),
    )  # fmt: skip
    index = np.array([[(i + s + 1) % N for s in range(k)] for i in range(N)])
    mask = rng.uniform(size=(N, k)) > 0.2

    def f(a):
        return pairwise_sparse_weighted(a["A"], a["B"], a["c"], index, mask, a["u"], a["v"], 0.7, aggregator)

    out = f(args)
    grads = dict(zip(("A", "B", "c", "u", "v"), out[1:], strict=True))
    eps = 1e-6
    for key, val in args.items():
        d = rng.standard_normal(val.shape)
        fd = (f({**args, key: val + eps * d})[0] - f({**args, key: val - eps * d})[0]) / (2 * eps)
        assert float((grads[key] * d).sum()) == pytest.approx(fd, rel=1e-7), key
