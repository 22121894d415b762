"""Shared inputs of the density-matrix stage tests (CPU kernels, CUDA kernels under the simulator)."""

import numpy as np

from vfesim.quantum import spin_generators


def _herm(rng, N, d):
    X = rng.normal(size=(N, d, d)) + 1j * rng.normal(size=(N, d, d))
    return X + X.conj().swapaxes(1, 2)


def stage_inputs(d, dtype, N=13, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(N, d, d)) + 1j * rng.normal(size=(N, d, d))
    x = X @ X.conj().swapaxes(1, 2)
    x = x / np.trace(x, axis1=1, axis2=2).real[:, None, None] + 1e-3 * np.eye(d)
    x[0] = np.eye(d) / d  # a maximally mixed state: every eigenvalue tied
    x[1] = np.diag(np.r_[1.0, np.full(d - 1, 1e-12)])  # nearly pure, diagonal
    H = _herm(rng, N, d)
    H[2] = 0.0  # a flat Hamiltonian: the prior is I/d
    T = rng.uniform(0.3, 3.0, N)
    phi = rng.normal(size=(N, 3))
    phi[3] = 0.0  # the identity frame
    E = _herm(rng, N, d)
    Ub = rng.normal(size=(N, d, d)) + 1j * rng.normal(size=(N, d, d))
    gA, gB = rng.normal(size=(N, d * d)), rng.normal(size=(N, d * d))
    rt = np.finfo(np.dtype(dtype)).dtype
    c = lambda a: a.astype(dtype)
    return dict(x=c(x), H=c(H), T=T.astype(rt), phi=phi.astype(rt), E=c(E), Ub=c(Ub),
                gA=gA.astype(rt), gB=gB.astype(rt), J=spin_generators(d))  # fmt: skip


def stage_outputs(ops, v, dtype):
    """Every stage's outputs on the same inputs, as a dict of arrays."""
    s, W, logx, xlx = ops.eig_log(v["x"])
    sigma, logsig, l, p, V = ops.gibbs(v["H"], v["T"])
    U, cache = ops.frames(v["phi"], v["J"], dtype)
    A, B = ops.pull_features(U, v["x"], logx)
    abar, labar, Ubar = ops.pull_vjp(v["gA"], v["gB"], U, v["x"], logx)
    return dict(
        logx=logx, xlx=xlx, sigma=sigma, logsig=logsig, l=np.sort(l, axis=1), U=U, A=A, B=B,
        abar=abar, labar=labar, Ubar=Ubar,
        dk_log=ops.dk_log(s, W, v["E"]), dk_exp=ops.dk_exp(l, p, V, v["E"]),
        frames_vjp=ops.frames_vjp(v["Ub"], cache, v["J"]),
    )  # fmt: skip


def channel_case(d, dtype, coupling, basis, gate, window="sparse", N=9, seed=0):
    """(P, rho, dynamics) of one channel step (vfesim.quantum.evolve): a random population with per-agent
    dephasing rates, thermalisation and a coupling window (dense, or ragged sparse with masked slots)."""
    import vfesim
    from vfesim.quantum.evolve import QuantumDynamics, prepare

    cfg = vfesim.QuantumConfig(d=d)
    qs = vfesim.random_state(cfg, n_agents=N, seed=seed, dtype=dtype)
    if window == "dense":
        nb = "dense"
    else:
        rng = np.random.default_rng(seed + 1)
        lists = [list(rng.choice(np.delete(np.arange(N), i), i % 4, replace=False)) for i in range(N)]
        nb = vfesim.SparseNeighbours.from_lists(lists)  # 0 to 3 senders: masked slots, one agent alone
    dyn = QuantumDynamics(
        coupling=coupling, coupling_strength=0.4, coupling_length=2.0, neighbours=nb,
        dephasing_rate=np.linspace(0.1, 1.0, N), dephasing_basis=basis, thermal_rate=0.3,
        gate=gate, gate_threshold=0.05, gate_width=0.5,
    )  # fmt: skip
    arrays = {k: qs[k].values for k in qs.data_vars}
    return prepare(arrays, cfg, dyn), arrays["rho"], dyn
