"""ModelConfig and SparseNeighbours validation (SPEC §2.2, STYLE: fail early, name the key)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import vfesim
from vfesim import ConfigError, ModelConfig, SparseNeighbours


def test_defaults_and_resolved_irreps():
    cfg = ModelConfig(K=5)
    assert cfg.irreps == (2,) and cfg.K == 5
    assert cfg.aggregator == "expected" and cfg.dtype is None and cfg.jitter == 0.0
    assert cfg.dense and cfg.obs_dim == 0
    multi = ModelConfig(irreps=[1, 0])
    assert multi.K == 4 and multi.irreps == (1, 0)
    assert ModelConfig(K=4, irreps=(1, 0)) == multi


def test_frozen():
    cfg = ModelConfig(K=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.K = 5


@pytest.mark.parametrize("K", [2, 4, 10])
def test_even_K_single_irrep(K):
    with pytest.raises(ConfigError, match=r"^K: .*odd"):
        ModelConfig(K=K)


@pytest.mark.parametrize("K", [0, -3, 3.0, True, "3"])
def test_bad_K(K):
    with pytest.raises(ConfigError, match=r"^K: "):
        ModelConfig(K=K)


def test_missing_K():
    with pytest.raises(ConfigError, match=r"^K: "):
        ModelConfig()


def test_K_irreps_mismatch():
    with pytest.raises(ConfigError, match=r"^K: .*irreps"):
        ModelConfig(K=5, irreps=(1, 0))


@pytest.mark.parametrize("irreps", [(), (-1,), (1.5,), 2])
def test_bad_irreps(irreps):
    with pytest.raises(ConfigError, match=r"^irreps: "):
        ModelConfig(irreps=irreps)


@pytest.mark.parametrize("key", ["kappa_beta", "kappa_gamma"])
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_kappa_positive(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: .*> 0"):
        ModelConfig(K=3, **{key: value})


LAMBDAS = ["lambda_self", "lambda_belief", "lambda_prior", "lambda_obs"]


@pytest.mark.parametrize("key", LAMBDAS + ["jitter"])
def test_negative_lambda_and_jitter(key):
    with pytest.raises(ConfigError, match=rf"^{key}: .*>= 0"):
        ModelConfig(K=3, **{key: -0.1})


@pytest.mark.parametrize("key", LAMBDAS + ["kappa_beta", "jitter"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: .*finite"):
        ModelConfig(K=3, **{key: value})


@pytest.mark.parametrize("key", LAMBDAS)
@pytest.mark.parametrize("value", ["1.0", None, True, [1.0]])
def test_non_numeric(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}: .*real number"):
        ModelConfig(K=3, **{key: value})


def test_lambdas_become_floats():
    cfg = ModelConfig(K=3, lambda_self=2, kappa_beta=np.float32(0.5))
    assert type(cfg.lambda_self) is float and type(cfg.kappa_beta) is float


def test_unknown_aggregator():
    with pytest.raises(ConfigError, match=r"^aggregator: .*'mean'"):
        ModelConfig(K=3, aggregator="mean")


@pytest.mark.parametrize("dtype", ["float16", "complex128", "f8"])
def test_unknown_dtype(dtype):
    with pytest.raises(ConfigError, match=r"^dtype: "):
        ModelConfig(K=3, dtype=dtype)


def test_numpy_dtype_normalised_or_rejected():
    """A numpy dtype object must not slip through un-normalised (it breaks to_json)."""
    try:
        cfg = ModelConfig(K=3, dtype=np.dtype("float32"))
    except ConfigError as e:
        assert e.key == "dtype"
        return
    assert cfg.dtype == "float32" and isinstance(cfg.dtype, str)
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_state_dtype_must_match_an_explicit_config_dtype():
    """dtype None (default): the state's dtype is used; an explicit dtype refuses the other one."""
    import vfesim

    st32 = vfesim.random_state(ModelConfig(K=3), n_agents=3, dtype="float32")
    assert vfesim.random_state(ModelConfig(K=3), n_agents=3)["mu_q"].dtype == np.float64
    terms, grads = vfesim.energy_and_gradient(st32, ModelConfig(K=3))
    assert grads["mu_q"].dtype == np.float32
    cfg64 = ModelConfig(K=3, dtype="float64")
    with pytest.raises(
        vfesim.StateError, match=r"^mu_q: dtype float32 differs from the config's dtype float64"
    ):
        vfesim.energy_and_gradient(st32, cfg64)
    with pytest.raises(vfesim.StateError, match="dtype float32 differs"):
        vfesim.run_dynamics(st32, cfg64, "gradient_flow", 0.01, 1)
    vfesim.energy_and_gradient(st32, ModelConfig(K=3, dtype="float32"))


def test_api_rejects_a_dict_for_a_state():
    import vfesim

    cfg = ModelConfig(K=3)
    arrays = {k: v.values for k, v in vfesim.random_state(cfg, n_agents=3).data_vars.items()}
    with pytest.raises(TypeError, match=r"^state: expected an xarray.Dataset .* got builtins.dict"):
        vfesim.energy_and_gradient(arrays, cfg)
    with pytest.raises(TypeError, match=r"^state: expected an xarray.Dataset"):
        vfesim.run_dynamics(arrays, cfg, "verlet", 0.01, 1)
    with pytest.raises(TypeError, match=r"^scenario: expected a Scenario, a TOML file path or a dict"):
        vfesim.simulate(vfesim.random_state(cfg, n_agents=3), out="unused.zarr")


# --- observation model ---------------------------------------------------------------------


def test_lambda_obs_needs_W_and_R():
    with pytest.raises(ConfigError, match=r"^W: .*lambda_obs"):
        ModelConfig(K=3, lambda_obs=1.0)


def test_W_R_together():
    with pytest.raises(ConfigError, match=r"^R: "):
        ModelConfig(K=3, W=np.ones((2, 3)))
    with pytest.raises(ConfigError, match=r"^W: "):
        ModelConfig(K=3, R=np.eye(2))


@pytest.mark.parametrize("W", [np.ones((2, 4)), np.ones(3), np.ones((2, 3, 1))])
def test_W_wrong_shape(W):
    with pytest.raises(ConfigError, match=r"^W: .*shape"):
        ModelConfig(K=3, W=W, R=np.eye(2), lambda_obs=1.0)


@pytest.mark.parametrize("R", [np.eye(3), np.eye(2)[0], np.ones((2, 3))])
def test_R_wrong_shape(R):
    with pytest.raises(ConfigError, match=r"^R: .*shape"):
        ModelConfig(K=3, W=np.ones((2, 3)), R=R, lambda_obs=1.0)


@pytest.mark.parametrize(
    "R, what",
    [
        (np.array([[1.0, 2.0], [2.0, 1.0]]), "positive definite"),
        (-np.eye(2), "positive definite"),
        (np.array([[1.0, 0.5], [0.0, 1.0]]), "symmetric"),
        (np.array([[np.nan, 0.0], [0.0, 1.0]]), "finite"),
    ],
)
def test_R_not_spd(R, what):
    with pytest.raises(ConfigError, match=rf"^R: .*{what}"):
        ModelConfig(K=3, W=np.ones((2, 3)), R=R, lambda_obs=1.0)


def test_W_not_finite():
    W = np.ones((2, 3))
    W[1, 2] = np.inf
    with pytest.raises(ConfigError, match=r"^W: .*finite"):
        ModelConfig(K=3, W=W, R=np.eye(2), lambda_obs=1.0)


def test_observation_arrays_readonly_copies():
    W = np.ones((2, 3))
    cfg = ModelConfig(K=3, W=W, R=np.eye(2), lambda_obs=1.0)
    W[0, 0] = 5.0
    assert cfg.W[0, 0] == 1.0 and cfg.obs_dim == 2
    with pytest.raises(ValueError):
        cfg.W[0, 0] = 2.0


# --- sparse neighbours ---------------------------------------------------------------------


def test_sparse_ok_and_ring():
    nb = SparseNeighbours(np.array([[1, 2], [0, 0], [1, 0]]), np.array([[1, 1], [1, 0], [1, 1]], bool))
    cfg = ModelConfig(K=3, neighbours=nb)
    assert not cfg.dense and cfg.neighbours.width == 2 and cfg.neighbours.n_agents == 3
    ring = SparseNeighbours.ring(6, 2)
    assert sorted(ring.index[0].tolist()) == [1, 2, 4, 5]
    ragged = SparseNeighbours.from_lists([[1], [0, 2], []])
    assert ragged.mask.tolist() == [[True, False], [True, True], [False, False]]


@pytest.mark.parametrize("bad", [3, -1])
def test_sparse_index_out_of_range(bad):
    idx = np.array([[1], [2], [bad]])
    with pytest.raises(ConfigError, match=rf"^neighbours.index: agent 2 .*{bad}"):
        SparseNeighbours(idx, np.ones((3, 1), bool))


def test_sparse_out_of_range_under_mask_ignored():
    nb = SparseNeighbours(np.array([[1, 99], [0, -5]]), np.array([[1, 0], [1, 0]], bool))
    assert nb.n_agents == 2


def test_sparse_self_loop():
    with pytest.raises(ConfigError, match=r"^neighbours.index: agent 1 lists itself"):
        SparseNeighbours(np.array([[1], [1], [0]]), np.ones((3, 1), bool))


def test_sparse_duplicate():
    with pytest.raises(ConfigError, match=r"^neighbours.index: agent 0 lists sender 2 twice"):
        SparseNeighbours(np.array([[2, 2], [0, 2], [0, 1]]), np.ones((3, 2), bool))


@pytest.mark.parametrize(
    "mask", [np.ones((3, 1), bool), np.ones((3, 2), int), np.ones(6, bool)], ids=["shape", "dtype", "1d"]
)
def test_sparse_bad_mask(mask):
    with pytest.raises(ConfigError, match=r"^neighbours.mask: "):
        SparseNeighbours(np.array([[1, 2], [0, 2], [0, 1]]), mask)


def test_sparse_bad_index():
    with pytest.raises(ConfigError, match=r"^neighbours.index: .*2-D"):
        SparseNeighbours(np.array([1, 0]), None)
    with pytest.raises(ConfigError, match=r"^neighbours.index: .*integer"):
        SparseNeighbours(np.array([[1.0], [0.0]]), None)


def test_sparse_ring_bad():
    with pytest.raises(ConfigError, match=r"^neighbours: "):
        SparseNeighbours.ring(4, 2)


@pytest.mark.parametrize("nb", ["knn", 3, [[1], [0]]])
def test_bad_neighbours_value(nb):
    with pytest.raises(ConfigError, match=r"^neighbours: "):
        ModelConfig(K=3, neighbours=nb)


def test_neighbours_dict_without_mask():
    """A dict like SparseNeighbours(index, mask=None): the mask defaults to all-True."""
    cfg = ModelConfig(K=3, neighbours={"index": [[1], [0]]})
    assert cfg.neighbours.mask.all()


def test_neighbours_dict_without_index():
    with pytest.raises(ConfigError, match=r"^neighbours"):
        ModelConfig(K=3, neighbours={"mask": [[True], [True]]})


# --- serialisation -------------------------------------------------------------------------


def test_from_dict_unknown_key():
    with pytest.raises(ConfigError, match=r"^lambda_beta: unknown"):
        ModelConfig.from_dict({"K": 3, "lambda_beta": 1.0})


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(K=3),
        ModelConfig(irreps=(1, 0, 2), aggregator="softmin", kappa_beta=0.3, dtype="float32"),
        ModelConfig(
            K=3,
            lambda_prior=0.25,
            lambda_obs=1.5,
            W=np.arange(6.0).reshape(2, 3) / 7,
            R=np.array([[2.0, 0.1], [0.1, 1.0]]),
            neighbours=SparseNeighbours.from_lists([[1, 2], [0], [1]]),
            jitter=1e-9,
        ),
    ],
    ids=["default", "multi-irrep", "obs+sparse"],
)
def test_json_round_trip(cfg):
    s = cfg.to_json()
    back = ModelConfig.from_json(s)
    assert back == cfg
    assert back.to_json() == s
    assert back.irreps == cfg.irreps and back.K == cfg.K
    if cfg.W is not None:
        np.testing.assert_array_equal(back.W, cfg.W)
        np.testing.assert_array_equal(back.R, cfg.R)
    if not cfg.dense:
        np.testing.assert_array_equal(back.neighbours.index, cfg.neighbours.index)
        np.testing.assert_array_equal(back.neighbours.mask, cfg.neighbours.mask)


def test_equality_and_replace():
    a = ModelConfig(K=3, lambda_prior=0.5)
    assert a == ModelConfig(K=3, lambda_prior=0.5)
    assert a != ModelConfig(K=3, lambda_prior=0.25)
    assert a != "K=3"
    b = a.replace(K=5)
    assert b.K == 5 and b.irreps == (2,) and b.lambda_prior == 0.5 and a.K == 3
    with pytest.raises(ConfigError, match=r"^kappa_beta: "):
        a.replace(kappa_beta=0.0)
    with pytest.raises(TypeError):
        hash(a)


def test_sparse_lists_stay_out_of_metadata():
    """Metadata records sparse lists by their shape (a ring of 4e7 agents has 1.3e9 entries); loading
    such a record names the key and says where the lists come from; equality compares the arrays."""
    ring = SparseNeighbours.ring(50, 3)
    cfg = ModelConfig(K=3, neighbours=ring)
    short = json.loads(cfg.to_json(neighbour_lists=False))
    assert short["neighbours"] == {"sparse": {"n_agents": 50, "width": 6}}
    with pytest.raises(ConfigError, match=r"neighbours.*only the shape.*scenario"):
        ModelConfig.from_json(cfg.to_json(neighbour_lists=False))
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    other = SparseNeighbours(ring.index[:, ::-1].copy(), None)
    assert cfg != cfg.replace(neighbours=other)  # same shape, other lists
    assert cfg != ModelConfig(K=3)
    st = vfesim.random_state(cfg, 50, seed=0)
    assert json.loads(st.attrs["model_config"])["neighbours"] == short["neighbours"]


@pytest.mark.parametrize(("n", "h"), [(3, 1), (7, 3), (50, 4)])
def test_ring_is_what_the_checked_constructor_accepts(n, h):
    ring = SparseNeighbours.ring(n, h)
    checked = SparseNeighbours(ring.index.copy(), ring.mask.copy())
    assert ring == checked and ring.index.dtype == np.int64 and not ring.index.flags.writeable
    assert ring.index.shape == (n, 2 * h) and ring.mask.all()


@pytest.mark.parametrize(("n", "h"), [(3, 1), (5, 2), (9, 4), (100, 3)])
def test_ring_lists_wrap_and_are_shared_while_alive(n, h):
    """Ring lists: agent i lists i-h .. i-1, i+1 .. i+h modulo n (only the first and last h rows wrap);
    a second request while the first lists live returns the same read-only object (a scenario validated
    again does not rebuild them)."""
    from vfesim.config import SparseNeighbours

    ring = SparseNeighbours.ring(n, h)
    offs = np.concatenate([np.arange(-h, 0), np.arange(1, h + 1)])
    np.testing.assert_array_equal(ring.index, (np.arange(n)[:, None] + offs[None, :]) % n)
    assert ring.mask.all() and not ring.index.flags.writeable
    assert SparseNeighbours.ring(n, h) is ring
