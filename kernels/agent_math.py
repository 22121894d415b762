"""Per-agent scalar math written once, compiled for the CPU (njit) and as CUDA device functions.

Plain Python over scalars, no allocation, no numba import: kernels/cuda.py compiles these with
``cuda.jit(device=True, inline="always")``; CPU kernels with ``numba.njit(inline="always")``.

jr_coeffs(t2) -> (c1, c2)
    c1 = (1 - cos t)/t^2, c2 = (t - sin t)/t^3 for t2 = |phi|^2, evaluated in float64 whatever the
    input dtype: c1 = sinc(t/2)^2 / 2 has no cancellation, and c2 uses its Taylor series below t = 0.1
    (truncation < 1e-17), where t - sin t would cancel. The same expressions, in the same order, as the
    array version ``vfesim.groups.jr_coefficients`` (NumPy/CuPy): every device gets the same coefficients.
jr_transpose_apply(p0, p1, p2, h0, h1, h2, c1, c2) -> (g0, g1, g2)
    g = Jr(phi)^T h with Jr = I - c1 [phi]x + c2 [phi]x^2, i.e. dF/dphi from h_b = <R^T dF/dR, G_b>,
    with (c1, c2) from jr_coeffs. (No function here calls another: CUDA device code could not.)
"""

import math


def jr_coeffs(t2):
    t2 = 1.0 * t2  # promote to float64 (a float literal is float64 in numba)
    t = math.sqrt(t2)
    y = math.pi * (t / (2.0 * math.pi))  # np.sinc(t / 2 pi) = sin(y) / y, as vfesim.groups evaluates it
    sc = 1.0 if y == 0.0 else math.sin(y) / y
    c1 = 0.5 * sc * sc
    if t < 0.1:
        t4 = t2 * t2
        c2 = 1 / 6 - t2 / 120 + t4 / 5040 - t4 * t2 / 362880 + t4 * t4 / 39916800
    else:
        c2 = (t - math.sin(t)) / (t * t * t)
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
