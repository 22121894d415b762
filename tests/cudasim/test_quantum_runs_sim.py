"""Density-matrix runs on the cuda backend under the Numba CUDA simulator (issue 13 "GPU and speed"): the
state stays on the device between steps (the channel step kernel, the per-agent energy kernels, the pair
kernels), Born outcomes are drawn from the host copy of the diagonals; the frames equal the numpy run's to
1e-12 with the same outcomes, a resumed run is bitwise the uninterrupted one, and the CLI takes
``--backend cuda``."""

import numpy as np
import pytest

import vfesim
from vfesim.cli import main
from vfesim.io import open_run
from vfesim.scenario import ScenarioError
from vfesim.simulate import resume, simulate

pytestmark = pytest.mark.cudasim

CHANNELS = {
    "quantum": {"d": 2, "lambda_obs": 0.5, "kappa_beta": 0.7, "lambda_prior": 0.3},
    "population": {"n_agents": 5, "seed": 3, "neighbours": "ring", "half_width": 1},
    "integrator": {
        "method": "channels", "dt": 0.1, "coupling_strength": 0.2,
        "dephasing_rate": [0.1, 0.2, 0.3, 0.4, 0.5], "thermal_rate": 0.1, "gate": "soft", "gate_width": 0.5,
        "observe": "born", "mirror_steps": 1,
    },
    "run": {"n_steps": 4, "save_every": 1, "checkpoint_every": 2, "seed": 7},
}  # fmt: skip
MIRROR = {
    "quantum": {"d": 3, "lambda_belief": 0.8, "lambda_prior": 0.2},
    "population": {"n_agents": 4, "seed": 1},
    "integrator": {"method": "mirror_descent", "dt": 0.1},
    "run": {"n_steps": 3, "save_every": 1, "checkpoint_every": 3},
}
CASES = {"channels_ring": CHANNELS, "mirror_descent_dense": MIRROR}


def _run(tmp_path, scn, backend, name, **kw):
    return simulate(scn, out=tmp_path / f"{name}.zarr", backend=backend, progress=False, **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_run_equals_numpy_run(tmp_path, case):
    scn = CASES[case]
    ref = _run(tmp_path, scn, "numpy", "numpy")
    got = _run(tmp_path, scn, "cuda", "cuda")
    a, b = got.open().load(), ref.open().load()
    assert a.attrs["backend"] == "cuda" and a.attrs["integrator"] == scn["integrator"]["method"]
    assert isinstance(got.state["rho"].data, np.ndarray)  # Run.state is on the host
    assert set(a.data_vars) == set(b.data_vars)
    for k in b.data_vars:
        if k == "outcome":  # the same draws from the same RNG
            np.testing.assert_array_equal(a[k].values, b[k].values)
            assert len(np.unique(a[k].values)) == 2
        else:
            np.testing.assert_allclose(a[k].values, b[k].values, rtol=1e-12, atol=1e-12, err_msg=k)
    for k, v in ref.terms.items():
        assert got.terms[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_cuda_run_resumes_bitwise(tmp_path):
    full = _run(tmp_path, CHANNELS, "cuda", "full")
    _run(tmp_path, CHANNELS, "cuda", "part", steps=2)
    back = resume(tmp_path / "part.zarr", steps=4, progress=False)
    a, c = full.open().load(), back.open().load()
    for k in a.data_vars:
        np.testing.assert_array_equal(c[k].values, a[k].values, err_msg=k)
    assert back.terms == full.terms


def test_cli_runs_on_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert (
        main(["run", "quantum_consensus", "--out", "d.zarr", "--steps", "2", "--backend", "cuda", "-q"]) == 0
    )
    ds = open_run(tmp_path / "d.zarr")
    assert ds.attrs["backend"] == "cuda" and ds.attrs["status"] == "complete" and ds.sizes["time"] >= 2
    ref = simulate(
        _scenario("quantum_consensus"), out=tmp_path / "n.zarr", steps=2, backend="numpy", progress=False
    )
    np.testing.assert_allclose(ds["rho"].values[-1], ref.state["rho"].values, rtol=0, atol=1e-12)


def _scenario(name):
    from vfesim.scenario import load_scenario

    return load_scenario(name)


def test_fit_refuses_cuda(tmp_path):
    s = _scenario("decoherence").to_dict()
    s["integrator"] = {"method": "fit", "dt": 0.1, "horizon": 2, "coupling": "none"}
    s["population"] = {"n_agents": 2, "hamiltonian": "shared"}
    s["quantum"] = {"d": 2, "lambda_belief": 0.0}
    with pytest.raises(ScenarioError, match="method 'fit' runs on 'numpy' or 'numba', got 'cuda'"):
        simulate(s, out=tmp_path / "f.zarr", steps=1, backend="cuda", progress=False)


def test_kernel_constants_go_to_the_device_once():
    """The channel step and its adjoint reuse the coupling window, the rates' strengths and the mode codes
    made once per prepared cache (no copy per step), with results unchanged."""
    from vfesim.backends.cuda_backend import QUANTUM_OPS
    from vfesim.quantum.channels import causal_window
    from vfesim.quantum.evolve import QuantumDynamics, prepare, window

    cfg = vfesim.QuantumConfig(d=2)
    st = vfesim.random_state(cfg, 4, seed=2)
    dyn = QuantumDynamics(coupling_strength=0.3, neighbours=causal_window(4, 2), dephasing_rate=0.2)
    arrays = {k: st[k].values for k in st.data_vars}
    P = prepare(arrays, cfg, dyn)
    first = QUANTUM_OPS.channel_step(P, arrays["rho"], 0.1, dyn)
    made = dict(P.consts)
    index = window(P, np)[0]
    again = QUANTUM_OPS.channel_step(P, arrays["rho"], 0.1, dyn)
    np.testing.assert_array_equal(again, first)
    assert P.consts.keys() == made.keys() and all(P.consts[k][2] is v[2] for k, v in made.items())
    assert window(P, np)[0] is index and index.flags.writeable
    QUANTUM_OPS.step_vjp(2)(P, arrays["rho"], np.ones_like(first), 0.1, dyn)
    n = len(P.consts)
    QUANTUM_OPS.step_vjp(2)(P, arrays["rho"], np.ones_like(first), 0.1, dyn)
    assert len(P.consts) == n and any(k[0] == "prm" for k in P.consts)
    # A schedule of varying dt keeps one array per constant, made again for each new dt.
    for dt in (0.05, 0.07, 0.09):
        QUANTUM_OPS.channel_step(P, arrays["rho"], dt, dyn)
        QUANTUM_OPS.step_vjp(2)(P, arrays["rho"], np.ones_like(first), dt, dyn)
    assert len(P.consts) == n
    np.testing.assert_array_equal(QUANTUM_OPS.channel_step(P, arrays["rho"], 0.1, dyn), first)


@pytest.mark.parametrize("method", ["channels", "mirror_descent"])
def test_run_dynamics_on_cuda_matches_numpy(method):
    """vfesim.run_dynamics of density-matrix agents on cuda (the runs' device stepper): the final state
    (returned on the host, as given) and the history equal the numpy run's; mirror eta is not reported."""
    nb = vfesim.SparseNeighbours.ring(5, 1)
    cfg = vfesim.QuantumConfig(d=2, lambda_self=0.3, lambda_belief=1.0, lambda_prior=0.2, neighbours=nb)
    state = vfesim.random_state(cfg, 5, seed=2)
    kw = {"method": method, "dt": 0.1, "n_steps": 3, "record_every": 2}
    if method == "channels":
        kw.update(coupling="C1", coupling_strength=0.3, dephasing_rate=0.2, mirror_steps=1)
    ref, h_ref = vfesim.run_dynamics(state, cfg, backend="numpy", **kw)
    out, h = vfesim.run_dynamics(state, cfg, backend="cuda", **kw)
    assert isinstance(out["rho"].data, np.ndarray)
    np.testing.assert_allclose(out["rho"].values, ref["rho"].values, rtol=0, atol=1e-12)
    assert h["step"].values.tolist() == h_ref["step"].values.tolist() == [0, 2, 3]
    for k in h_ref.data_vars:
        if k == "system_mirror_eta":
            assert np.isnan(h[k].values).all()
            continue
        np.testing.assert_allclose(h[k].values, h_ref[k].values, rtol=1e-11, atol=1e-12, err_msg=k)
