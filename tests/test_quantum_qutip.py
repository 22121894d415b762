"""vfesim's Lindblad integrators against QuTiP 5 ``mesolve`` (a test-only dependency; spec/quantum.md §3.3)
and the naive column-stacking oracle: independent qudits (d = 2, 3, 4) with computational-basis dephasing
and a general jump operator. Exact propagator to 1e-10; Strang, Kraus orders measured by halving dt."""

import numpy as np
import pytest
from reference.quantum_dynamics import lindblad_exact

from vfesim.quantum.lindblad import lindblad_evolve

qutip = pytest.importorskip("qutip")

T_FINAL = 1.0
EXPECTED_ORDER = {"strang": 2, "kraus1": 1, "kraus2": 2}


def _problem(d, n=2, seed=0):
    rng = np.random.default_rng(seed + d)
    Z = rng.normal(size=(n, d, d)) + 1j * rng.normal(size=(n, d, d))
    H = 0.5 * (Z + Z.conj().swapaxes(1, 2))
    A = rng.normal(size=(n, d, d)) + 1j * rng.normal(size=(n, d, d))
    rho = A @ A.conj().swapaxes(1, 2)
    rho /= np.trace(rho, axis1=1, axis2=2)[:, None, None]
    L = 0.4 * (rng.normal(size=(n, 1, d, d)) + 1j * rng.normal(size=(n, 1, d, d)))
    gamma = rng.uniform(0.2, 0.8, n)
    return rho, H, L, gamma


def _mesolve(rho, H, L, gamma, t):
    out = []
    d = H.shape[-1]
    for i in range(rho.shape[0]):
        c_ops = [qutip.Qobj(L[i, 0])] + [
            qutip.Qobj(np.sqrt(gamma[i]) * np.diag(np.eye(d)[k]).astype(complex)) for k in range(d)
        ]
        res = qutip.mesolve(
            qutip.Qobj(H[i]),
            qutip.Qobj(rho[i]),
            [0.0, t],
            c_ops=c_ops,
            options={"atol": 1e-14, "rtol": 1e-13, "nsteps": 100000},
        )
        out.append(res.states[-1].full())
    return np.array(out)


@pytest.mark.parametrize("d", [2, 3, 4])
def test_lindblad_integrators_match_mesolve(d):
    rho, H, L, gamma = _problem(d)
    ref = _mesolve(rho, H, L, gamma, T_FINAL)
    oracle = np.array(
        [
            lindblad_exact(
                rho[i],
                H[i],
                [L[i, 0]] + [np.sqrt(gamma[i]) * np.diag(np.eye(d)[k]) for k in range(d)],
                T_FINAL,
            )
            for i in range(2)
        ]
    )
    np.testing.assert_allclose(oracle, ref, atol=1e-10)
    exact = lindblad_evolve(rho, H, T_FINAL / 10, 10, jumps=L, dephasing_rate=gamma, method="exact")
    assert np.abs(exact[-1] - ref).max() <= 1e-10
    for method, p in EXPECTED_ORDER.items():
        errs = []
        for n in (10, 20, 40):
            traj = lindblad_evolve(rho, H, T_FINAL / n, n, jumps=L, dephasing_rate=gamma, method=method)
            assert np.abs(np.trace(traj, axis1=2, axis2=3) - 1).max() <= 1e-13, method
            assert np.linalg.eigvalsh(traj).min() >= -1e-13, method
            errs.append(np.abs(traj[-1] - ref).max())
        orders = np.log2(np.array(errs[:-1]) / np.array(errs[1:]))
        assert (orders > p - 0.3).all(), (method, errs, orders)
        assert errs[-1] < 0.01


def test_strang_is_exact_for_dephasing_commuting_with_h():
    """Diagonal H and computational-basis dephasing commute: Strang (closed-form dissipator) is exact."""
    d = 3
    rho, _, _, gamma = _problem(d, seed=5)
    H = np.zeros((2, d, d), complex)
    H[:, np.arange(d), np.arange(d)] = [[0.0, 1.0, 3.0], [0.5, -1.0, 2.0]]
    ref = _mesolve(rho, H, np.zeros((2, 1, d, d)), gamma, T_FINAL)
    traj = lindblad_evolve(rho, H, T_FINAL / 3, 3, dephasing_rate=gamma, method="strang")
    np.testing.assert_allclose(traj[-1], ref, atol=1e-10)
