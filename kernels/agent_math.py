"""Per-agent scalar math written once, compiled for the CPU (njit) and as CUDA device functions.

Plain Python over scalars, no allocation, no numba import: kernels/cuda.py compiles these with
``cuda.jit(device=True, inline="always")``; CPU kernels with ``numba.njit(inline="always")``.

jr_coeffs(t2) -> (c1, c2)
    c1 = (1 - cos t)/t^2, c2 = (t - sin t)/t^3 for t2 = |phi|^2, evaluated in float64 whatever the
    input dtype: c1 = 2 sin(t/2)^2 / t^2 has no cancellation, and c2 uses its Taylor series below
    t = 0.1 (truncation < 1e-18), where t - sin t would cancel (SPEC §2.1, vfesim.groups.right_jacobian).
jr_transpose_apply(p0, p1, p2, h0, h1, h2, c1, c2) -> (g0, g1, g2)
    g = Jr(phi)^T h with Jr = I - c1 [phi]x + c2 [phi]x^2, i.e. dF/dphi from h_b = <R^T dF/dR, G_b>,
    with (c1, c2) from jr_coeffs. (No function here calls another: CUDA device code could not.)
"""

import math


def jr_coeffs(t2):
    t2 = 1.0 * t2  # promote to float64 (a float literal is float64 in numba)
    if t2 < 0.01:
        t4 = t2 * t2
        c1 = 0.5 - t2 / 24.0 + t4 / 720.0 - t4 * t2 / 40320.0 + t4 * t4 / 3628800.0
        c2 = 1.0 / 6.0 - t2 / 120.0 + t4 / 5040.0 - t4 * t2 / 362880.0 + t4 * t4 / 39916800.0
    else:
        t = math.sqrt(t2)
        s = math.sin(0.5 * t)
        c1 = 2.0 * s * s / t2
        c2 = (t - math.sin(t)) / (t2 * t)
    return c1, c2


def jr_transpose_apply(p0, p1, p2, h0, h1, h2, c1, c2):
    # [phi]x^T = -[phi]x and ([phi]x^2)^T = [phi]x^2, so Jr^T h = h + c1 (phi x h) + c2 phi x (phi x h).
    x0 = p1 * h2 - p2 * h1
    x1 = p2 * h0 - p0 * h2
    x2 = p0 * h1 - p1 * h0
    y0 = p1 * x2 - p2 * x1
    y1 = p2 * x0 - p0 * x2
    y2 = p0 * x1 - p1 * x0
    return h0 + c1 * x0 + c2 * y0, h1 + c1 * x1 + c2 * y1, h2 + c1 * x2 + c2 * y2
