"""Shared fixtures, the dtype tolerance table and small config/state builders.

``tests/`` is on ``sys.path`` under pytest's default import mode, so the oracle is imported as
``from reference.loop import reference_energy``.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import vfesim

# One tolerance table for every comparison against a reference (SPEC §4: backends match numpy to
# 1e-10 relative in float64 and 1e-4 in float32). Use as ``np.testing.assert_allclose(a, b, **TOL[dt])``.
TOL = {
    "float64": {"rtol": 1e-10, "atol": 1e-12},
    "float32": {"rtol": 1e-4, "atol": 1e-5},
}

# Central finite differences of float64 energies (SPEC §2.3): relative error per term and variable.
FD_RTOL = 1e-6
FD_STEP = 1e-6

DTYPES = ("float64", "float32")

# The CUDA kernels are tested without a GPU through numba-cuda (the `cudasim` extra): the simulator suite
# (tests/test_cudasim_suite.py) and PTX compilation (tests/test_cuda_ptx.py). Without numba-cuda those
# tests skip, naming the extra; CI and tox set VFESIM_REQUIRE_CUDASIM=1, which makes them fail instead.
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
NO_NUMBA_CUDA = (
    "numba-cuda is not installed: install the 'cudasim' extra (pip install -e \".[test,cudasim]\") to test "
    "the CUDA kernels without a GPU"
)


def needs_numba_cuda(module: bool = False) -> None:
    """Skip the calling test (``module``: its whole module) where numba-cuda is missing; fail instead when
    ``VFESIM_REQUIRE_CUDASIM=1`` (CI), so that a missing extra never passes unnoticed."""
    if HAVE_NUMBA_CUDA:
        return
    if os.environ.get("VFESIM_REQUIRE_CUDASIM") == "1":
        pytest.fail(f"{NO_NUMBA_CUDA} (VFESIM_REQUIRE_CUDASIM=1 requires it)", pytrace=False)
    pytest.skip(NO_NUMBA_CUDA, allow_module_level=module)


def tol(dtype) -> dict:
    """The TOL entry for a dtype given as a string or numpy dtype."""
    return TOL[np.dtype(dtype).name]


def make_config(K: int = 3, **kw) -> vfesim.ModelConfig:
    """A small valid ModelConfig; keyword arguments override the defaults."""
    return vfesim.ModelConfig(K=K, **kw)


def make_obs_config(K: int = 3, obs_dim: int = 2, seed: int = 0, **kw) -> vfesim.ModelConfig:
    """A config with a random observation model W (obs_dim, K), R SPD (obs_dim, obs_dim)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((obs_dim, K))
    A = rng.standard_normal((obs_dim, obs_dim))
    R = A @ A.T + obs_dim * np.eye(obs_dim)
    kw.setdefault("lambda_obs", 1.0)
    return vfesim.ModelConfig(K=K, W=W, R=R, **kw)


def random_sym(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random symmetric matrices (..., K, K): a direction for covariance finite differences."""
    A = rng.standard_normal(shape)
    return 0.5 * (A + np.swapaxes(A, -1, -2))


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh, seeded generator per test."""
    return np.random.default_rng(20240611)


@pytest.fixture(params=DTYPES)
def dtype(request) -> str:
    """Each supported float dtype."""
    return request.param


@pytest.fixture
def small_config() -> vfesim.ModelConfig:
    """K = 3, all four terms switched on, dense neighbours."""
    return make_obs_config(K=3, obs_dim=2, lambda_prior=0.5, lambda_obs=0.7)


@pytest.fixture
def small_state(small_config):
    """Six random agents for ``small_config``, float64."""
    return vfesim.random_state(small_config, n_agents=6, seed=1)


def pytest_collection_modifyitems(config, items):
    """The simulator subprocesses (tests/test_cudasim_suite.py, the longest tests) first, so that
    pytest-xdist's workers do not meet them last."""
    items.sort(
        key=lambda item: not item.nodeid.startswith("tests/test_cudasim_suite.py::test_cuda_simulator")
    )
