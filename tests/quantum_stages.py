"""Shared inputs of the density-matrix stage tests (CPU kernels, CUDA kernels under the simulator)."""

import numpy as np

import vfesim
from vfesim.arrays import agent_minor
from vfesim.quantum.born import observed_outcomes
from vfesim.quantum.energy import floor_eps


def _herm(rng, N, d):
    X = rng.normal(size=(N, d, d)) + 1j * rng.normal(size=(N, d, d))
    return X + X.conj().swapaxes(1, 2)


# Weights of (self, belief, prior, observation): every term on, and some sets with terms off (the passes
# skip their parts: their caches are never written); ALL_WEIGHTS: every term on or off.
WEIGHTS = [(0.7, 1.3, 0.9, 0.4), (0.0, 1.0, 0.0, 0.0), (1.0, 0.0, 0.6, 0.0), (0.0, 0.0, 0.0, 2.0)]
ALL_WEIGHTS = [tuple(w * ((m >> k) & 1) for k, w in enumerate(WEIGHTS[0])) for m in range(16)]


class Poisoned:
    """NumPy whose ``empty`` / ``empty_like`` arrays are full of NaN (integers: -1): kernels handed these
    (``kernel_ops(lambda: POISONED, launch)``) give NaN, or index out of range, where they read what they
    did not write."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def _fill(a):
        a.fill(-1 if a.dtype.kind in "iu" else np.nan)
        return a

    def empty(self, shape, dtype=float):
        return self._fill(np.empty(shape, dtype))

    def empty_like(self, a, dtype=None):
        return self._fill(np.empty_like(a, dtype=dtype))


POISONED = Poisoned()


def stage_inputs(d, dtype, N=13, seed=0):
    """(arrays, cotangents): a population with hard cases (every eigenvalue of a belief tied, a nearly pure
    belief, a flat Hamiltonian, the identity frame) and random pair cotangents (gA, gB, gc) of both
    alignment terms."""
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
    rt = np.finfo(np.dtype(dtype)).dtype
    arrays = dict(rho=x.astype(dtype), hamiltonian=H.astype(dtype), temperature=T.astype(rt),
                  phi=phi.astype(rt), outcome=rng.integers(0, d, N))  # fmt: skip
    cot = {
        name: (rng.normal(size=(N, d * d)).astype(rt), rng.normal(size=(N, d * d)).astype(rt),
               rng.normal(size=N).astype(rt))
        for name in ("belief_align", "prior_align")
    }  # fmt: skip
    return arrays, cot


def stage_outputs(ops, v, weights=WEIGHTS[0]):
    """The forward pass's energies and features and the backward pass's gradients of ``ops`` (a
    QuantumOps) on inputs ``v`` of :func:`stage_inputs`, as a dict of host arrays (the gradients of
    temperature and phi in the state's dtypes, as the assembly gives them)."""
    from vfesim.arrays import host_array

    arrays, cot = v
    fw = ops.forward(arrays, weights)
    out = {f"energy {k}": e for k, e in fw.energies.items()}
    for name, feats in fw.features.items():
        out |= {f"{name} {k}": f for k, f in zip("ABc", feats, strict=True)}
    grads = ops.backward(arrays, fw, weights, {k: cot[k] for k in fw.features})
    for k, g in grads.items():
        out[f"grad {k}"] = g.astype(arrays[k].dtype, copy=False) if k in ("temperature", "phi") else g
    return {k: host_array(a) for k, a in out.items()}


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


def assert_stages_match(ops, v, rtol, weights=WEIGHTS[0]):
    """The passes of ``ops`` against the array code's on inputs ``v`` (:func:`stage_inputs`): the same
    outputs, dtypes and shapes, equal to ``rtol`` (relative to each output's largest entry)."""
    from vfesim.quantum.energy import NUMPY_OPS

    ref = stage_outputs(NUMPY_OPS, v, weights)
    got = stage_outputs(ops, v, weights)
    assert got.keys() == ref.keys()
    for k, b in ref.items():
        a = got[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()), err_msg=k)


def check_born_ops(ops, dtype="complex128", tol=1e-13):
    """The Born terms of ``ops`` (a BornOps) against naive sums: two steps (all agents observed, some not)
    and one unobserved step, in C, agent-minor and gapped layouts; the log-probabilities accumulate over
    steps."""
    rng = np.random.default_rng(3)
    n, d = 7, 4
    rho = vfesim.random_state(vfesim.QuantumConfig(d=d), n, seed=2, dtype=dtype).rho.values
    y = rng.integers(0, d, size=(3, n))
    y[1, [0, 3]] = [-1, -1000]
    y[2] = -7
    obs = observed_outcomes(y, d, np)
    gapped = np.zeros((2 * n, d, d), rho.dtype)[::2]
    gapped[...] = rho
    e = floor_eps(rho.dtype)
    for a in (rho, agent_minor(rho), gapped):
        acc = ops.start(np, n)
        total = 0.0
        for t in (0, 1, 2):
            seen = [i for i in range(n) if y[t, i] >= 0]
            p = np.array([rho[i, y[t, i], y[t, i]].real * (1 - e) + e / d for i in seen])
            want = np.zeros((n, d, d), complex)
            for i, pi in zip(seen, p, strict=True):
                want[i, y[t, i], y[t, i]] = -2.5 * (1 - e) / pi
            acc = ops.logp(acc, a, obs, t)
            total += np.log(p).sum()
            assert abs(ops.total(acc) - total) < tol * max(1.0, abs(total))
            blank = np.zeros((2 * n, d, d), rho.dtype)[::2] if a is gapped else np.zeros_like(a)
            bar = ops.add(blank, a, obs, t, 2.5)
            assert bar is blank and bar.strides == a.strides
            np.testing.assert_allclose(bar, want, rtol=tol, atol=0)
