"""The state Dataset (SPEC §1.1): constructors, random_state and validation errors naming agent/variable."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_obs_config

import vfesim
from vfesim import ModelConfig, SparseNeighbours, StateError, make_state, random_state, validate_state

CFG = ModelConfig(K=3)
N = 5


def arrays(cfg: ModelConfig = CFG, n: int = N, dtype=np.float64) -> dict:
    """A valid set of state arrays as a dict of plain copies."""
    st = random_state(cfg, n_agents=n, seed=3, dtype=np.dtype(dtype).name)
    return {k: st[k].values.copy() for k in st.data_vars}


def build(cfg: ModelConfig = CFG, **a):
    return make_state(cfg, a["mu_q"], a["sigma_q"], a["mu_p"], a["sigma_p"], a["phi"], a.get("obs"))


def test_schema_and_attrs():
    cfg = make_obs_config(K=5, obs_dim=2)
    st = random_state(cfg, n_agents=4, seed=0)
    assert st["mu_q"].dims == ("agent", "latent")
    assert st["sigma_q"].dims == ("agent", "latent", "latent_b")
    assert st["mu_p"].dims == ("agent", "latent")
    assert st["sigma_p"].dims == ("agent", "latent", "latent_b")
    assert st["phi"].dims == ("agent", "gauge")
    assert st["obs"].dims == ("agent", "obs_dim")
    assert dict(st.sizes) == {"agent": 4, "latent": 5, "latent_b": 5, "gauge": 3, "obs_dim": 2}
    assert ModelConfig.from_json(st.attrs["model_config"]) == cfg
    json.loads(st.attrs["model_config"])
    assert st.attrs["vfesim_version"] == vfesim.__version__
    assert st.attrs["dtype"] == "float64"
    assert "obs" not in random_state(CFG, n_agents=2).data_vars


def test_random_state_reproducible():
    a = random_state(CFG, n_agents=8, seed=11)
    b = random_state(CFG, n_agents=8, seed=11)
    c = random_state(CFG, n_agents=8, seed=12)
    for k in a.data_vars:
        np.testing.assert_array_equal(a[k].values, b[k].values)
        assert not np.array_equal(a[k].values, c[k].values), k


@pytest.mark.parametrize("eig_range", [(0.5, 2.0), (0.1, 0.3), (1.0, 1.0)])
def test_random_state_spd_in_range(eig_range):
    st = random_state(ModelConfig(K=7), n_agents=20, seed=0, eig_range=eig_range, prior_eig_range=(3.0, 4.0))
    lo, hi = eig_range
    for name, (a, b) in (("sigma_q", (lo, hi)), ("sigma_p", (3.0, 4.0))):
        S = st[name].values
        np.testing.assert_array_equal(S, np.swapaxes(S, 1, 2))
        w = np.linalg.eigvalsh(S)
        assert w.min() >= a * (1 - 1e-12) and w.max() <= b * (1 + 1e-12), name


@pytest.mark.parametrize("radius", [0.0, 0.5, 3.0])
def test_random_state_phi_radius(radius):
    phi = random_state(CFG, n_agents=200, seed=1, phi_radius=radius)["phi"].values
    r = np.linalg.norm(phi, axis=1)
    assert r.max() <= radius
    if radius:
        assert r.max() > 0.8 * radius  # uniform in the ball reaches near the boundary


def test_random_state_float32():
    cfg = make_obs_config(K=3, obs_dim=2)
    st = random_state(cfg, n_agents=6, seed=0, dtype="float32")
    assert st.attrs["dtype"] == "float32"
    assert all(st[k].dtype == np.float32 for k in st.data_vars)
    validate_state(st, cfg)
    st64 = random_state(cfg, n_agents=6, seed=0)
    np.testing.assert_allclose(st["sigma_q"].values, st64["sigma_q"].values, rtol=1e-6)
    assert random_state(ModelConfig(K=3, dtype="float32"), n_agents=2)["mu_q"].dtype == np.float32


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"dtype": "float16"}, "dtype"),
        ({"n_agents": 0}, "n_agents"),
        ({"phi_radius": np.pi}, "phi"),
        ({"phi_radius": -0.1}, "phi"),
        ({"eig_range": (0.0, 1.0)}, "sigma_q"),
        ({"eig_range": (2.0, 1.0)}, "sigma_q"),
    ],
)
def test_random_state_bad_arguments(kw, name):
    kw = {"n_agents": 3} | kw
    with pytest.raises(StateError, match=rf"^{name}: "):
        random_state(CFG, **kw)


def test_random_state_sparse_size_mismatch():
    cfg = ModelConfig(K=3, neighbours=SparseNeighbours.ring(5, 1))
    random_state(cfg, n_agents=5)
    with pytest.raises(StateError, match=r"^agent: .*5 agents"):
        random_state(cfg, n_agents=6)


# --- validation errors ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sigma_q", "sigma_p"])
def test_non_spd_names_agent_and_variable(name):
    a = arrays()
    a[name][3] = np.diag([1.0, -0.5, 2.0])
    with pytest.raises(StateError, match=rf"^{name}\[agent=3\]: is not positive definite") as e:
        build(**a)
    assert e.value.agent == 3 and e.value.variable == name


def test_non_symmetric_names_agent():
    a = arrays()
    a["sigma_q"][2, 0, 1] += 0.1
    with pytest.raises(StateError, match=r"^sigma_q\[agent=2\]: is not symmetric"):
        build(**a)


@pytest.mark.parametrize("K", [3, 11])  # batched factorisation and LAPACK per matrix
def test_first_failing_agent_is_named_whichever_check_it_fails(K):
    """An indefinite agent before an asymmetric one is named first (and vice versa), as on the device."""
    cfg = ModelConfig(K=K)
    a = arrays(cfg, n=10)
    indefinite = np.diag(np.r_[1.0, -0.5, np.full(K - 2, 2.0)])
    a["sigma_q"][3] = indefinite
    a["sigma_q"][7, 0, 1] += 0.1
    with pytest.raises(StateError, match=r"^sigma_q\[agent=3\]: is not positive definite"):
        build(cfg, **a)
    a["sigma_q"][1, 0, 1] += 0.1
    with pytest.raises(StateError, match=r"^sigma_q\[agent=1\]: is not symmetric"):
        build(cfg, **a)


def test_singular_covariance():
    a = arrays()
    a["sigma_p"][4] = np.ones((3, 3))
    with pytest.raises(StateError, match=r"^sigma_p\[agent=4\]: "):
        build(**a)


@pytest.mark.parametrize("name", ["mu_q", "sigma_q", "mu_p", "sigma_p", "phi", "obs"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_names_agent(name, bad):
    cfg = make_obs_config(K=3, obs_dim=2)
    a = arrays(cfg)
    a[name][2].flat[-1] = bad
    with pytest.raises(StateError, match=rf"^{name}\[agent=2\]: .*NaN or Inf") as e:
        build(cfg, **a)
    assert e.value.agent == 2


def test_wrong_dims():
    st = random_state(CFG, n_agents=N)
    bad = st.assign(phi=(("agent", "latent"), st["phi"].values))  # K = 3 = gauge size
    with pytest.raises(StateError, match=r"^phi: dims must be"):
        validate_state(bad, CFG)


@pytest.mark.parametrize(
    "name, shape",
    [("sigma_q", (N, 3, 4)), ("mu_q", (N, 5)), ("phi", (N, 2)), ("sigma_p", (N, 3))],
)
def test_wrong_shape(name, shape):
    a = arrays()
    a[name] = np.ones(shape)
    with pytest.raises(StateError, match=rf"^{name}: (shape|dims)"):
        validate_state(a, CFG)


def test_wrong_shape_dataset():
    st = random_state(ModelConfig(K=5), n_agents=N)
    with pytest.raises(StateError, match=r"^mu_q: shape must be \(5, 3\)"):
        validate_state(st, CFG)


def test_wrong_n_agents_between_variables():
    a = arrays()
    a["phi"] = a["phi"][:3]
    with pytest.raises(StateError, match=r"^phi: shape"):
        validate_state(a, CFG)


@pytest.mark.parametrize("name", ["sigma_q", "phi", "mu_p"])
def test_mixed_dtype(name):
    a = arrays()
    a[name] = a[name].astype(np.float32)
    with pytest.raises(StateError, match=rf"^{name}: dtype float32 differs"):
        build(**a)


def test_non_float_dtype():
    a = arrays()
    a["mu_q"] = np.zeros((N, 3), np.int64)
    with pytest.raises(StateError, match=r"^mu_q: dtype must be float32 or float64"):
        validate_state(a, CFG)


@pytest.mark.parametrize("name", ["mu_q", "sigma_q", "mu_p", "sigma_p", "phi"])
def test_missing_variable(name):
    st = random_state(CFG, n_agents=N).drop_vars(name)
    with pytest.raises(StateError, match=rf"^{name}: missing"):
        validate_state(st, CFG)


def test_unknown_variable():
    st = random_state(CFG, n_agents=N)
    st = st.assign(momentum=(("agent", "latent"), st["mu_q"].values))
    with pytest.raises(StateError, match=r"^momentum: unknown state variable"):
        validate_state(st, CFG)


def test_missing_obs_when_config_has_W():
    cfg = make_obs_config(K=3, obs_dim=2)
    a = arrays()  # from a config without observations
    with pytest.raises(StateError, match=r"^obs: .*observation model"):
        build(cfg, **a)


def test_sparse_config_agent_count():
    cfg = ModelConfig(K=3, neighbours=SparseNeighbours.ring(4, 1))
    with pytest.raises(StateError, match=r"^agent: .*4 agents .*5"):
        build(cfg, **arrays())


def test_empty_state():
    a = {k: v[:0] for k, v in arrays().items()}
    with pytest.raises(StateError, match=r"^agent: .*no agents"):
        validate_state(a, CFG)


def test_valid_mapping_and_check_spd_switch():
    a = arrays()
    validate_state(a, CFG)
    a["sigma_q"][0] = -np.eye(3)
    validate_state(a, CFG, check_spd=False)
    with pytest.raises(StateError, match=r"^sigma_q\[agent=0\]"):
        validate_state(a, CFG)


# --- magnitudes and conditioning (README, "Numerics") ----------------------------------------------
def _with_condition(S: np.ndarray, cond: float, seed: int = 0) -> np.ndarray:
    """An SPD matrix like S's shape with eigenvalues log-spaced from 1 down to 1/cond, random axes."""
    K = S.shape[-1]
    Q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((K, K)))
    out = (Q * np.logspace(0, -np.log10(cond), K)) @ Q.T
    return (0.5 * (out + out.T)).astype(S.dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", ["mu_q", "sigma_p", "phi"])
def test_entries_whose_square_overflows_name_agent(name, dtype):
    a = arrays(dtype=dtype)
    big = 1e200 if dtype == "float64" else 1e30
    a[name][1].flat[0] = big
    if name == "sigma_p":
        a[name][1] = big * np.eye(3, dtype=dtype)
    with pytest.raises(
        StateError, match=rf"^{name}\[agent=1\]: has \|entry\| .* its square overflows {dtype}"
    ):
        build(**a)


@pytest.mark.parametrize("dtype, ok, warn, refuse", [("float64", 1e5, 1e9, 1e14), ("float32", 1e2, 1e4, 1e5)])
def test_phi_magnitude_limits(dtype, ok, warn, refuse):
    a = arrays(dtype=dtype)
    for t in (ok, warn, refuse):
        a["phi"][3] = np.array([t, 0.0, 0.0], dtype)
        if t == refuse:
            with pytest.raises(StateError, match=r"^phi\[agent=3\]: \|phi\| = .* does not resolve"):
                build(**a)
        elif t == warn:
            with pytest.warns(vfesim.ConditioningWarning, match=r"phi\[agent=3\]: \|phi\| = "):
                build(**a)
        else:
            build(**a)


@pytest.mark.parametrize(
    "dtype, ok, warn, refuse", [("float64", 1e5, 1e8, 1e14), ("float32", 1e2, 3e3, 1e5 * 1.5)]
)
@pytest.mark.parametrize("name", ["sigma_q", "sigma_p"])
def test_condition_number_warns_then_refuses(name, dtype, ok, warn, refuse):
    a = arrays(dtype=dtype)
    a[name][2] = _with_condition(a[name][2], ok)
    build(**a)
    a[name][4] = _with_condition(a[name][4], warn)
    with pytest.warns(vfesim.ConditioningWarning, match=rf"^{name}\[agent=4\]: condition number .*{dtype}"):
        build(**a)
    a[name][1] = _with_condition(a[name][1], refuse)
    with pytest.raises(StateError, match=rf"^{name}\[agent=1\]: condition number .* exceeds") as e:
        build(**a)
    assert e.value.agent == 1
    validate_state(a, CFG, conditioning="off")  # still SPD: only the conditioning check refuses it


def test_jitter_counts_in_the_condition_number():
    a = arrays()
    a["sigma_q"][0] = _with_condition(a["sigma_q"][0], 1e9)
    with pytest.warns(vfesim.ConditioningWarning):
        validate_state(a, CFG)
    validate_state(a, ModelConfig(K=3, jitter=1e-3))  # S + 1e-3 I: condition number ~1e3


@pytest.mark.parametrize("scale", [1.0, 1e-170, 1e150])
@pytest.mark.parametrize("K", [1, 2, 3, 8, 9, 21])
def test_host_condition_bounds_bound_the_condition_numbers(K, scale):
    from vfesim.state import condition_bounds

    rng = np.random.default_rng(K)
    X = rng.normal(size=(300, K, K))
    S = (X @ X.transpose(0, 2, 1) + np.logspace(-6, 0, 300)[:, None, None] * np.eye(K)) * scale
    w = np.linalg.eigvalsh(S)
    cond = w[:, -1] / w[:, 0]
    b = condition_bounds(S, np.linalg.cholesky(S))  # (no squares of tiny or huge entries)
    assert b.dtype == np.float64 and b.shape == (300,)
    assert (b >= cond * (1 - 1e-10)).all()
    assert (
        b <= cond * K * np.sqrt(K) * (1 + 1e-10)
    ).all()  # (||S||_F <= sqrt(K) ||S||, ||L^-1||_F^2 <= K ||S^-1||)


@pytest.mark.parametrize("K", [2, 3, 21])
def test_host_condition_bounds_of_float32_factors(K):
    """float32 covariances through the host SPD check's own factor: within L's rounding of an upper bound
    (check_conditioning doubles them before comparing with the warning level)."""
    from vfesim.state import check_spd_batch, condition_bounds

    rng = np.random.default_rng(K)
    Q = np.linalg.qr(rng.normal(size=(400, K, K)))[0]
    lam = np.exp(rng.uniform(0, np.log(3e4), size=(400, K)))
    S = ((Q * lam[:, None, :]) @ Q.transpose(0, 2, 1)).astype(np.float32)
    S = (S + S.transpose(0, 2, 1)) / 2
    L, _, _ = check_spd_batch(S, "sigma_q")
    w = np.linalg.eigvalsh(S.astype(np.float64))
    cond = w[:, -1] / w[:, 0]
    assert (condition_bounds(S, L) >= cond * (1 - 1e-2)).all()


@pytest.mark.parametrize("scale", [1e-170, 1e140])
def test_host_condition_checks_do_not_depend_on_the_scale(scale):
    a = arrays()
    for k in ("sigma_q", "sigma_p"):
        a[k] = a[k] * scale
    a["sigma_q"][4] = _with_condition(a["sigma_q"][4], 1e8) * scale
    with pytest.warns(vfesim.ConditioningWarning, match=r"^sigma_q\[agent=4\]: condition number 1e\+08"):
        validate_state(a, CFG)
    a["sigma_q"][2] = _with_condition(a["sigma_q"][2], 1e15) * scale
    with pytest.raises(StateError, match=r"^sigma_q\[agent=2\]: condition number .* exceeds"):
        validate_state(a, CFG)


def test_host_conditioning_solves_only_the_agents_a_bound_flags(monkeypatch):
    """The exact mode's eigenvalues on the host go to the agents whose bound exceeds the warning level
    (none for an ordinary state): the same verdicts, without an eigensolver per agent."""
    calls = []
    eigvalsh = np.linalg.eigvalsh
    monkeypatch.setattr(np.linalg, "eigvalsh", lambda S: calls.append(S.shape[0]) or eigvalsh(S))
    a = arrays()
    validate_state(a, CFG)
    assert calls == []
    a["sigma_q"][4] = _with_condition(a["sigma_q"][4], 1e8)
    with pytest.warns(
        vfesim.ConditioningWarning, match=r"^sigma_q\[agent=4\]: condition number 1e\+08 \(worst of 1"
    ):
        validate_state(a, CFG)
    assert calls and calls[0] < a["sigma_q"].shape[0]


def test_condition_estimate_mode_refuses_without_warning():
    a = arrays()
    a["sigma_q"][0] = np.diag([1.0, 1.0, 1e-8])
    validate_state(a, CFG, conditioning="estimate")  # no warning in the per-step mode
    a["sigma_q"][3] = np.diag([1.0, 1.0, 1e-15])
    with pytest.raises(StateError, match=r"^sigma_q\[agent=3\]: condition number \(at least\) 1e\+15"):
        validate_state(a, CFG, conditioning="estimate")
    with pytest.raises(ValueError, match="conditioning must be"):
        validate_state(a, CFG, conditioning="sometimes")


def test_random_population_drawn_in_blocks(monkeypatch):
    """Blocks of BLOCK agents, each from its own stream: the first block is the population of its size
    from the seed's stream, later blocks differ from it, and the population does not depend on the
    number of threads that drew it."""
    import vfesim.state as vs

    cfg = make_obs_config()
    monkeypatch.setattr(vs, "BLOCK", 16)
    one = vfesim.random_state(cfg, 16, seed=7)
    serial = vfesim.random_state(cfg, 40, seed=7, threads=1)
    threaded = vfesim.random_state(cfg, 40, seed=7, threads=3)
    for k in serial.data_vars:
        np.testing.assert_array_equal(serial[k].values, threaded[k].values)
        np.testing.assert_array_equal(serial[k].values[:16], one[k].values)
        assert not np.array_equal(serial[k].values[16:32], serial[k].values[:16])


def test_random_population_seed_and_threads_are_checked(monkeypatch):
    import vfesim.state as vs

    cfg = ModelConfig(K=3)
    monkeypatch.setattr(vs, "BLOCK", 8)
    ss = np.random.SeedSequence(11)
    a, b = random_state(cfg, 20, seed=ss), random_state(cfg, 20, seed=11)
    np.testing.assert_array_equal(a.mu_q.values, b.mu_q.values)  # a SeedSequence is its integer's
    for bad in (-1, 1.5, "7", True):
        with pytest.raises(StateError, match="seed"):
            random_state(cfg, 20, seed=bad)
    for bad in (0, -2, 1.0):
        with pytest.raises(StateError, match="threads"):
            random_state(cfg, 20, seed=1, threads=bad)


def test_large_population_checked_in_blocks_names_the_global_agent(monkeypatch):
    """Populations of several blocks are checked block by block in the drawing threads; a failure names
    the agent by its index in the whole population."""
    import vfesim.gaussian.state as gs
    import vfesim.state as vs

    monkeypatch.setattr(vs, "BLOCK", 8)
    real = gs._random_spd

    def spd(rng, n, K, eig_range):  # the last block (agents 16..19) draws one indefinite covariance
        S = real(rng, n, K, eig_range)
        if n == 4:
            S[1] = -S[1]
        return S

    monkeypatch.setattr(gs, "_random_spd", spd)
    with pytest.raises(StateError, match=r"sigma_[qp]\[agent=17\]"):
        random_state(ModelConfig(K=3), 20, seed=0, threads=2)
    monkeypatch.setattr(gs, "_random_spd", real)
    ok = random_state(ModelConfig(K=3), 20, seed=0, threads=2)
    validate_state(ok, ModelConfig(K=3))  # what was checked in blocks passes the whole check


@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_vectorised_positive_definiteness_agrees_with_lapack(K):
    from vfesim.state import batch_cholesky

    first_not_positive_definite = lambda S: batch_cholesky(S)[1]  # noqa: E731

    rng = np.random.default_rng(K)
    X = rng.standard_normal((200, K, K))
    S = X @ np.swapaxes(X, 1, 2) + 1e-3 * np.eye(K)
    assert first_not_positive_definite(S) is None
    for bad, lowest in ((37, -0.5), (5, -1e-3)):  # two indefinite matrices, the later one first
        w, V = np.linalg.eigh(S[bad])
        w[0] = lowest
        S[bad] = (V * w) @ V.T
        with pytest.raises(np.linalg.LinAlgError):
            np.linalg.cholesky(S[bad])
    assert first_not_positive_definite(S) == 5
    assert first_not_positive_definite(S.astype(np.float32)) == 5
