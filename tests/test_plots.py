"""Figures: frame angles reduced to one rotation, attention entropy (the PNGs themselves: test_cli)."""

import numpy as np
import pytest
import xarray as xr
from scipy.linalg import expm

from vfesim.groups import generators
from vfesim.plots import attention_entropy, plot_frames, rotation_angle


def test_rotation_angle_is_the_same_rotation_in_0_pi():
    rng = np.random.default_rng(0)
    n = rng.standard_normal((6, 3))
    n /= np.linalg.norm(n, axis=1, keepdims=True)
    t = np.array([0.5, np.pi - 0.1, np.pi + 0.3, 2 * np.pi + 0.2, 15.3, 1e6])
    phi = t[:, None] * n
    theta = rotation_angle(phi)
    k = round(1e6 / (2 * np.pi))
    want = np.array([0.5, np.pi - 0.1, np.pi - 0.3, 0.2, 15.3 - 4 * np.pi, abs(1e6 - 2 * np.pi * k)])
    np.testing.assert_allclose(theta, want, rtol=1e-12, atol=1e-9)
    assert ((theta >= 0) & (theta <= np.pi)).all()
    G = generators([2])  # K = 5: the reduction holds in every irrep, not only the 3-d one
    for ti, ni, th in zip(t[:5], n[:5], theta[:5], strict=True):
        R = expm(np.einsum("a,akl->kl", ti * ni, G))
        # the same rotation about n or -n
        Rp = expm(np.einsum("a,akl->kl", th * ni, G))
        Rm = expm(np.einsum("a,akl->kl", -th * ni, G))
        assert min(np.abs(R - Rp).max(), np.abs(R - Rm).max()) < 1e-12


def test_frames_plot_keeps_agents_beyond_pi(tmp_path):
    # An inertia-like run: Hamiltonian frames end with |phi| up to 15.
    rng = np.random.default_rng(1)
    start = 0.5 * rng.standard_normal((64, 3))
    end = start * np.linspace(1, 30, 64)[:, None]
    assert (np.linalg.norm(end, axis=1) > np.pi).sum() > 20
    ds = xr.Dataset(
        {"phi": (("time", "agent", "gauge"), np.stack([start, end]))}, coords={"time": [0.0, 30.0]}
    )
    angles = rotation_angle(end)
    counts, _ = np.histogram(angles, bins=np.linspace(0, np.pi, 37))
    assert counts.sum() == 64  # every agent lands in a bin of [0, pi]
    assert plot_frames(ds, tmp_path / "frames.png").stat().st_size > 10_000


def test_attention_entropy_normalised():
    n = 5
    uniform = (1 - np.eye(n)) / (n - 1)
    np.testing.assert_allclose(attention_entropy(uniform, np.full(n, n - 1)), 1.0)
    one_hot = np.roll(np.eye(n), 1, axis=1)
    np.testing.assert_allclose(attention_entropy(one_hot, np.full(n, n - 1)), 0.0, atol=0)
    sparse = np.array([[1.0, 0.0], [0.5, 0.5]])  # (N, k): agent 0 has one neighbour
    H = attention_entropy(sparse, np.array([1, 2]))
    assert np.isnan(H[0]) and H[1] == pytest.approx(1.0)


@pytest.mark.parametrize("family", ["gaussian", "quantum", "field"])
def test_runs_with_ring_neighbours_plot(tmp_path, family):
    """Run stores record sparse lists by their shape only; plotting rebuilds the config from the run's
    scenario, for every family."""
    import json

    from vfesim.plots import plot_run, run_config
    from vfesim.simulate import simulate

    pop = {"n_agents": 6, "seed": 1, "neighbours": "ring", "half_width": 1}
    model = {
        "gaussian": ("model", {"K": 3}),
        "quantum": ("quantum", {"d": 2}),
        "field": ("field", {"K": 3, "grid": [4, 4], "lambda_prior": 0.5}),
    }[family]
    integ = {"method": "mirror_descent" if family == "quantum" else "gradient_flow", "dt": 0.05}
    sc = {model[0]: model[1], "population": pop, "integrator": integ, "run": {"n_steps": 2}}
    run = simulate(sc, out=tmp_path / "r.zarr", progress=False)
    ds = run.open()
    assert "sparse" in json.loads(ds.attrs["model_config"])["neighbours"]
    cfg = run_config(ds)
    assert cfg.neighbours.index.shape == (6, 2)
    paths = plot_run(tmp_path / "r.zarr", tmp_path / "plots")
    assert paths and all(p.exists() for p in paths)
