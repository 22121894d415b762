"""Rollouts and their exact adjoints (spec/quantum.md §4): whole-rollout central finite differences of the
naive oracle (tests/reference/quantum_dynamics.py, never the code under test) against the hand-written
gradient, for every variable (§4.3: traceless Hermitian directions for rho, Hermitian for H, random
directions for the rest, h = 1e-6, relative error <= 1e-7 of max(|analytic|, ||gradient||)); forward
agreement with the oracle; checkpointing does not change the result."""

import numpy as np
import pytest
from reference.quantum import oracle_config
from reference.quantum_dynamics import rollout_loss

import vfesim
from vfesim.config import ConfigError
from vfesim.quantum.channels import causal_window
from vfesim.quantum.energy import energy_and_gradient_arrays
from vfesim.quantum.evolve import QuantumDynamics, evolve
from vfesim.quantum.rollout import Schedule, binomial, repetitions, rollout

H_STEP = 1e-6
TOL = 1e-7

CASES = {
    "C1-jacobi-dense-born+F": dict(
        n=3,
        d=3,
        T=4,
        loss={"born": 1.0, "free_energy": 0.3},
        cfg=dict(lambda_belief=0.5, lambda_prior=0.3),
        dyn=dict(coupling_strength=0.4, coupling_length=1.3),
    ),
    "C1-gauss-seidel-causal-positions": dict(
        n=4,
        d=2,
        T=5,
        loss="born",
        cfg=dict(),
        dyn=dict(coupling_strength=0.6, coupling_length=0.8, order="gauss_seidel", positions="random"),
        window=2,
    ),
    "energy-dephasing-soft-gate-F": dict(
        n=3,
        d=4,
        T=3,
        loss={"free_energy": 1.0, "born": 0.5},
        cfg=dict(lambda_belief=0.7),
        dyn=dict(
            coupling_strength=0.3, dephasing_basis="energy", gate="soft", gate_threshold=0.2, gate_width=0.5
        ),
        dts=[0.3, 0.1, 0.25],
    ),
}


def _build(case, seed=0):
    rng = np.random.default_rng(seed)
    n, d, T = case["n"], case["d"], case["T"]
    cfg = vfesim.QuantumConfig(d=d, **case["cfg"])
    st = vfesim.random_state(cfg, n, seed=seed + 1)
    dyn_kw = dict(case["dyn"])
    if dyn_kw.get("positions") == "random":
        dyn_kw["positions"] = rng.normal(size=(n, 2))
    if "window" in case:
        dyn_kw["neighbours"] = causal_window(n, case["window"])
    dyn = QuantumDynamics(
        dephasing_rate=rng.uniform(0.1, 0.9, n), thermal_rate=rng.uniform(0.05, 0.4, n), **dyn_kw
    )
    dts = case.get("dts", 0.3)
    sched = Schedule(dyn, dts, T, rng.integers(-1, d, size=(T, n)))
    return rng, cfg, st, dyn, sched


def _oracle(cfg, st, dyn, sched, loss, **over):
    a = {k: st[k].values for k in st.data_vars}
    w = {"born": 0.0, "free_energy": 0.0, **({loss: 1.0} if isinstance(loss, str) else loss)}
    kw = dict(
        rho0=a["rho"],
        H=a["hamiltonian"],
        T=a["temperature"],
        phi=a["phi"],
        gamma=np.broadcast_to(np.asarray(dyn.dephasing_rate, float), a["temperature"].shape),
        gamma_th=np.broadcast_to(np.asarray(dyn.thermal_rate, float), a["temperature"].shape),
        eps0=dyn.coupling_strength,
        ell=dyn.coupling_length,
        dts=sched.dt,
        coupling=dyn.coupling,
        neighbours=dyn.neighbours,
        positions=dyn.positions,
        order=dyn.order,
        basis=dyn.dephasing_basis,
        gate=dyn.gate,
        theta=dyn.gate_threshold,
        tau=dyn.gate_width,
        outcomes=sched.outcomes,
        w_born=w["born"],
        w_F=w["free_energy"],
        qcfg=oracle_config(cfg),
        outcome_F=a.get("outcome"),
    )
    kw.update(over)
    return rollout_loss(**kw)


def _check_fd(f, an, scale, key):
    fd = (f(H_STEP) - f(-H_STEP)) / (2 * H_STEP)
    assert abs(fd - an) <= TOL * scale, (key, fd, an)


def _directions(rng, st):
    n, d = st.rho.shape[:2]
    Z = rng.normal(size=(n, d, d)) + 1j * rng.normal(size=(n, d, d))
    E = 0.5 * (Z + Z.conj().swapaxes(1, 2))
    Et = E - (np.trace(E, axis1=1, axis2=2) / d)[:, None, None] * np.eye(d)
    unit = lambda x: x / np.linalg.norm(x)
    return {
        ("rho0", "rho"): unit(Et),
        ("H", "hamiltonian"): unit(E),
        ("T", "temperature"): unit(rng.normal(size=n)),
        ("phi", "phi"): unit(rng.normal(size=(n, 3))),
        ("gamma", "dephasing_rate"): unit(rng.normal(size=n)),
        ("gamma_th", "thermal_rate"): unit(rng.normal(size=n)),
        ("eps0", "coupling_strength"): 1.0,
        ("ell", "coupling_length"): 1.0,
    }


def _fd_against_oracle(name, **kw):
    case = CASES[name]
    rng, cfg, st, dyn, sched = _build(case)
    res = rollout(st, cfg, sched, loss=case["loss"], checkpoint_every=2, **kw)
    ref_loss, ref_final = _oracle(cfg, st, dyn, sched, case["loss"])
    assert res.loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(res.final.rho.values, ref_final, atol=1e-12)
    base = {
        "rho0": st.rho.values,
        "H": st.hamiltonian.values,
        "T": st.temperature.values,
        "phi": st.phi.values,
        "gamma": np.asarray(dyn.dephasing_rate),
        "gamma_th": np.asarray(dyn.thermal_rate),
        "eps0": dyn.coupling_strength,
        "ell": dyn.coupling_length,
    }
    G = res.grads
    assert np.abs(np.trace(G["rho"], axis1=1, axis2=2)).max() < 1e-12
    for (okey, gkey), E in _directions(rng, st).items():
        f = lambda s, okey=okey, E=E: _oracle(
            cfg, st, dyn, sched, case["loss"], **{okey: base[okey] + s * E}
        )[0]
        fd = (f(H_STEP) - f(-H_STEP)) / (2 * H_STEP)
        g = G[gkey]
        an = float((np.asarray(g) * (np.swapaxes(E, -1, -2) if np.iscomplexobj(g) else E)).sum().real)
        scale = max(abs(an), float(np.linalg.norm(g)))
        assert abs(fd - an) <= TOL * scale, (gkey, fd, an)
    return res


@pytest.mark.parametrize("name", list(CASES))
def test_rollout_gradient_matches_fd_of_the_oracle(name):
    _fd_against_oracle(name)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["dyn"].get("order") != "gauss_seidel"])
def test_kernel_rollout_gradient_matches_fd_of_the_oracle(name):
    """The kernels' step adjoint (closed-form C1 window, per-sender gather, accumulation in the kernel;
    the numba backend's QuantumOps) against central differences of the oracle, every variable."""
    from vfesim.backends.numba_backend import QUANTUM_OPS

    res = _fd_against_oracle(name, ops=QUANTUM_OPS)
    assert res.stats["step_adjoint"] == "kernels"


def test_c2_gradient_is_exact_for_the_stop_gradient_surrogate():
    """C2: the sender's eigenbasis is held fixed (stop-gradient); FD of the oracle with frozen bases."""
    case = dict(CASES["C1-jacobi-dense-born+F"], dyn=dict(coupling="C2", coupling_strength=0.5))
    rng, cfg, st, dyn, sched = _build(case, seed=3)
    res = rollout(st, cfg, sched, loss=case["loss"])
    bases = {}
    ref_loss, _ = _oracle(cfg, st, dyn, sched, case["loss"], record=bases)
    assert res.loss == pytest.approx(ref_loss, rel=1e-12)
    base = {"rho0": st.rho.values, "H": st.hamiltonian.values, "eps0": dyn.coupling_strength, "ell": 1.618}
    dirs = _directions(rng, st)
    for okey, gkey in [
        ("rho0", "rho"),
        ("H", "hamiltonian"),
        ("eps0", "coupling_strength"),
        ("ell", "coupling_length"),
    ]:
        E = dirs[(okey, gkey)]
        f = lambda s, okey=okey, E=E: _oracle(
            cfg, st, dyn, sched, case["loss"], c2_bases=bases, **{okey: base[okey] + s * E}
        )[0]
        fd = (f(H_STEP) - f(-H_STEP)) / (2 * H_STEP)
        g = res.grads[gkey]
        an = float((np.asarray(g) * (np.swapaxes(E, -1, -2) if np.iscomplexobj(g) else E)).sum().real)
        assert abs(fd - an) <= TOL * max(abs(an), float(np.linalg.norm(g))), (gkey, fd, an)


def test_checkpointing_does_not_change_the_gradient():
    case = CASES["C1-gauss-seidel-causal-positions"]
    _, cfg, st, dyn, sched = _build(case)
    results = [rollout(st, cfg, sched, loss="born", checkpoint_every=s) for s in (1, 2, 5, None)]
    for r in results[1:]:
        assert r.loss == results[0].loss
        for k, g in r.grads.items():
            np.testing.assert_allclose(g, results[0].grads[k], rtol=1e-13, atol=1e-14)
    assert [r.stats["checkpoints"] for r in results] == [5, 3, 1, 2]
    assert all(r.stats["forward_steps"] == 2 * case["T"] for r in results)
    fwd = rollout(st, cfg, sched, loss="born", grad=False)
    assert fwd.grads is None and fwd.loss == results[0].loss and fwd.stats["forward_steps"] == case["T"]
    final, _ = evolve(st, cfg, dyn, 0.3, case["T"])
    np.testing.assert_allclose(final.rho.values, fwd.final.rho.values, atol=1e-15)


def test_scalar_rates_get_scalar_gradients():
    case = CASES["C1-jacobi-dense-born+F"]
    _, cfg, st, dyn, sched = _build(case)
    per_agent = rollout(
        st, cfg, Schedule(dyn.replace(dephasing_rate=[0.4] * 3), 0.3, 4, sched.outcomes), "born"
    )
    scalar = rollout(st, cfg, Schedule(dyn.replace(dephasing_rate=0.4), 0.3, 4, sched.outcomes), "born")
    assert scalar.grads["dephasing_rate"] == pytest.approx(per_agent.grads["dephasing_rate"].sum(), rel=1e-13)


def test_rollout_errors():
    case = CASES["C1-jacobi-dense-born+F"]
    _, cfg, st, dyn, sched = _build(case)
    with pytest.raises(ConfigError, match="^gate:"):
        rollout(st, cfg, Schedule(dyn.replace(gate="hard"), 0.3, 4, sched.outcomes))
    rollout(st, cfg, Schedule(dyn.replace(gate="hard"), 0.3, 4, sched.outcomes), grad=False)
    with pytest.raises(ConfigError, match="^checkpoints:"):
        rollout(st, cfg, sched, checkpoints=2, checkpoint_every=2)
    with pytest.raises(ConfigError, match="^checkpoints:"):
        rollout(st, cfg, sched, checkpoints=0)
    with pytest.raises(ConfigError, match="^outcomes:"):
        rollout(st, cfg, Schedule(dyn, 0.3, 4), loss="born")
    with pytest.raises(ConfigError, match="^outcomes:"):
        Schedule(dyn, 0.3, 3, sched.outcomes)
    with pytest.raises(ConfigError, match="^loss:"):
        rollout(st, cfg, sched, loss="entropy")
    with pytest.raises(ConfigError, match="^dt:"):
        Schedule(dyn, [0.1, -0.1, 0.1, 0.1], 4)
    with pytest.raises(ConfigError, match="^checkpoint_every:"):
        rollout(st, cfg, sched, checkpoint_every=0)


MIRROR_CASES = {
    # self + observation terms: the oracle's mirror gradient is its own closed form
    "self+obs": dict(cfg=dict(lambda_obs=0.4), steps=2, keys=("rho", "hamiltonian", "temperature")),
    # belief alignment: the oracle takes vfesim's energy gradient (tested against the energy oracle in
    # test_quantum_vs_reference.py) for G; the mirror step, Armijo search and rollout are the oracle's own
    "belief": dict(cfg=dict(lambda_belief=0.6), steps=1, keys=("rho", "hamiltonian", "temperature", "phi")),
}


@pytest.mark.parametrize("name", list(MIRROR_CASES))
def test_rollout_gradient_through_mirror_steps_matches_fd(name):
    """Rule R9: gradients through Armijo mirror-descent steps (eta fixed by the forward pass; the FD
    runs must pick the same eta, checked)."""
    mc = MIRROR_CASES[name]
    case = dict(n=3, d=2, T=3, loss={"born": 1.0, "free_energy": 0.5}, cfg=mc["cfg"], dyn=dict())
    rng = np.random.default_rng(5)
    cfg = vfesim.QuantumConfig(d=2, **mc["cfg"])
    st = vfesim.random_state(cfg, 3, seed=6, outcome=True)
    dyn = QuantumDynamics(
        coupling_strength=0.3,
        dephasing_rate=rng.uniform(0.1, 0.9, 3),
        mirror_steps=mc["steps"],
        mirror_eta=0.4,
        max_backtracks=4,
    )
    sched = Schedule(dyn, [0.3, 0.2, 0.25], 3, rng.integers(-1, 2, size=(3, 3)))
    res = rollout(st, cfg, sched, loss=case["loss"], checkpoints=2)
    grad_F = None
    if cfg.lambda_belief:
        grad_F = lambda r, H, T, phi: energy_and_gradient_arrays(
            {"rho": r, "hamiltonian": H, "temperature": T, "phi": phi, "outcome": st.outcome.values}, cfg
        )[1]["rho"]
    mirror = dict(
        steps=mc["steps"],
        eta0=0.4,
        armijo_c=dyn.armijo_c,
        max_backtracks=4,
        grad_F=grad_F,
        outcome=st.outcome.values,
    )
    etas = {}
    ref_loss, ref_final = _oracle(cfg, st, dyn, sched, case["loss"], mirror=mirror, record=etas)
    assert res.loss == pytest.approx(ref_loss, rel=1e-11)
    np.testing.assert_allclose(res.final.rho.values, ref_final, atol=1e-12)
    assert all(v > 0 for k, v in etas.items() if k[0] == "eta")
    base = {
        "rho0": st.rho.values,
        "H": st.hamiltonian.values,
        "T": st.temperature.values,
        "phi": st.phi.values,
    }
    dirs = {g: E for (o, g), E in _directions(rng, st).items() if g in mc["keys"]}
    okeys = {"rho": "rho0", "hamiltonian": "H", "temperature": "T", "phi": "phi"}
    for gkey, E in dirs.items():
        okey = okeys[gkey]

        def f(h, okey=okey, E=E):
            rec = {}
            val = _oracle(
                cfg, st, dyn, sched, case["loss"], mirror=mirror, record=rec, **{okey: base[okey] + h * E}
            )[0]
            assert {k: v for k, v in rec.items() if k[0] == "eta"} == {
                k: v for k, v in etas.items() if k[0] == "eta"
            }
            return val

        g = res.grads[gkey]
        an = float((np.asarray(g) * (np.swapaxes(E, -1, -2) if np.iscomplexobj(g) else E)).sum().real)
        _check_fd(f, an, max(abs(an), float(np.linalg.norm(g))), gkey)


@pytest.mark.parametrize("name", ["energy-dephasing-soft-gate-F", "C1-gauss-seidel-causal-positions"])
def test_gradients_wrt_dt_gate_threshold_and_width_match_fd(name):
    case = CASES[name]
    rng, cfg, st, dyn, sched = _build(case)
    if dyn.gate == "none":
        dyn = dyn.replace(gate="soft", gate_threshold=0.1, gate_width=0.7)
        sched = Schedule(dyn, sched.dt, sched.n_steps, sched.outcomes)
    res = rollout(st, cfg, sched, loss=case["loss"], checkpoints=2)
    G = res.grads
    assert G["dt"].shape == (case["T"],)
    E = rng.normal(size=case["T"])
    E /= np.linalg.norm(E)
    f = lambda h: _oracle(cfg, st, dyn, sched, case["loss"], dts=sched.dt + h * E)[0]
    _check_fd(f, float(G["dt"] @ E), float(np.linalg.norm(G["dt"])), "dt")
    for key, okey, v in (
        ("gate_threshold", "theta", dyn.gate_threshold),
        ("gate_width", "tau", dyn.gate_width),
    ):
        f = lambda h, okey=okey, v=v: _oracle(cfg, st, dyn, sched, case["loss"], **{okey: v + h})[0]
        assert G[key] != 0
        _check_fd(f, G[key], abs(G[key]), key)


def test_binomial_checkpointing_bounds_memory_and_keeps_the_gradient():
    """c stored states at most (stats["max_stored"], the state at t = 0 included); the same gradient to
    rounding for every c; forward steps <= T + (r + 1) T with r the least repetition number with
    beta(c - 1, r) >= T (c = 1: replay from 0 for every step, T + T (T + 1)/2)."""
    T = 12
    cfg = vfesim.QuantumConfig(d=2, lambda_belief=0.3)
    st = vfesim.random_state(cfg, 3, seed=2)
    rng = np.random.default_rng(0)
    dyn = QuantumDynamics(coupling_strength=0.4, dephasing_rate=0.3, gate="soft", mirror_steps=1)
    sched = Schedule(dyn, rng.uniform(0.1, 0.3, T), T, rng.integers(-1, 2, size=(T, 3)))
    ref = rollout(st, cfg, sched, loss={"born": 1.0, "free_energy": 0.2}, checkpoint_every=T)
    assert ref.stats["max_stored"] == T + 1
    for c in (1, 2, 3, 4, 6):
        res = rollout(st, cfg, sched, loss={"born": 1.0, "free_energy": 0.2}, checkpoints=c)
        assert res.stats["max_stored"] <= c, (c, res.stats)
        assert res.loss == ref.loss
        for k, g in res.grads.items():
            np.testing.assert_allclose(g, ref.grads[k], rtol=1e-12, atol=1e-13, err_msg=k)
        bound = T + T * (T + 1) // 2 if c == 1 else T + (repetitions(T, c - 1) + 1) * T
        assert res.stats["forward_steps"] <= bound, (c, res.stats, bound)
    assert [binomial(2, r) for r in range(4)] == [1, 3, 6, 10] and repetitions(12, 2) == 4
