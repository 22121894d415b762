"""vfesim.quantum.linalg: the batched eigensolver's dispatch by array module."""

import numpy as np

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
