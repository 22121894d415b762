"""Batched Hermitian linear algebra of density-matrix agents (spec/quantum.md §0, §2.3–2.4, §4.1 R2).

Shapes: a batch of matrices is (N, d, d) complex, of vectors (N, d) real. Array-module generic where it
costs nothing (``xp`` from the inputs); the eigensolver is the array module's ``linalg.eigh``.

Hermitian coordinates: ``hvec`` maps Herm(d) isometrically onto R^{d^2}: the diagonal, then sqrt(2) Re and
sqrt(2) Im of the strict upper triangle (row-major), so ``tr(X Y) = hvec(X) . hvec(Y)`` for Hermitian X,
Y. ``hmat`` is its inverse; a real cotangent g of hvec(X) is the Hermitian cotangent hmat(g) of X. With
``trace_first=True`` the diagonal is in the Helmert basis instead (:func:`helmert`: the first coordinate
is tr X / sqrt(d), the other d - 1 orthonormal contrasts of the diagonal), still isometric: the pairwise
features of density-matrix agents use it, so that a sum of many rows (a pair cotangent, summed over a
population of unit-trace states) carries its large identity part in one coordinate, not as a common
offset of every diagonal coordinate whose rounding would swamp the small traceless part in float32.

Divided differences (Daleckii–Krein): for ``X = V diag(x) V^dagger`` and a scalar f,
``Df(X)[E] = V (f^[1](x) o V^dagger E V) V^dagger`` with ``f^[1]_kl = (f(x_k) - f(x_l)) / (x_k - x_l)``
(``f'(x_k)`` on ties); :func:`dd_log`, :func:`dd_exp` and :func:`dd_expi` give stable forms.
"""

from __future__ import annotations

import functools

import numpy as np

from ..arrays import array_module as _xp

__all__ = [
    "dagger",
    "herm",
    "traceless",
    "trace",
    "helmert",
    "hvec",
    "hmat",
    "eigh",
    "eigvalsh",
    "from_eig",
    "dk",
    "dd_log",
    "dd_exp",
    "dd_expi",
]

SQRT2 = float(np.sqrt(2.0))


def dagger(X):
    """Conjugate transpose of the last two axes."""
    return X.conj().swapaxes(-1, -2)


def herm(X):
    """(X + X^dagger) / 2."""
    return 0.5 * (X + dagger(X))


def trace(X):
    """tr X per matrix (N,) (complex)."""
    return X.diagonal(axis1=-2, axis2=-1).sum(axis=-1)


def traceless(X):
    """X - (tr X / d) I."""
    xp = _xp(X)
    d = X.shape[-1]
    return X - (trace(X) / d)[..., None, None] * xp.eye(d, dtype=X.dtype)


@functools.cache
def _upper(d: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(d, 1)


@functools.cache
def helmert(d: int) -> np.ndarray:
    """The orthonormal Helmert matrix (d, d) (float64): row 0 is (1, ..., 1) / sqrt(d); row k >= 1 has
    1 / sqrt(k (k + 1)) in columns 0..k-1, -k / sqrt(k (k + 1)) in column k and 0 after it."""
    Hm = np.zeros((d, d))
    Hm[0] = 1.0 / np.sqrt(d)
    for k in range(1, d):
        Hm[k, :k] = 1.0 / np.sqrt(k * (k + 1.0))
        Hm[k, k] = -k / np.sqrt(k * (k + 1.0))
    Hm.flags.writeable = False  # cached: shared by every caller
    return Hm


def _helmert_like(x, d: int):
    """helmert(d) on x's array module, in x's real floating dtype (float64 for integer x)."""
    return _xp(x).asarray(helmert(d), dtype=np.result_type(x.real.dtype, np.float32))


def hvec(X, *, trace_first: bool = False):
    """Hermitian (N, d, d) -> real (N, d^2) coordinates [diag, sqrt2 Re triu, sqrt2 Im triu]; the diagonal
    in the Helmert basis when ``trace_first``."""
    xp = _xp(X)
    d = X.shape[-1]
    iu, ju = _upper(d)
    up = X[..., iu, ju]
    diag = X.diagonal(axis1=-2, axis2=-1).real
    if trace_first:
        diag = diag @ _helmert_like(diag, d).T
    return xp.concatenate([diag, SQRT2 * up.real, SQRT2 * up.imag], axis=-1)


def hmat(v, d: int, *, trace_first: bool = False):
    """Inverse of :func:`hvec`: real (N, d^2) -> Hermitian (N, d, d) of the matching complex dtype."""
    xp = _xp(v)
    iu, ju = _upper(d)
    m = iu.size
    cdt = np.result_type(v.dtype, np.complex64)
    X = xp.zeros(v.shape[:-1] + (d, d), cdt)
    idx = np.arange(d)
    X[..., idx, idx] = v[..., :d] @ _helmert_like(v, d) if trace_first else v[..., :d]
    up = (v[..., d : d + m] + 1j * v[..., d + m :]) / SQRT2
    X[..., iu, ju] = up
    X[..., ju, iu] = up.conj()
    return X


# Batched eigensolvers by array module name, ``solver(X) -> (w, V)`` as :func:`eigh`: a backend registers
# one for its arrays (the cuda backend a Jacobi kernel, one thread per matrix, for CuPy batches of small
# matrices: cuSOLVER's batched Jacobi took 2-3 ms per call for 65 536 matrices of d = 4 on an H100).
# Without one, the array module's ``linalg.eigh``.
EIGENSOLVERS: dict = {}


def eigh(X):
    """Eigenvalues (N, d) ascending and eigenvectors (N, d, d) of herm(X) (any leading batch shape)."""
    xp = _xp(X)
    solver = EIGENSOLVERS.get(xp.__name__)
    return xp.linalg.eigh(herm(X)) if solver is None else solver(X)


def eigvalsh(X):
    """Eigenvalues (N, d) ascending of herm(X): the registered eigensolver's (:data:`EIGENSOLVERS`), or the
    array module's ``linalg.eigvalsh``."""
    xp = _xp(X)
    solver = EIGENSOLVERS.get(xp.__name__)
    return xp.linalg.eigvalsh(herm(X)) if solver is None else solver(X)[0]


def from_eig(V, f):
    """V diag(f) V^dagger for eigenvectors V (N, d, d) and real values f (N, d)."""
    return (V * f[..., None, :].astype(V.dtype)) @ dagger(V)


def dk(V, Lam, E):
    """Daleckii–Krein form V (Lam o V^dagger E V) V^dagger (Lam (N, d, d) the divided differences)."""
    return V @ (Lam * (dagger(V) @ E @ V)) @ dagger(V)


def _pairs(x):
    return x[..., :, None], x[..., None, :]


def dd_log(s):
    """log^[1] at eigenvalues s > 0 (N, d) -> (N, d, d).

    |delta| < 1/2 with delta = (s_k - s_l)/(s_k + s_l): 2 atanh(delta) / (delta (s_k + s_l)) (no
    cancellation, 1 at ties); otherwise (log s_k - log s_l)/(s_k - s_l), whose logs differ by > log 3.
    """
    xp = _xp(s)
    a, b = _pairs(s)
    tot = a + b
    delta = (a - b) / tot
    near = xp.abs(delta) < 0.5
    dn = xp.where(near, delta, 0.0)
    ratio = xp.where(dn == 0, 1.0, xp.arctanh(dn) / xp.where(dn == 0, 1.0, dn))
    far = (xp.log(a) - xp.log(b)) / xp.where(near, 1.0, a - b)
    return xp.where(near, 2.0 * ratio / tot, far)


def dd_exp(l, p):
    """exp^[1] at log-eigenvalues l (N, d) with p = exp(l) -> (N, d, d).

    |l_k - l_l| < 1: sqrt(p_k p_l) sinh(x)/x with x = (l_k - l_l)/2 (p_k on ties); otherwise
    (p_k - p_l)/(l_k - l_l), where p_k and p_l differ by a factor > e.
    """
    xp = _xp(l)
    la, lb = _pairs(l)
    pa, pb = _pairs(p)
    dl = la - lb
    near = xp.abs(dl) < 1.0
    x = xp.where(near, 0.5 * dl, 0.0)
    xs = xp.where(x == 0, 1.0, x)
    sinhc = xp.where(x == 0, 1.0, xp.sinh(xs) / xs)
    return xp.where(near, xp.sqrt(pa * pb) * sinhc, (pa - pb) / xp.where(near, 1.0, dl))


def dd_expi(k):
    """f^[1] of f(k) = exp(-i k) at real k (N, d) -> complex (N, d, d):
    -i exp(-i (k_a + k_b)/2) sinc((k_a - k_b)/2), stable for every gap (sinc x = sin x / x)."""
    xp = _xp(k)
    a, b = _pairs(k)
    return -1j * xp.exp(-0.5j * (a + b)) * xp.sinc((a - b) / (2 * np.pi))


# ------------------------------------------------------------------------------ dynamics helpers (§3)


def diag_part(X):
    """Pinching Delta(X) = sum_k |k><k| X |k><k| in the computational basis (N, ..., d, d)."""
    xp = _xp(X)
    return X * xp.eye(X.shape[-1], dtype=X.dtype)


def pinch(X, W):
    """Pinching in the orthonormal basis W (columns): W Delta(W^dagger X W) W^dagger."""
    return W @ diag_part(dagger(W) @ X @ W) @ dagger(W)


def expm(X, *, degree: int = 18):
    """Matrix exponential of a batch of square matrices (..., n, n), any (non-normal) X.

    Scaling and squaring with a Taylor polynomial (spec §3.1): s = max(0, ceil(log2 ||X||_1)), so
    ||X / 2^s||_1 <= 1 and the truncation remainder of degree m = 18 is <= e/(m+1)! ~ 2e-17 relative;
    then s squarings. One s for the whole batch (the largest norm). Array-module generic (Horner form,
    m + s matmuls).
    """
    xp = _xp(X)
    n = X.shape[-1]
    norm = float(xp.abs(X).sum(axis=-2).max()) if X.size else 0.0
    if not np.isfinite(norm):
        raise ValueError("expm: the matrix contains NaN or Inf")
    s = max(0, int(np.ceil(np.log2(norm)))) if norm > 0 else 0
    Y = X / (2.0**s)
    eye = xp.eye(n, dtype=X.dtype)
    E = eye + Y / degree
    for k in range(degree - 1, 0, -1):
        E = eye + (Y @ E) / k
    for _ in range(s):
        E = E @ E
    return E


def psd_inv_sqrt(S):
    """S^{-1/2} of Hermitian positive definite S (..., d, d) by eigh, with its cache (s, V).

    Raises ValueError when an eigenvalue is <= 0 (nothing is clamped)."""
    xp = _xp(S)
    s, V = xp.linalg.eigh(herm(S))
    if bool((s <= 0).any()):
        raise ValueError(
            f"psd_inv_sqrt: matrix not positive definite (smallest eigenvalue {float(s.min()):.3g})"
        )
    return (V * (s**-0.5).astype(V.dtype)[..., None, :]) @ dagger(V), (s, V)


__all__ += ["diag_part", "pinch", "expm", "psd_inv_sqrt"]
