"""Frames of density-matrix agents (spec/quantum.md §1.3): spin generators, U_i = exp(-i phi_i . J) and
the adjoint phi_bar of a cotangent U_bar (rule R2).

For odd d the generators are ``J = i G`` with the Gaussian side's real so(3) generators
``G = groups.generators((l,))``, l = (d - 1)/2, so ``U_i = exp(phi_i . G) = R_i`` exactly: the Gaussian
transport is the special case. Even d use the standard spin-j irrep (J_z = diag(j, ..., -j)). Either way
``[J_x, J_y] = i J_z`` (cyclic) and ``sum_a J_a^2 = j(j+1) I``; transport acts by conjugation, so the sign
U(2 pi) = -I of half-integer j drops out.
"""

from __future__ import annotations

import functools

import numpy as np

from ..arrays import array_module as _xp
from ..groups import generators
from .linalg import dagger, dd_expi, eigh

__all__ = ["spin_generators", "frames", "frames_vjp"]


@functools.cache
def _spin_generators(d: int) -> np.ndarray:
    if d % 2 == 1:
        J = 1j * generators(((d - 1) // 2,))
    else:
        j = (d - 1) / 2
        m = j - np.arange(d)  # m = j, j-1, ..., -j
        jp = np.zeros((d, d), complex)
        for k in range(1, d):  # J_+ |m_k> = sqrt(j(j+1) - m_k (m_k + 1)) |m_k + 1> = ... |m_{k-1}>
            jp[k - 1, k] = np.sqrt(j * (j + 1) - m[k] * (m[k] + 1))
        jm = jp.conj().T
        J = np.stack([(jp + jm) / 2, (jp - jm) / 2j, np.diag(m).astype(complex)])
    J = np.ascontiguousarray(J, dtype=np.complex128)
    J.setflags(write=False)
    return J


def spin_generators(d: int) -> np.ndarray:
    """(3, d, d) complex128 Hermitian generators of the d-dimensional su(2) irrep (read-only, cached)."""
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d: must be a positive integer, got {d!r}")
    return _spin_generators(int(d))


def frames(phi, J, dtype):
    """U_i = exp(-i phi_i . J): phi (N, 3) real, J (3, d, d) -> U (N, d, d) of complex ``dtype`` and the
    cache (k, V) of the eigendecomposition phi_i . J = V diag(k) V^dagger (no matrix exponential)."""
    xp = _xp(phi)
    K = xp.einsum("na,akl->nkl", phi.astype(dtype), xp.asarray(J, dtype=dtype))
    k, V = eigh(K)
    U = (V * xp.exp(-1j * k).astype(dtype)[:, None, :]) @ dagger(V)
    return U, (k, V)


def frames_vjp(U_bar, cache, J):
    """phi_bar (N, 3) from the cotangent U_bar (N, d, d) of U (dL = Re tr(U_bar^dagger dU)).

    Rule R2: K_bar = V (conj(f^[1]) o V^dagger U_bar V) V^dagger with f(k) = exp(-i k) (:func:`dd_expi`),
    phi_bar_a = Re tr(K_bar^dagger J_a).
    """
    xp = _xp(U_bar)
    k, V = cache
    Kb = V @ (xp.conj(dd_expi(k)).astype(U_bar.dtype) * (dagger(V) @ U_bar @ V)) @ dagger(V)
    return xp.einsum("nkl,akl->na", Kb.conj(), xp.asarray(J, dtype=U_bar.dtype)).real
