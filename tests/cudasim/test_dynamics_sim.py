"""Integrators and runs with backend "cuda" under the Numba CUDA simulator (NumPy host arrays, tiny N).

run_dynamics matches the numpy backend (SPEC §4: 1e-10 relative in float64, 1e-4 in float32) for every
gradient-flow rule and the constant-mass schemes; the device guard names step, agent and variable; a
simulate() run matches the numpy backend's trajectory and resumes bitwise.
"""

import numpy as np
import pytest
from conftest import TOL

import vfesim
from vfesim.integrators import DynamicsError, make_integrator
from vfesim.simulate import resume, simulate

pytestmark = pytest.mark.cudasim

CFG = vfesim.ModelConfig(K=3, lambda_prior=0.6, kappa_beta=0.7, kappa_gamma=1.3)


def _run_both(method, n_steps, dtype="float64", n=6, **opts):
    st = vfesim.random_state(CFG, n_agents=n, seed=1, dtype=dtype)
    return {
        b: vfesim.run_dynamics(st, CFG, method, 0.02, n_steps, backend=b, seed=3, **opts)
        for b in ("numpy", "cuda")
    }


def _assert_close(got, want, dtype):
    rtol = TOL[dtype]["rtol"]
    for k in want.data_vars:
        assert got[k].dtype == want[k].dtype, k
        a, b = got[k].values, want[k].values
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()), err_msg=k)


@pytest.mark.parametrize(
    "method, n_steps, opts",
    [
        ("gradient_flow", 3, {}),
        ("gradient_flow", 2, {"rule": "euclidean", "step_scale": {"mu_p": 0.0}}),
        ("gradient_flow", 2, {"rule": "adam"}),
        ("verlet", 2, {"friction": 0.5}),
        ("symplectic_euler", 2, {"update_frames": False}),
        ("ruth3", 1, {}),
        ("pefrl", 1, {"update_priors": True}),
    ],
    ids=["natural", "euclidean", "adam", "verlet", "euler-noframes", "ruth3", "pefrl-priors"],
)
def test_run_dynamics_matches_numpy(method, n_steps, opts):
    runs = _run_both(method, n_steps, **opts)
    (s_n, h_n), (s_c, h_c) = runs["numpy"], runs["cuda"]
    assert isinstance(s_c["mu_q"].data, np.ndarray)  # host in, host out
    _assert_close(s_c, s_n, "float64")
    assert list(h_c.data_vars) == list(h_n.data_vars)
    for k in h_n.data_vars:
        np.testing.assert_allclose(h_c[k].values, h_n[k].values, rtol=1e-10, err_msg=k)
    # The run moved: a kernel that copied its inputs would pass the comparison above only by accident.
    st0 = vfesim.random_state(CFG, n_agents=6, seed=1)
    assert not np.allclose(s_c["mu_q"].values, st0["mu_q"].values, rtol=0, atol=1e-9)


def test_run_dynamics_float32():
    runs = _run_both("gradient_flow", 2, dtype="float32")
    _assert_close(runs["cuda"][0], runs["numpy"][0], "float32")
    runs = _run_both("verlet", 1, dtype="float32")
    _assert_close(runs["cuda"][0], runs["numpy"][0], "float32")


def test_riemannian_leapfrog_refuses_cuda():
    with pytest.raises(ValueError, match="riemannian_leapfrog.*not 'cuda'"):
        make_integrator("riemannian_leapfrog", CFG, 0.01, backend="cuda")


# The simulated energy kernels evaluate the NaN state with NumPy scalars in their own threads, outside
# the step's np.errstate, so NumPy warns there; a GPU does not.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("method, bad_call", [("gradient_flow", 2), ("verlet", 3)])
def test_guard_names_step_agent_and_variable(method, bad_call):
    """A NaN force on agent 2 that the second step uses: the kernels' flag (gradient flow) or the
    kinetic energy (verlet: the last kick) stops the run there, naming the agent."""
    from vfesim.backends import cuda_backend as cb

    st = vfesim.random_state(CFG, n_agents=5, seed=2)
    calls = []

    def poisoned(arrays):
        terms, grads = cb.energy_and_gradient(arrays, CFG)
        calls.append(1)
        if len(calls) == bad_call:
            grads = dict(grads)
            g = grads["mu_q"].copy()
            g[2, 1] = np.nan
            grads["mu_q"] = g
        return terms, grads

    integ = make_integrator(method, CFG, 0.01, backend="cuda", energy=poisoned)
    c = integ.step(integ.init(st))
    with pytest.raises(DynamicsError, match=r"step 2: (mu_q|p_mu_q)\[agent=2\]") as e:
        integ.step(c)
    assert e.value.step == 2 and e.value.agent == 2
    # The device flag was lowered: the same integrator steps a good state normally again.
    c = integ.step(integ.init(st))
    assert c.step == 1 and np.isfinite(c.terms["total"])


SCN = {
    "model": {"K": 3, "lambda_belief": 1.0, "kappa_beta": 2.0, "lambda_self": 0.1},
    "population": {"n_agents": 5, "seed": 1},
    "integrator": {"method": "verlet", "dt": 0.02},
    "run": {"n_steps": 4, "save_every": 1, "checkpoint_every": 2},
}


def test_simulate_cuda_matches_numpy_and_resumes_bitwise(tmp_path):
    full = simulate(SCN, out=tmp_path / "full.zarr", backend="cuda", progress=False)
    ref = simulate(SCN, out=tmp_path / "ref.zarr", backend="numpy", progress=False)
    a, b = full.open(), ref.open()
    assert a.attrs["backend"] == "cuda"
    for k in ("mu_q", "sigma_q", "phi", "energy_total", "energy_kinetic"):
        np.testing.assert_allclose(a[k].values, b[k].values, rtol=1e-10, atol=1e-12, err_msg=k)
    assert isinstance(full.state["mu_q"].data, np.ndarray)
    # Stop at step 2 (a checkpoint), resume to 4: bitwise the uninterrupted run.
    simulate(SCN, out=tmp_path / "part.zarr", backend="cuda", steps=2, progress=False)
    res = resume(tmp_path / "part.zarr", steps=4, progress=False)
    c = res.open()
    for k in a.data_vars:
        np.testing.assert_array_equal(c[k].values, a[k].values, err_msg=k)
    assert res.terms == full.terms
