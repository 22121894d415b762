"""QuantumConfig: validation naming the key, JSON round trip, sparse neighbours as on the Gaussian side."""

import numpy as np
import pytest

import vfesim
from vfesim import ConfigError, QuantumConfig, SparseNeighbours


def test_defaults_and_top_level_export():
    cfg = vfesim.QuantumConfig(d=4)
    assert cfg is not None and vfesim.quantum.QuantumConfig is QuantumConfig
    assert (cfg.lambda_self, cfg.lambda_belief, cfg.lambda_prior, cfg.lambda_obs) == (1.0, 1.0, 0.0, 0.0)
    assert (cfg.kappa_beta, cfg.kappa_gamma, cfg.aggregator) == (1.0, 1.0, "softmin")
    assert cfg.neighbours == "dense" and cfg.dense and cfg.dtype is None
    with pytest.raises(AttributeError):
        cfg.d = 3  # frozen


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({}, "d"),
        ({"d": 1}, "d"),
        ({"d": 2.0}, "d"),
        ({"d": True}, "d"),
        ({"d": 3, "kappa_beta": 0.0}, "kappa_beta"),
        ({"d": 3, "kappa_gamma": -1.0}, "kappa_gamma"),
        ({"d": 3, "lambda_self": -0.1}, "lambda_self"),
        ({"d": 3, "lambda_belief": -1}, "lambda_belief"),
        ({"d": 3, "lambda_prior": float("nan")}, "lambda_prior"),
        ({"d": 3, "lambda_obs": "1"}, "lambda_obs"),
        ({"d": 3, "aggregator": "mean"}, "aggregator"),
        ({"d": 3, "neighbours": "ring"}, "neighbours"),
        ({"d": 3, "neighbours": {"idx": [[1], [0]]}}, "neighbours"),
        ({"d": 3, "dtype": "float64"}, "dtype"),
    ],
)
def test_bad_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as e:
        QuantumConfig(**kwargs)
    assert e.value.key == key and str(e.value).startswith(key)


def test_unknown_key():
    with pytest.raises(ConfigError, match="K"):
        QuantumConfig.from_dict({"d": 3, "K": 3})
    with pytest.raises(TypeError):
        QuantumConfig(d=3, K=3)


def test_dtype_accepts_numpy_types():
    assert QuantumConfig(d=2, dtype=np.complex64).dtype == "complex64"
    assert QuantumConfig(d=2, dtype="complex128").dtype == "complex128"


@pytest.mark.parametrize("sparse", [False, True])
def test_json_round_trip(sparse):
    nb = SparseNeighbours.ring(6, 2) if sparse else "dense"
    cfg = QuantumConfig(
        d=5,
        lambda_prior=0.5,
        lambda_obs=0.25,
        kappa_beta=0.3,
        aggregator="expected",
        neighbours=nb,
        dtype="complex64",
    )
    back = QuantumConfig.from_json(cfg.to_json())
    assert back == cfg and back.to_json() == cfg.to_json()
    assert isinstance(back.neighbours, SparseNeighbours) == sparse
    if sparse:
        np.testing.assert_array_equal(back.neighbours.index, nb.index)
    assert cfg != vfesim.ModelConfig(K=3) and cfg.replace(d=4).d == 4 and cfg.replace(d=4) != cfg
    with pytest.raises(ConfigError, match="d"):
        cfg.replace(d=1)
