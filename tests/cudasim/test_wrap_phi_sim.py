"""The CUDA gradient-flow kernel's frame wrap under the Numba CUDA simulator: the closed form (``math.fmod``
on the device) gives the NumPy twin's results exactly, and frames too large to wrap raise the guard flag."""

import numpy as np
import pytest
from vfesim_kernels import update_cuda as uc
from vfesim_kernels.update_math import MODE_EUCLIDEAN, PHI_MAX

from vfesim.gaussian.geometry import wrap_phi

pytestmark = pytest.mark.cudasim


def test_gradient_flow_kernel_wraps_frames_like_numpy():
    N, K = 6, 3
    phi = np.zeros((N, 3))
    g_phi = -np.array(
        [
            [1.0, 2.0, 0.5],
            [4.0, 0.0, 0.0],
            [3e3, -1e3, 7.0],
            [1e12, 3e11, 0.0],
            [2 * PHI_MAX, 0, 0],
            [1.0, 0, 0],
        ]
    )
    mu = np.zeros((N, K))
    S = np.repeat(np.eye(K)[None], N, axis=0)
    out = [np.empty_like(a) for a in (mu, S, mu, S, phi)]
    eta = np.array([0.0, 0.0, 0.0, 0.0, 1.0])  # frames only: phi - 1 * g_phi
    flag = np.zeros(1, np.int32)
    kern = uc.make_update_kernels(K)["gradient_flow"]
    kern[uc.launch_blocks(N), uc.BLOCK](
        mu, S, mu, S, phi, mu, S, mu, S, g_phi, eta, MODE_EUCLIDEAN, *out, flag
    )
    want = wrap_phi(phi - g_phi)
    np.testing.assert_array_equal(out[4], want)
    assert np.isnan(out[4][4]).all() and np.isfinite(np.delete(out[4], 4, axis=0)).all()
    assert flag[0] == 1  # the too-large frame raised the guard flag


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_energy_of_an_infinite_frame_ends():
    """|phi| = inf used to loop forever in the kernels' scaling-and-squaring count; now it gives NaN,
    which the integrators' device guard reports."""
    import vfesim
    from vfesim.backends import get

    cfg = vfesim.ModelConfig(K=3)
    st = vfesim.random_state(cfg, n_agents=3, seed=0)
    arrays = {k: st[k].values.copy() for k in st.data_vars}
    arrays["phi"][1] = [np.inf, 0.0, 0.0]
    cb = get("cuda")
    try:
        terms, _ = cb.energy_and_gradient(cb.to_device(arrays), cfg)
    except ValueError as e:  # the simulator's math.sin(inf) raises where the device returns NaN
        assert "math domain error" in str(e)
    else:
        assert not np.isfinite(terms["total"])
