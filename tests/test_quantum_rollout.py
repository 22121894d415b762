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
from vfesim.quantum.evolve import QuantumDynamics, evolve
from vfesim.quantum.rollout import Schedule, rollout

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
        gamma=np.asarray(dyn.dephasing_rate),
        gamma_th=np.asarray(dyn.thermal_rate),
        eps0=dyn.coupling_strength,
        ell=dyn.coupling_length,
    )
    kw.update(over)
    return rollout_loss(
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
        **kw,
    )


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


@pytest.mark.parametrize("name", list(CASES))
def test_rollout_gradient_matches_fd_of_the_oracle(name):
    case = CASES[name]
    rng, cfg, st, dyn, sched = _build(case)
    res = rollout(st, cfg, sched, loss=case["loss"], checkpoint_every=2)
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
    with pytest.raises(ConfigError, match="^mirror_steps:"):
        rollout(st, cfg, Schedule(dyn.replace(mirror_steps=1), 0.3, 4, sched.outcomes))
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
