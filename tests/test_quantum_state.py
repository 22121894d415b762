"""Density-matrix states: schema, random states, validation errors (each named), spin generators,
refusal by the backends and integrators this family does not have yet."""

import numpy as np
import pytest

import vfesim
from vfesim import QuantumConfig, StateError

CFG = QuantumConfig(d=3, lambda_obs=0.5)


@pytest.mark.parametrize("dtype, real", [("complex128", np.float64), ("complex64", np.float32)])
def test_random_state_schema(dtype, real):
    qs = vfesim.random_state(CFG, n_agents=7, seed=3, dtype=dtype)
    assert qs.attrs["agent_family"] == "quantum" and qs.attrs["dtype"] == dtype
    assert qs.rho.dims == ("agent", "bra", "ket") and qs.rho.shape == (7, 3, 3) and qs.rho.dtype == dtype
    assert qs.hamiltonian.dtype == dtype and qs.temperature.dtype == real and qs.phi.dtype == real
    assert qs.phi.dims == ("agent", "gauge") and qs.temperature.dims == ("agent",)
    assert np.issubdtype(qs.outcome.dtype, np.integer) and qs.outcome.dims == ("agent",)
    rho = qs.rho.data.astype(np.complex128)
    np.testing.assert_allclose(np.trace(rho, axis1=1, axis2=2), 1.0, atol=1e-6)
    assert np.linalg.eigvalsh(rho).min() > 0
    assert (np.linalg.norm(qs.phi.data, axis=1) <= 1 + 1e-6).all() and (qs.temperature.data > 0).all()
    again = vfesim.random_state(CFG, n_agents=7, seed=3, dtype=dtype)
    assert all(np.array_equal(again[k].data, qs[k].data) for k in qs.data_vars)
    assert "outcome" not in vfesim.random_state(QuantumConfig(d=3), 4).data_vars


def _state(**changes):
    qs = vfesim.random_state(CFG, n_agents=4, seed=0)
    arrays = {k: qs[k].data.copy() for k in qs.data_vars}
    for k, f in changes.items():
        arrays[k] = f(arrays[k])
    return arrays


def _set(idx, value):
    def f(a):
        a[idx] = value
        return a

    return f


@pytest.mark.parametrize(
    "changes, variable, agent",
    [
        ({"rho": _set((2, 0, 1), 0.3)}, "rho", 2),  # non-Hermitian
        ({"hamiltonian": _set((1, 2, 0), 5.0 + 1j)}, "hamiltonian", 1),
        ({"rho": lambda r: r * np.array([1, 1, 1.01, 1])[:, None, None]}, "rho", 2),  # trace
        ({"rho": _set((3, 0, 0), np.nan)}, "rho", 3),
        ({"hamiltonian": _set((0, 1, 1), np.inf)}, "hamiltonian", 0),
        ({"temperature": _set(1, 0.0)}, "temperature", 1),
        ({"temperature": _set(2, -1.0)}, "temperature", 2),
        ({"phi": _set((3, 1), np.nan)}, "phi", 3),
        ({"outcome": _set(2, 3)}, "outcome", 2),
        ({"outcome": _set(0, -1)}, "outcome", 0),
    ],
)
def test_bad_values_name_variable_and_agent(changes, variable, agent):
    with pytest.raises(StateError) as e:
        vfesim.validate_state(_state(**changes), CFG)
    assert (e.value.variable, e.value.agent) == (variable, agent)
    assert f"{variable}[agent={agent}]" in str(e.value)


def test_negative_eigenvalue_and_rank_deficient():
    a = _state()
    v = np.array([1.0, 0.0, 0.0])
    a["rho"][1] = 1.1 * np.outer(v, v) - 0.1 * np.diag([0, 1.0, 0])  # trace 1, eigenvalue -0.1
    with pytest.raises(StateError, match=r"rho\[agent=1\].*positive semidefinite"):
        vfesim.validate_state(a, CFG)
    a["rho"][1] = np.outer(v, v)  # pure state: legal, and the energy is finite
    vfesim.validate_state(a, CFG)
    a["outcome"][1] = 2  # Born probability 0 before the floor
    qs = vfesim.make_state(CFG, a["rho"], a["hamiltonian"], a["temperature"], a["phi"], a["outcome"])
    terms, grads = vfesim.energy_and_gradient(qs, CFG.replace(lambda_prior=1.0))
    assert all(np.isfinite(v) for v in terms.values())
    assert all(np.isfinite(grads[k].data).all() for k in grads.data_vars)


@pytest.mark.parametrize(
    "variable, change, match",
    [
        ("rho", lambda a: a.real, "dtype"),
        ("phi", lambda a: a.astype(np.float32), "dtype"),
        ("temperature", lambda a: a[:3], "shape"),
        ("hamiltonian", lambda a: a[:, :2, :2], "shape"),
        ("outcome", lambda a: a.astype(np.float64), "integer"),
    ],
)
def test_wrong_dtype_and_shape(variable, change, match):
    with pytest.raises(StateError, match=match) as e:
        vfesim.validate_state(_state(**{variable: change}), CFG)
    assert e.value.variable == variable


def test_missing_unknown_dims_and_config_dtype():
    a = _state()
    del a["outcome"]
    with pytest.raises(StateError, match="outcome"):
        vfesim.validate_state(a, CFG)
    with pytest.raises(StateError, match="mu_q"):
        vfesim.validate_state({**_state(), "mu_q": np.zeros((4, 3))}, CFG)
    qs = vfesim.random_state(CFG, 4)
    with pytest.raises(StateError, match="dims"):
        vfesim.validate_state(qs.rename_dims(bra="x"), CFG)
    with pytest.raises(StateError, match="complex64"):
        vfesim.validate_state(qs, CFG.replace(dtype="complex64"))
    with pytest.raises(TypeError, match="Dataset"):
        vfesim.energy_and_gradient(_state(), CFG)


@pytest.mark.parametrize("d", [2, 3, 4, 5, 6, 7])
def test_spin_generators(d):
    J = vfesim.quantum.spin_generators(d)
    j = (d - 1) / 2
    assert J.shape == (3, d, d) and J.dtype == np.complex128
    np.testing.assert_allclose(J, J.conj().swapaxes(1, 2), atol=0)
    for a in range(3):
        b, c = (a + 1) % 3, (a + 2) % 3
        np.testing.assert_allclose(J[a] @ J[b] - J[b] @ J[a], 1j * J[c], atol=1e-14)
    np.testing.assert_allclose(np.einsum("akl,alm->km", J, J), j * (j + 1) * np.eye(d), atol=1e-13)


def test_gaussian_integrators_refuse_density_matrices():
    qs = vfesim.random_state(CFG, 4)
    with pytest.raises(ValueError, match="'gradient_flow' is not a density-matrix method.*mirror_descent"):
        vfesim.run_dynamics(qs, CFG, method="gradient_flow", dt=0.1, n_steps=1)
