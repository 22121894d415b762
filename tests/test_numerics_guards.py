"""Numerical guards (issue 9, item 6): the closed-form frame wrap, runs that used to hang, non-finite
energy outputs, LinAlgError named by step and agent, and the condition-number limits per dtype.

Runs that used to hang go through one subprocess with a timeout: a regression fails instead of
blocking CI (under numba a hung kernel ignores Ctrl-C and pytest's own timeouts).
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import TOL
from vfesim_kernels.update_math import PHI_MAX

import vfesim
from vfesim.backends import check_outputs, get
from vfesim.gaussian.geometry import wrap_phi
from vfesim.integrators import DynamicsError
from vfesim.integrators.base import guard_state
from vfesim.state import COND_WARN, NonFiniteError, StateError, linalg_named

ROOT = Path(__file__).resolve().parents[1]
CFG = vfesim.ModelConfig(K=3, lambda_prior=0.5)


def _arrays(n=8, seed=0, dtype="float64", cfg=CFG):
    st = vfesim.random_state(cfg, n_agents=n, seed=seed, dtype=dtype)
    return {k: st[k].values.copy() for k in st.data_vars}


def _state(a, cfg=CFG, validate=True):
    keys = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")
    return vfesim.make_state(cfg, *(a[k] for k in keys), validate=validate)


def _with_condition(K, cond, seed=0, dtype="float64"):
    Q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((K, K)))
    S = (Q * np.logspace(0, -np.log10(cond), K)) @ Q.T
    return (0.5 * (S + S.T)).astype(dtype)


# --- wrap_phi ----------------------------------------------------------------------------------------
def _old_wrap(p):
    """The loop the closed form replaced (one agent), for |phi| <= 3 pi where it ends after one pass."""
    t = math.sqrt(p[0] * p[0] + p[1] * p[1] + p[2] * p[2])
    f = 1.0
    while t > math.pi:
        tn = t - 2.0 * math.pi
        f *= tn / t
        t = abs(tn)
    return p * f


def _phis(rng, n, lo, hi):
    d = rng.standard_normal((n, 3))
    return d * (np.exp(rng.uniform(np.log(lo), np.log(hi), n)) / np.linalg.norm(d, axis=1))[:, None]


def test_wrap_phi_closed_form_matches_the_loop_and_the_kernel(rng):
    from vfesim_kernels.update_cpu import _wrap_phi

    inside, near, far = (
        _phis(rng, 200, 1e-3, np.pi),
        _phis(rng, 200, np.pi, 3 * np.pi),
        _phis(rng, 200, 10, 1e13),
    )
    np.testing.assert_array_equal(wrap_phi(inside), inside)  # bitwise: inside the ball nothing changes
    out = np.empty(3)
    for p in np.concatenate([inside, near]):
        _wrap_phi(p, out)
        np.testing.assert_array_equal(out, _old_wrap(p))  # the old results, to the last bit
    w = wrap_phi(far)
    assert np.all(np.linalg.norm(w, axis=1) <= np.pi * (1 + 1e-15))
    for p, q in zip(far, w, strict=True):
        _wrap_phi(p, out)
        np.testing.assert_array_equal(out, q)  # NumPy twin == numba kernel, exactly (an exact fmod)
    # Same rotation: w is parallel to phi and differs from it by a multiple of 2 pi in length.
    t, tw = np.linalg.norm(far, axis=1), np.einsum("na,na->n", w, far) / np.linalg.norm(far, axis=1)
    k = (t - tw) / (2 * np.pi)
    np.testing.assert_allclose(k, np.round(k), atol=1e-15 * t.max())


def test_wrap_phi_unwrappable_frames_become_nan():
    from vfesim_kernels.update_cpu import _wrap_phi

    phi = np.array([[2 * PHI_MAX, 0, 0], [np.inf, 0, 0], [1e200, 1e200, 0], [np.nan, 0, 0], [PHI_MAX, 0, 0]])
    w = wrap_phi(phi)
    assert np.isnan(w[:4]).any(axis=1).all() and np.isfinite(w[4]).all()
    out = np.empty(3)
    for p, q in zip(phi, w, strict=True):
        _wrap_phi(p, out)
        np.testing.assert_array_equal(out, q)


# --- runs that used to hang ----------------------------------------------------------------------------
HANG_SCRIPT = """
import warnings, numpy as np, vfesim
from vfesim.integrators import DynamicsError
cfg = vfesim.ModelConfig(K=3, lambda_prior=0.5)
st = vfesim.random_state(cfg, n_agents=6, seed=0)

def report(tag, fn):
    try:
        fn()
        print(tag, "finished")
    except (DynamicsError, vfesim.StateError) as e:
        print(tag, type(e).__name__, e)

for b in ("numpy", "numba"):
    report("dt1e12-" + b, lambda: vfesim.run_dynamics(st, cfg, "gradient_flow", 1e12, 3, backend=b))
    report("adam-" + b, lambda: vfesim.run_dynamics(
        st, cfg, "gradient_flow", 1e300, 3, backend=b, rule="adam"))
    frames = {"step_scale": {"mu_q": 0.0, "sigma_q": 0.0, "mu_p": 0.0, "sigma_p": 0.0}}
    for dt in (1e12, 1e300):  # only the frames move: straight into wrap_phi
        report(f"frames{dt:.0e}-" + b, lambda: vfesim.run_dynamics(
            st, cfg, "gradient_flow", dt, 2, backend=b, **frames))
a = {k: st[k].values.copy() for k in st.data_vars}
a["sigma_q"][:] = 1e200 * np.eye(3)
report("sigma1e200", lambda: vfesim.run_dynamics(
    vfesim.make_state(cfg, *(a[k] for k in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")), validate=False),
    cfg, "gradient_flow", 0.01, 3))
a = {k: st[k].values.copy() for k in st.data_vars}
Q, _ = np.linalg.qr(np.random.default_rng(1).standard_normal((3, 3)))
a["sigma_q"][3] = Q @ np.diag([1.0, 1e-7, 1e-15]) @ Q.T
a["sigma_q"][3] = 0.5 * (a["sigma_q"][3] + a["sigma_q"][3].T)
report("cond1e15", lambda: vfesim.run_dynamics(
    vfesim.make_state(cfg, *(a[k] for k in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")), validate=False),
    cfg, "gradient_flow", 0.01, 3, backend="numba"))
scn = {
    "model": {"K": 3, "lambda_prior": 0.5},
    "population": {"n_agents": 6},
    "integrator": {"method": "gradient_flow", "dt": 1e300},
    "run": {"n_steps": 3, "save_every": 1, "checkpoint_every": 3},
}
report("scenario-dt1e300", lambda: vfesim.simulate(scn, out=OUT, progress=False))
"""


def test_runs_that_used_to_hang_stop_with_named_errors(tmp_path):
    script = f"OUT = {str(tmp_path / 'run.zarr')!r}\n" + textwrap.dedent(HANG_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    for b in ("numpy", "numba"):
        assert lines[f"dt1e12-{b}"].startswith("DynamicsError step 1: "), lines
        assert lines[f"adam-{b}"].startswith("DynamicsError step 1: "), lines
        assert lines[f"frames1e+12-{b}"] == "finished", lines  # a huge step, wrapped: valid frames
        assert lines[f"frames1e+300-{b}"].startswith("DynamicsError step 1: phi[agent="), lines
    assert lines["sigma1e200"].startswith("StateError sigma_q[agent=0]: has |entry| 1e+200"), lines
    assert lines["cond1e15"].startswith("StateError sigma_q[agent=3]: condition number"), lines
    assert lines["scenario-dt1e300"].startswith("DynamicsError step 1: "), lines


# --- non-finite energy outputs -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_absurd_inputs_are_refused_up_front(backend):
    for name, idx, msg in (("mu_q", (5, 1), "its square overflows"), ("phi", (2, 0), "its square overflows")):
        a = _arrays()
        a[name][idx] = 1e200
        with pytest.raises(StateError, match=rf"^{name}\[agent={idx[0]}\]: .*{msg}"):
            vfesim.energy_and_gradient(_state(a, validate=False), CFG, backend=backend)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_overflow_in_the_energy_raises_naming_the_variable(backend):
    """Entries below the square-overflow limit whose energy still overflows; and 1e200 unvalidated."""
    for value, validate in ((1e154, True), (1e200, False)):
        a = _arrays()
        a["mu_q"][5, :] = value
        with pytest.raises(NonFiniteError, match=r"^mu_q\[agent=\d\]: the gradient is NaN or Inf .*overflow"):
            vfesim.energy_and_gradient(_state(a, validate=False), CFG, backend=backend, validate=validate)


def test_check_outputs_names_the_gradient_agent_or_the_term():
    g = {k: np.zeros((4, 3)) for k in ("mu_q", "phi")}
    check_outputs({"self": 1.0, "total": 1.0}, g)
    with pytest.raises(
        NonFiniteError, match=r"^terms\['self'\]: the energy term is inf \(gradients finite\)"
    ):
        check_outputs({"self": math.inf, "total": math.inf}, g)
    g["phi"][3, 1] = math.nan
    with pytest.raises(NonFiniteError, match=r"^phi\[agent=3\]: the gradient is NaN or Inf \(1 agent") as e:
        check_outputs({"self": 1.0, "total": 1.0}, g)
    assert e.value.agent == 3 and e.value.variable == "phi"


# --- LinAlgError named by step, variable and agent --------------------------------------------------------
def test_linalg_error_in_the_numpy_retraction_names_step_and_agent():
    """A force that is NaN at one agent used to end in numpy's bare LinAlgError (eigh did not converge)."""
    st = vfesim.random_state(CFG, n_agents=4, seed=0)
    model = vfesim.family_of(CFG).energy_and_gradient

    def energy(arrays):
        terms, grads = model(arrays, CFG, get("numpy"))
        grads = dict(grads, sigma_q=grads["sigma_q"].copy())
        grads["sigma_q"][2, 0, 0] = np.nan
        return terms, grads

    with pytest.raises(DynamicsError, match=r"^step 1: sigma_q\[agent=2\]: the exponential-map .*force") as e:
        vfesim.run_dynamics(st, CFG, "gradient_flow", 0.01, 2, energy=energy)
    assert e.value.step == 1 and e.value.agent == 2


def test_linalg_named_finds_the_failing_agent():
    S = np.stack([np.eye(3), np.eye(3), np.ones((3, 3))])
    with pytest.raises(StateError, match=r"^S\[agent=2\]: the inverse failed: Singular matrix"):
        linalg_named("S", "the inverse", np.linalg.inv, S)
    assert linalg_named("S", "the inverse", np.linalg.inv, S[:2]).shape == (2, 3, 3)


# --- condition numbers --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_backends_agree_up_to_the_warning_threshold(dtype):
    """Just below COND_WARN (the largest condition number accepted without a warning) numba matches numpy
    to the tolerance of SPEC §4, which is what the threshold promises (measured: ~0.25 eps cond)."""
    a = _arrays(n=10, seed=1, dtype=dtype)
    cond = 0.9 * COND_WARN[dtype]
    a["sigma_q"][3] = _with_condition(3, cond, seed=2, dtype=dtype)
    a["sigma_p"][6] = _with_condition(3, cond, seed=3, dtype=dtype)
    st = _state(a)  # no warning at the threshold
    t_n, g_n = vfesim.energy_and_gradient(st, CFG, backend="numpy")
    t_b, g_b = vfesim.energy_and_gradient(st, CFG, backend="numba")
    rtol = TOL[dtype]["rtol"]
    for k in t_n:
        assert abs(t_b[k] - t_n[k]) <= rtol * abs(t_n["total"]), k
    for k in g_n.data_vars:
        scale = float(np.abs(g_n[k].values).max())
        np.testing.assert_allclose(g_b[k].values, g_n[k].values, rtol=rtol, atol=rtol * scale, err_msg=k)


def test_ill_conditioned_state_warns_at_run_start_and_the_guard_refuses_later():
    a = _arrays()
    a["sigma_q"][3] = _with_condition(3, 1e9, seed=4)
    with pytest.warns(vfesim.ConditioningWarning, match=r"sigma_q\[agent=3\]: condition number 1e\+09"):
        vfesim.run_dynamics(_state(a, validate=False), CFG, "gradient_flow", 1e-4, 1)
    a["sigma_q"][5] = np.diag([1.0, 1.0, 1e-15])
    with pytest.raises(DynamicsError, match=r"^step 7: sigma_q\[agent=5\]: condition number \(at least\)"):
        guard_state(7, a, CFG)
