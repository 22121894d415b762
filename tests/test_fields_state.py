"""Field agents: FieldConfig validation and JSON round trip, the state Dataset (dims, coords,
constructors, validation errors naming variable, agent and grid point), supports and placement."""

from __future__ import annotations

import numpy as np
import pytest

import vfesim
from vfesim import ConfigError, FieldConfig, StateError
from vfesim.fields import supports

# --- config ----------------------------------------------------------------------------------------


def test_config_defaults_and_point_model():
    cfg = FieldConfig(K=3, grid=(8, 6), lambda_prior=0.5)
    assert (cfg.boundary, cfg.overlap_threshold, cfg.cell_volume, cfg.lambda_phi) == (
        "periodic",
        0.1,
        "sum",
        0.0,
    )
    assert cfg.neighbours == "overlap" and cfg.grid_dims == ("x", "y") and cfg.n_points == 48
    assert cfg.weight == 1.0 and cfg.replace(cell_volume="grid", spacing=0.5).weight == 0.25
    assert isinstance(cfg.point, vfesim.ModelConfig) and cfg.point.lambda_prior == 0.5
    assert cfg.irreps == (1,) and FieldConfig(irreps=[1, 0], grid=[4]).K == 4
    assert vfesim.family_of(cfg).name == "field"
    assert FieldConfig(K=3, grid=5).grid == (5,)


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(grid=(4,), colour=1), "colour"),
        (dict(), "grid"),
        (dict(grid=(4, 4, 4)), "grid"),
        (dict(grid=(4, 0)), "grid"),
        (dict(grid=(4, 2.5)), "grid"),
        (dict(grid="4x4"), "grid"),
        (dict(grid=(4,), boundary="open"), "boundary"),
        (dict(grid=(4,), boundary=1), "boundary"),
        (dict(grid=(4,), spacing=0), "spacing"),
        (dict(grid=(4,), spacing="1"), "spacing"),
        (dict(grid=(4,), overlap_threshold=1.5), "overlap_threshold"),
        (dict(grid=(4,), overlap_threshold=-0.1), "overlap_threshold"),
        (dict(grid=(4,), cell_volume="area"), "cell_volume"),
        (dict(grid=(4,), cell_volume=-1.0), "cell_volume"),
        (dict(grid=(4,), lambda_phi=-1), "lambda_phi"),
        (dict(grid=(4,), lambda_phi="big"), "lambda_phi"),
        (dict(grid=(4,), neighbours="ring"), "neighbours"),
        (dict(grid=(4,), K=4), "K"),
        (dict(grid=(4,), kappa_beta=0), "kappa_beta"),
        (dict(grid=(4,), aggregator="max"), "aggregator"),
        (dict(grid=(4,), lambda_obs=1.0), "W"),
        (dict(grid=(4,), dtype="int8"), "dtype"),
    ],
)
def test_config_errors_name_the_key(kw, key):
    kw.setdefault("K", 3)
    with pytest.raises(ConfigError) as e:
        if "colour" in kw:
            FieldConfig.from_dict(kw)
        else:
            FieldConfig(**kw)
    assert e.value.key == key and str(e.value).startswith(f"{key}: ")


def test_config_json_round_trip():
    rng = np.random.default_rng(0)
    nb = vfesim.SparseNeighbours.from_lists([[1], [0, 2], [1]])
    cfg = FieldConfig(
        irreps=(1, 0), grid=(5, 3), boundary="bounded", spacing=0.25, cell_volume="grid", lambda_phi=0.3,
        overlap_threshold=0.2, neighbours=nb, W=rng.standard_normal((2, 4)), R=np.eye(2), lambda_obs=0.5,
        dtype="float32",
    )  # fmt: skip
    back = FieldConfig.from_json(cfg.to_json())
    assert back == cfg and back.grid == (5, 3) and back.irreps == (1, 0)
    np.testing.assert_array_equal(back.neighbours.index, nb.index)
    assert FieldConfig.from_json(FieldConfig(K=3, grid=(4,), cell_volume=0.5).to_json()).cell_volume == 0.5
    assert FieldConfig(irreps=(1, 0), grid=(3,)).replace(K=5).irreps == (2,)


# --- state -----------------------------------------------------------------------------------------


def test_state_dims_coords_and_attrs():
    cfg = FieldConfig(K=3, grid=(5, 4), spacing=0.5)
    st = vfesim.random_state(cfg, 3, seed=0)
    assert st.mu_q.dims == ("agent", "x", "y", "latent")
    assert st.sigma_q.dims == ("agent", "x", "y", "latent", "latent_b")
    assert st.phi.dims == ("agent", "x", "y", "gauge") and st.support.dims == ("agent", "x", "y")
    np.testing.assert_array_equal(st.x.values, 0.5 * np.arange(5))
    np.testing.assert_array_equal(st.y.values, 0.5 * np.arange(4))
    assert st.attrs["agent_family"] == "field" and FieldConfig.from_json(st.attrs["model_config"]) == cfg
    st1 = vfesim.random_state(FieldConfig(K=3, grid=(6,)), 2, seed=0)
    assert st1.mu_q.dims == ("agent", "x", "latent") and "y" not in st1.coords
    # the gradient Dataset keeps the grid coordinates
    _, g = vfesim.energy_and_gradient(st, cfg)
    np.testing.assert_array_equal(g.x.values, st.x.values)
    assert g.support.dims == st.support.dims


def test_random_state_is_reproducible_and_has_obs():
    rng = np.random.default_rng(1)
    cfg = FieldConfig(K=3, grid=(4,), W=rng.standard_normal((2, 3)), R=np.eye(2), lambda_obs=1.0)
    a = vfesim.random_state(cfg, 3, seed=5)
    b = vfesim.random_state(cfg, 3, seed=5)
    assert a.identical(b) and a.obs.dims == ("agent", "x", "obs_dim")
    assert not a.identical(vfesim.random_state(cfg, 3, seed=6))
    assert vfesim.random_state(cfg, 3, seed=5, dtype="float32").mu_q.dtype == np.float32


def test_random_state_support_options():
    cfg = FieldConfig(K=3, grid=(10, 10))
    full = vfesim.random_state(cfg, 2, support="full")
    assert (full.support.values == 1).all()
    disc = vfesim.random_state(cfg, 4, support="disc", placement="lattice", radius=2.0)
    assert set(np.unique(disc.support.values)) == {0.0, 1.0}
    user = np.full((2, 10, 10), 0.5)
    assert (vfesim.random_state(cfg, 2, support=user).support.values == 0.5).all()
    with pytest.raises(StateError, match="support"):
        vfesim.random_state(cfg, 2, support="square")
    with pytest.raises(StateError, match="support"):
        vfesim.random_state(cfg, 2, support=np.ones((3, 10, 10)))
    with pytest.raises(StateError, match="n_agents"):
        vfesim.random_state(cfg, 0)


def _arrays(cfg, n=3):
    st = vfesim.random_state(cfg, n, seed=2, support="full")
    return {k: st[k].values.copy() for k in st.data_vars}


def _make(cfg, a):
    return vfesim.make_state(cfg, a["mu_q"], a["sigma_q"], a["mu_p"], a["sigma_p"], a["phi"], a["support"])


def test_validation_names_variable_agent_and_grid_point():
    cfg = FieldConfig(K=3, grid=(4, 5))
    a = _arrays(cfg)
    a["sigma_q"][2, 1, 3] = -np.eye(3)
    with pytest.raises(
        StateError, match=r"^sigma_q\[agent=2\]: at grid point \(x=1, y=3\): .*positive definite"
    ):
        _make(cfg, a)
    a = _arrays(cfg)
    a["mu_p"][1, 3, 0, 2] = np.nan
    with pytest.raises(StateError, match=r"^mu_p\[agent=1\]: at grid point \(x=3, y=0\): contains NaN") as e:
        _make(cfg, a)
    assert e.value.agent == 1 and e.value.variable == "mu_p"


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (
            lambda a: a["support"].__setitem__((1, 2, 4), 1.5),
            r"^support\[agent=1\]: at grid point \(x=2, y=4\)",
        ),
        (lambda a: a["support"].__setitem__((0, 0, 1), np.nan), r"^support\[agent=0\]: .*\[0, 1\]"),
        (lambda a: a["support"].__setitem__(2, 0.0), r"^support\[agent=2\]: is zero everywhere"),
        (lambda a: a.__setitem__("phi", a["phi"][:, :, :4]), r"^phi: shape must be \(3, 4, 5, 3\)"),
        (lambda a: a.__setitem__("mu_q", a["mu_q"][:, :, :, :2]), r"^mu_q: shape must be"),
        (lambda a: a.__setitem__("support", a["support"].astype(np.float32)), r"^support: dtype float32"),
        (
            lambda a: a.__setitem__("mu_q", a["mu_q"].astype(np.int64)),
            r"^mu_q: dtype must be float32 or float64",
        ),
        (lambda a: a.pop("support"), r"^support: missing"),
        (lambda a: a.__setitem__("rho", a["support"]), r"^rho: unknown state variable"),
    ],
)
def test_validation_errors(edit, pattern):
    cfg = FieldConfig(K=3, grid=(4, 5))
    a = _arrays(cfg)
    edit(a)
    with pytest.raises(StateError, match=pattern):
        vfesim.validate_state(a, cfg)


def test_validation_of_datasets_config_dtype_and_neighbours():
    cfg = FieldConfig(K=3, grid=(4,))
    st = vfesim.random_state(cfg, 3, seed=0)
    with pytest.raises(StateError, match=r"^mu_q: dims must be"):
        vfesim.validate_state(st.rename({"x": "z"}), cfg)
    with pytest.raises(StateError, match="differs from the config's dtype float32"):
        vfesim.validate_state(st, cfg.replace(dtype="float32"))
    with pytest.raises(StateError, match="sparse neighbours for 2 agents but the state has 3"):
        vfesim.validate_state(st, cfg.replace(neighbours=vfesim.SparseNeighbours.from_lists([[1], [0]])))
    rng = np.random.default_rng(0)
    with pytest.raises(StateError, match=r"^obs: the config has an observation model"):
        vfesim.validate_state(st, cfg.replace(W=rng.standard_normal((2, 3)), R=np.eye(2), lambda_obs=1.0))


def test_conditioning_warning_names_agent_and_grid_point():
    cfg = FieldConfig(K=3, grid=(3, 2))
    a = _arrays(cfg)
    a["sigma_p"][1, 2, 1] = np.diag([1.0, 1.0, 1e-7])
    with pytest.warns(vfesim.ConditioningWarning, match=r"^sigma_p\[agent=1, x=2, y=1\]: condition number"):
        vfesim.validate_state(a, cfg)


def test_make_state_round_trips_arrays():
    cfg = FieldConfig(K=3, grid=(3,))
    a = _arrays(cfg)
    st = _make(cfg, a)
    for k, v in a.items():
        np.testing.assert_array_equal(st[k].values, v)


# --- supports --------------------------------------------------------------------------------------


def test_periodic_distances_use_the_minimum_image():
    cfg = FieldConfig(K=3, grid=(10,), spacing=1.0)
    d = supports.distances(cfg, [[0.0]])[0]
    np.testing.assert_allclose(d, [0, 1, 2, 3, 4, 5, 4, 3, 2, 1])
    d = supports.distances(cfg.replace(boundary="bounded"), [[0.0]])[0]
    np.testing.assert_allclose(d, np.arange(10.0))
    cfg2 = FieldConfig(K=3, grid=(4, 6), spacing=0.5)
    d2 = supports.distances(cfg2, [[0.0, 0.0]])[0]
    assert d2[3, 5] == pytest.approx(np.hypot(0.5, 0.5))


def test_gaussian_bumps_are_cut_beyond_three_sigma():
    cfg = FieldConfig(K=3, grid=(40,), boundary="bounded")
    chi = supports.gaussian_bumps(cfg, [[10.0]], sigma=2.0)[0]
    x = np.arange(40.0)
    inside = np.abs(x - 10) <= 6
    np.testing.assert_allclose(chi[inside], np.exp(-0.5 * ((x[inside] - 10) / 2) ** 2))
    assert (chi[~inside] == 0).all() and chi.max() == 1.0
    # radius from area: 2-D pi r^2, 1-D 2 r
    assert supports.radius_from_area(cfg, 6.0) == 3.0
    cfg2 = FieldConfig(K=3, grid=(8, 8))
    assert supports.radius_from_area(cfg2, np.pi * 4) == pytest.approx(2.0)
    np.testing.assert_allclose(
        supports.gaussian_bumps(cfg2, [[3.0, 4.0]], area=np.pi * 4),
        supports.gaussian_bumps(cfg2, [[3.0, 4.0]], sigma=2.0),
    )
    with pytest.raises(ValueError, match="exactly one of area and sigma"):
        supports.gaussian_bumps(cfg2, [[3.0, 4.0]])
    with pytest.raises(ValueError, match="centres"):
        supports.gaussian_bumps(cfg2, [[3.0]], sigma=1.0)


def test_discs_and_placement():
    cfg = FieldConfig(K=3, grid=(8, 8))
    chi = supports.discs(cfg, [[4.0, 4.0]], radius=1.0)[0]
    assert chi.sum() == 5 and chi[4, 4] == 1 and chi[5, 5] == 0
    lat = supports.lattice_centres(cfg, 4)
    np.testing.assert_allclose(lat, [[2, 2], [2, 6], [6, 2], [6, 6]])
    np.testing.assert_allclose(supports.lattice_centres(FieldConfig(K=3, grid=(10,)), 2), [[2.5], [7.5]])
    r = supports.random_centres(cfg, 50, np.random.default_rng(0))
    assert r.shape == (50, 2) and (r >= 0).all() and (r < 8).all()
