"""Device-resident integrator steps (backend "cuda"): array placement, fused update launches, the guard.

State, momenta and integrator arrays stay on the device (CuPy; NumPy under the Numba CUDA simulator) for
the whole run. Per step the host sees only Python floats: the energy terms, which the cuda backend
returns with one transfer per evaluation, and (Hamiltonian methods) the kinetic energy.

The NaN/SPD guard of SPEC §5 without a host round trip: the update kernels raise a device flag when an
agent's outputs are not finite; the flag is copied to pinned host memory asynchronously *before* the
energy evaluation, whose own transfer then orders it. A covariance that lost SPD makes the energy's
Cholesky fail, i.e. a non-finite term. Only when the flag or a term says so does :meth:`Device.check`
run the full host-side diagnosis (:func:`guard_state`), which names step, agent and variable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import xarray as xr

from ..arrays import host_array
from ..config import ModelConfig
from .base import DynamicsError, guard_state, guard_terms, with_arrays

__all__ = ["Device", "host_array"]


class Device:
    """Kernels, the guard flag and transfers of one device-resident integrator (latent dimension K)."""

    def __init__(self, K: int):
        from vfesim_kernels import update_cuda as uc
        from vfesim_kernels.cuda.launch import launch

        from ..backends import cuda_backend as cb

        cb.kc.ahead.finish()  # update kernels a first energy left compiling in workers: bound, not rebuilt
        self.uc = uc
        self.launch = launch
        self.cb = cb
        self.xp = cb.array_module()
        self.sim = self.xp is np
        self.k = uc.make_update_kernels(K)
        self.launched: set = set()  # (kernel, dtype) launched by this integrator (first uses announced)
        self.K = K
        self.flag = self.xp.zeros(1, np.int32)
        if self.sim:
            self.host_flag = self.flag
            self.event = None
        else:
            import cupyx

            self.host_flag = cupyx.empty_pinned((1,), np.int32)
            self.host_flag[0] = 0
            self.event = self.xp.cuda.Event(block=False, disable_timing=True)

    # --- placement -----------------------------------------------------------------------------
    def put(self, a: Any):
        """A C-contiguous device array (no copy if ``a`` already is one)."""
        return self.xp.ascontiguousarray(self.xp.asarray(a))

    def put_state(self, state: xr.Dataset) -> xr.Dataset:
        """``state`` with every variable on the device."""
        return with_arrays(state, {k: self.put(state[k].data) for k in state.data_vars})

    def prepare(self, state: xr.Dataset, cfg) -> None:
        """Compile ahead (parallel processes) the kernels a first evaluation and step of ``cfg`` on
        ``state`` launch that the disk cache lacks (the cuda backend's ``prepare``)."""
        self.cb.prepare({k: state[k].data for k in state.data_vars}, cfg, stepping=True)

    def put_aux(self, aux: Mapping[str, Any]) -> dict:
        return {k: self.put(v) for k, v in aux.items()}

    # --- launches ------------------------------------------------------------------------------
    def _launch(self, name: str, n: int, *args) -> None:
        key, first = (name, args[0].dtype), None
        if key not in self.launched:  # first use: announced; later launches skip the bookkeeping
            self.launched.add(key)
            what = f"{name} update, K={self.K}, {args[0].dtype}"
            first = self.cb.FIRST_USE.begin(("update", what), what)
        self.launch(self.k[name], self.uc.launch_blocks(n), self.uc.BLOCK, *args)
        self.cb.FIRST_USE.end(first, {name: self.k[name]})

    def gradient_flow(self, arrays, direc, eta_dev, mode: int, fields: tuple[str, ...]) -> dict:
        """New arrays of ``fields`` after one fused gradient-flow step (eta_dev: (5,) float64 on device)."""
        out = {k: self.xp.empty_like(arrays[k]) for k in fields}
        N = arrays[fields[0]].shape[0]
        self._launch(
            "gradient_flow", N, *(arrays[k] for k in fields), *(direc[k] for k in fields), eta_dev,
            mode, *(out[k] for k in fields), self.flag,
        )  # fmt: skip
        return out

    def adam(self, g, m, v, b1: float, b2: float, n: int, eps: float):
        """(m', v', direction) of one Adam step at step number n, elementwise on the device."""
        m_out, v_out, d = (self.xp.empty_like(g) for _ in range(3))
        flat = [a.reshape(-1) for a in (g, m, v, m_out, v_out, d)]
        c1, c2 = 1.0 - b1**n, 1.0 - b2**n
        self._launch("adam", flat[0].shape[0], *flat[:3], b1, b2, c1, c2, eps, *flat[3:])
        return m_out, v_out, d

    def kick_drift(self, args, sigma, phi_args):
        """``kick_drift_cpu(*args, S, *phi_args)`` in place on the device; returns the new covariance
        (``sigma`` itself when the drift is 0). Raises the guard flag on non-finite outputs."""
        S = self.xp.empty_like(sigma) if args[7] != 0.0 else sigma
        if not phi_args[4]:
            phi_args = self.no_phi(args[0])
        self._launch("kick_drift", args[0].shape[0], *args, S, *phi_args, self.flag)
        return S

    def no_phi(self, like) -> tuple:
        """Frame arguments of ``kick_drift`` for a block without frames: unused (N, 3) stand-ins of the
        right type. Distinct from the block's arrays: the simulator copies every host argument back."""
        key = (like.shape[0], like.dtype.str)
        if getattr(self, "_no_phi_key", None) != key:
            self._no_phi = tuple(self.xp.zeros((like.shape[0], 3), like.dtype) for _ in range(3))
            self._no_phi_key = key
        return (*self._no_phi, 1.0, False)

    def theta_to_sigma(self, theta):
        """Sigma = L L^T (N, K, K) of device log-Cholesky coordinates theta (N, T)."""
        out = self.xp.empty((theta.shape[0], self.K, self.K), theta.dtype)
        self._launch("theta_to_sigma", theta.shape[0], theta, out)
        return out

    # --- guard ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Lower the guard flag (start of a step)."""
        self.flag.fill(0)

    def prefetch(self) -> None:
        """Queue the flag's copy to pinned host memory; call after the updates, before the energy."""
        if self.sim:
            return
        rt = self.xp.cuda.runtime
        stream = self.xp.cuda.get_current_stream()
        rt.memcpyAsync(self.host_flag.ctypes.data, self.flag.data.ptr, 4, rt.memcpyDeviceToHost, stream.ptr)
        self.event.record(stream)

    def flagged(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # normally already done: the energy transfer came after it
        return bool(self.host_flag[0])

    def check(self, step: int, arrays, cfg: ModelConfig, aux, terms: Mapping[str, float]) -> None:
        """Raise DynamicsError if the flag is up or a term is not finite, naming agent and variable."""
        if not self.flagged() and all(math.isfinite(v) for v in terms.values()):
            return
        self.reset()
        guard_state(step, arrays, cfg, aux)
        guard_terms(step, terms)
        raise DynamicsError(step, "state", "the update produced NaN or Inf")

    def sum_squares(self, arrays: list, weights: list[float]) -> float:
        """sum_k weights[k] * sum(arrays[k]^2), with one device-to-host transfer of the per-array sums
        (weighted and added on the host in order, as the NumPy path does)."""
        if not arrays:
            return 0.0
        sums = self.xp.stack([self.xp.dot(a.reshape(-1), a.reshape(-1)) for a in arrays])
        return sum(w * float(v) for w, v in zip(weights, host_array(sums).tolist(), strict=True))
