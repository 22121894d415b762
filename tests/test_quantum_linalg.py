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
