"""so(3) irreps in the real tesseral basis, the exponential map and its exact derivative (SPEC §2.1).

Generators are built and kept in float64. ``[G_x, G_y] = G_z`` (cyclic) and ``-sum_a G_a^2 = l(l+1) I``.
The batched exponential uses Taylor + scaling and squaring with the exact spectral norm
``|phi . G|_2 = l_max |phi|`` (eigenvalues of phi.G are i m |phi|, m = -l..l).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from .arrays import array_module

__all__ = [
    "generators",
    "irrep_generators",
    "expm_so3",
    "right_jacobian",
    "phi_grad_from_R",
    "jr_coefficients",
    "n_squarings",
]

# Taylor degree and scaling threshold: with |X/2^s|_2 <= THETA the remainder of the degree-12
# series is below THETA^13/13! = 2.4e-18.
TAYLOR_DEGREE = 12
THETA = 0.25


@functools.cache
def _irrep_generators_cached(l: int) -> np.ndarray:
    d = 2 * l + 1
    m = np.arange(-l, l + 1)
    jz = np.diag(m).astype(complex)
    jp = np.zeros((d, d), complex)
    for k in range(d - 1):  # J_+ |m> = sqrt(l(l+1) - m(m+1)) |m+1>
        jp[k + 1, k] = np.sqrt(l * (l + 1) - m[k] * (m[k] + 1))
    jm = jp.T.copy()
    jx = (jp + jm) / 2
    jy = (jp - jm) / (2j)
    # Unitary change of basis to the tesseral order (m=0, cos 1, sin 1, cos 2, sin 2, ...).
    S = np.zeros((d, d), complex)
    S[0, l] = 1.0
    r2 = np.sqrt(2.0)
    for mm in range(1, l + 1):
        sign = (-1.0) ** mm
        S[2 * mm - 1, l + mm] = 1 / r2
        S[2 * mm - 1, l - mm] = sign / r2
        S[2 * mm, l + mm] = -1j / r2
        S[2 * mm, l - mm] = 1j * sign / r2
    # SPEC §2.1 writes S (i J_a) S^dagger, but conjugation preserves commutators and
    # [iJ_x, iJ_y] = -iJ_z, so that sign gives [G_x, G_y] = -G_z. We take L_a = -iJ_a (so J_a = i L_a
    # as in spec/quantum.md §1.3), which gives the stated [G_x, G_y] = G_z.
    gens = []
    for J in (jx, jy, jz):
        M = S @ (-1j * J) @ S.conj().T
        assert np.abs(M.imag).max() < 1e-12
        gens.append((M.real - M.real.T) / 2)
    G = np.stack(gens)
    G.setflags(write=False)
    return G


def irrep_generators(l: int) -> np.ndarray:
    """Generators (3, 2l+1, 2l+1) of the spin-l real irrep, float64."""
    return _irrep_generators_cached(int(l))


@functools.cache
def _generators_cached(irreps: tuple[int, ...]) -> np.ndarray:
    K = sum(2 * l + 1 for l in irreps)
    G = np.zeros((3, K, K))
    o = 0
    for l in irreps:
        d = 2 * l + 1
        G[:, o : o + d, o : o + d] = irrep_generators(l)
        o += d
    G.setflags(write=False)
    return G


def generators(irreps: Sequence[int]) -> np.ndarray:
    """Block-diagonal generators (3, K, K) for a sum of irreps, float64 (read-only, cached)."""
    return _generators_cached(tuple(int(l) for l in irreps))


def n_squarings(theta_norm, lmax: int):
    """Squarings s so that lmax*|phi|/2^s <= THETA (per agent; NumPy or CuPy)."""
    xp = array_module(theta_norm)
    r = lmax * xp.asarray(theta_norm, dtype=np.float64) / THETA
    with np.errstate(divide="ignore"):
        s = xp.ceil(xp.log2(xp.maximum(r, 1.0)))
    return s.astype(np.int64)


def expm_so3(phi, G: np.ndarray, lmax: int):
    """R = exp(phi . G) for a batch: phi (N, 3), G (3, K, K) -> (N, K, K), in phi's dtype.

    NumPy or CuPy arrays (the array module of ``phi``). Accurate to ~1e-15 in float64 for |phi| <= pi
    and l <= 10 (tested against scipy and mpmath).
    """
    xp = array_module(phi)
    phi = xp.asarray(phi)
    dt = phi.dtype
    X = xp.einsum("na,akl->nkl", phi, xp.asarray(G, dtype=dt))
    t = xp.sqrt(xp.einsum("na,na->n", phi, phi))
    s = n_squarings(t, lmax)
    X = X * xp.ldexp(xp.ones(s.shape, np.float64), -s).astype(dt)[:, None, None]
    K = G.shape[1]
    eye = xp.eye(K, dtype=dt)
    # Paterson-Stockmeyer evaluation of the degree-12 Taylor polynomial in blocks of X^4.
    X2 = X @ X
    X3 = X2 @ X
    X4 = X2 @ X2
    pw = (eye, X, X2, X3)
    c = [1.0]
    for k in range(1, TAYLOR_DEGREE + 1):
        c.append(c[-1] / k)

    def block(j0: int, n: int):
        acc = c[j0] * pw[0]
        for k in range(1, n):
            acc = acc + c[j0 + k] * pw[k]
        return acc

    E = block(8, 4) + c[12] * X4
    E = block(4, 4) + X4 @ E
    E = block(0, 4) + X4 @ E
    for r in range(int(s.max()) if s.size else 0):
        sel = s > r
        if bool(sel.all()):
            E = E @ E
        else:
            E[sel] = E[sel] @ E[sel]
    return E


def jr_coefficients(t2):
    """(c1, c2) of Jr = I - c1 [phi]x + c2 [phi]x^2 from t2 = |phi|^2 (N,), in float64 (any input dtype).

    c1 = (1 - cos t)/t^2 = sinc(t/2)^2 / 2 has no cancellation; c2 = (t - sin t)/t^3 uses its Taylor series
    below t = 0.1 (truncation < 1e-17). The scalar twin compiled into the kernels is
    ``vfesim_kernels.agent_math.jr_coeffs`` (the same expressions in the same order).
    """
    xp = array_module(t2)
    t2 = t2.astype(np.float64)
    t = xp.sqrt(t2)
    c1 = 0.5 * xp.sinc(t / (2 * np.pi)) ** 2
    ts = xp.where(t < 0.1, 1.0, t)
    t4 = t2 * t2  # products, not powers: numpy's x**3 calls pow(), the kernels multiply
    series = 1 / 6 - t2 / 120 + t4 / 5040 - t4 * t2 / 362880 + t4 * t4 / 39916800
    c2 = xp.where(t < 0.1, series, (ts - xp.sin(ts)) / (ts * ts * ts))
    return c1, c2


def right_jacobian(phi):
    """Jr(phi) (N, 3, 3) with dR/dphi^a = R Q_a, Q_a = sum_b Jr[b, a] G_b (SPEC §2.1).

    Jr = I - c1 [phi]_x + c2 [phi]_x^2, c1 = (1 - cos t)/t^2, c2 = (t - sin t)/t^3 (:func:`jr_coefficients`).
    """
    xp = array_module(phi)
    phi = xp.asarray(phi)
    c1, c2 = jr_coefficients(xp.einsum("na,na->n", phi, phi))
    c1, c2 = c1.astype(phi.dtype), c2.astype(phi.dtype)
    Px = xp.zeros(phi.shape[:-1] + (3, 3), phi.dtype)
    Px[..., 0, 1], Px[..., 0, 2] = -phi[..., 2], phi[..., 1]
    Px[..., 1, 0], Px[..., 1, 2] = phi[..., 2], -phi[..., 0]
    Px[..., 2, 0], Px[..., 2, 1] = -phi[..., 1], phi[..., 0]
    eye = xp.eye(3, dtype=phi.dtype)
    return eye - c1[:, None, None] * Px + c2[:, None, None] * (Px @ Px)


def phi_grad_from_R(gR, R, phi, G: np.ndarray):
    """Chain rule dF/dphi from dF/dR (N, K, K): h_b = <gR, R G_b>, dF/dphi = Jr^T h (NumPy or CuPy)."""
    xp = array_module(R)
    RtgR = xp.swapaxes(R, -1, -2) @ gR  # <gR, R G_b> = <R^T gR, G_b>
    h = xp.einsum("nkl,bkl->nb", RtgR, xp.asarray(G, dtype=R.dtype))
    return xp.einsum("nba,nb->na", right_jacobian(phi), h)
