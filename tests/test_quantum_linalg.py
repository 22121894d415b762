"""vfesim.quantum.linalg: the batched eigensolver's dispatch by array module; the Hermitian coordinates."""

import numpy as np
import pytest

from vfesim.quantum import linalg


def test_eigh_uses_the_solver_registered_for_the_array_module(monkeypatch):
    """A backend registers its eigensolver for its arrays (the cuda backend's Jacobi kernel for CuPy);
    arrays of other modules keep their module's linalg.eigh, on the Hermitian part."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3, 4, 4)) + 1j * rng.normal(size=(3, 4, 4))  # not Hermitian
    w, V = linalg.eigh(X)
    H = linalg.herm(X)
    np.testing.assert_allclose(H @ V, V * w[:, None, :], atol=1e-12)
    calls = []
    monkeypatch.setitem(linalg.EIGENSOLVERS, "numpy", lambda A: calls.append(A) or ("w", "V"))
    assert linalg.eigh(X) == ("w", "V")
    assert calls[0] is X


def test_eigvalsh_uses_the_registered_solver_or_the_modules(monkeypatch):
    """eigvalsh (the state checks and run diagnostics): the registered solver's eigenvalues, else the
    array module's linalg.eigvalsh of the Hermitian part (ascending either way)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(5, 3, 3)) + 1j * rng.normal(size=(5, 3, 3))
    w = linalg.eigvalsh(X)
    np.testing.assert_array_equal(w, np.linalg.eigvalsh(linalg.herm(X)))
    assert (np.diff(w, axis=1) >= 0).all()
    monkeypatch.setitem(linalg.EIGENSOLVERS, "numpy", lambda A: (A.shape, "V"))
    assert linalg.eigvalsh(X) == (5, 3, 3)


@pytest.mark.parametrize("d", [2, 3, 4, 8])
@pytest.mark.parametrize("trace_first", [False, True])
def test_hvec_is_an_isometry_and_hmat_its_inverse(d, trace_first):
    """Both coordinate systems: tr(X Y) = hvec(X) . hvec(Y), hmat inverts hvec, the dtype follows the
    input's precision; with trace_first the first coordinate is tr X / sqrt(d) and the identity has no
    other (the Helmert matrix is orthonormal)."""
    rng = np.random.default_rng(d)
    Z = rng.normal(size=(2, 5, d, d)) + 1j * rng.normal(size=(2, 5, d, d))
    X, Y = Z + np.conj(np.swapaxes(Z, -1, -2))
    vx, vy = (linalg.hvec(A, trace_first=trace_first) for A in (X, Y))
    assert vx.shape == (5, d * d) and vx.dtype == np.float64
    np.testing.assert_allclose((vx * vy).sum(axis=1), np.einsum("nij,nji->n", X, Y).real, rtol=1e-12)
    np.testing.assert_allclose(linalg.hmat(vx, d, trace_first=trace_first), X, atol=1e-12)
    v32 = linalg.hvec(X.astype(np.complex64), trace_first=trace_first)
    assert v32.dtype == np.float32 and linalg.hmat(v32, d, trace_first=trace_first).dtype == np.complex64
    Hm = linalg.helmert(d)
    np.testing.assert_allclose(Hm @ Hm.T, np.eye(d), atol=1e-15)
    eye = linalg.hvec(np.eye(d, dtype=complex)[None], trace_first=trace_first)[0]
    if trace_first:
        np.testing.assert_allclose(vx[:, 0], np.trace(X, axis1=1, axis2=2).real / np.sqrt(d), rtol=1e-12)
        np.testing.assert_allclose(eye, np.r_[np.sqrt(d), np.zeros(d * d - 1)], atol=1e-15)
    else:
        np.testing.assert_array_equal(vx[:, :d], np.diagonal(X, axis1=1, axis2=2).real)
        np.testing.assert_array_equal(eye, np.r_[np.ones(d), np.zeros(d * d - d)])
