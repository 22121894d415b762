"""Regression against the golden trajectories in data/ (made by ``python -m data.make_golden``).

Tolerance: rtol 1e-9, atol 1e-12 on every saved state variable and energy term. The runs are
float64 on the numpy backend; the slack covers BLAS/LAPACK and NumPy-version rounding accumulated
over the 20-30 steps, while any change to the model, its gradients or an integrator shows up as a
difference many orders of magnitude larger.
"""

from pathlib import Path

import numpy as np
import pytest

from vfesim.io import open_run
from vfesim.scenario import Scenario
from vfesim.simulate import simulate

DATA = Path(__file__).resolve().parents[1] / "data"
RTOL, ATOL = 1e-9, 1e-12


@pytest.mark.parametrize("name", ["consensus", "inertia"])
def test_matches_golden_trajectory(name, tmp_path):
    with np.load(DATA / f"golden_{name}.npz", allow_pickle=False) as f:
        gold = {k: f[k] for k in f.files}
    scn = Scenario.from_json(str(gold.pop("scenario")))
    assert scn.run["dtype"] == "float64" and scn.run["backend"] == "numpy"
    run = simulate(scn, out=tmp_path / "g.zarr", progress=False)
    ds = open_run(run.path).load()
    np.testing.assert_array_equal(ds["step"].values, gold.pop("step"))
    assert set(gold) == {k for k in ds.data_vars if k != "saved" and "time" in ds[k].dims}
    for k, want in gold.items():
        np.testing.assert_allclose(ds[k].values, want, rtol=RTOL, atol=ATOL, err_msg=k)
    # The run actually moves: the golden data is not a constant trajectory.
    assert np.abs(gold["mu_q"][-1] - gold["mu_q"][0]).max() > 1e-2
