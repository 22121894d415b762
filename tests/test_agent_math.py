"""kernels/agent_math.py (shared CPU/CUDA per-agent math) against mpmath and vfesim.groups."""

import mpmath
import numba
import numpy as np
import pytest
from vfesim_kernels import agent_math

from vfesim.groups import right_jacobian

jr_coeffs = numba.njit(agent_math.jr_coeffs)
jr_transpose_apply = numba.njit(agent_math.jr_transpose_apply)


@pytest.mark.parametrize("t", [0.0, 1e-8, 1e-3, 0.0999, 0.1, 0.1001, 0.5, 1.0, 2.0, 3.14159])
def test_jr_coefficients_match_40_digit_reference(t):
    mpmath.mp.dps = 40
    c1, c2 = jr_coeffs(t * t)
    if t == 0.0:
        ref1, ref2 = mpmath.mpf(1) / 2, mpmath.mpf(1) / 6
    else:
        T = mpmath.mpf(t)
        ref1, ref2 = (1 - mpmath.cos(T)) / T**2, (T - mpmath.sin(T)) / T**3
    assert abs(c1 - float(ref1)) <= 4e-16 * float(ref1)
    assert abs(c2 - float(ref2)) <= 1e-13 * float(ref2)  # t - sin t for t >= 0.1: <= 6 eps / t^2


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_jr_transpose_apply_matches_groups(dtype):
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(40, 3)) * np.geomspace(1e-6, 3.0, 40)[:, None] / np.sqrt(3)
    phi = phi.astype(dtype)
    h = rng.normal(size=(40, 3))
    ref = np.einsum("nba,nb->na", right_jacobian(phi.astype(np.float64)), h)
    for i in range(40):
        p = phi[i]
        # as the kernels do: the squared norm in float64 even for a float32 phi
        c1, c2 = jr_coeffs(float(p[0]) ** 2 + float(p[1]) ** 2 + float(p[2]) ** 2)
        got = np.array(jr_transpose_apply(p[0], p[1], p[2], h[i, 0], h[i, 1], h[i, 2], c1, c2))
        np.testing.assert_allclose(got, ref[i], rtol=1e-13, atol=1e-15)


def test_scalar_and_array_jr_coefficients_are_one_formula():
    """The kernels' scalar jr_coeffs (njit-compiled here) and vfesim.groups.jr_coefficients agree bitwise,
    on both sides of the series threshold t = 0.1: every device gets the same coefficients."""
    import numba

    from vfesim.groups import jr_coefficients

    scalar = numba.njit(agent_math.jr_coeffs)
    t = np.concatenate([[0.0, 1e-8, 1e-3, 0.0999999, 0.1, 0.1000001], np.linspace(0.2, 3.1, 30)])
    c1, c2 = jr_coefficients(t * t)
    for k, tk in enumerate(t):
        assert scalar(tk * tk) == (c1[k], c2[k]), tk
