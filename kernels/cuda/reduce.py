"""Whole-array reductions on the device: float64 sums and max |x| (+inf when an entry is not finite).

CuPy's reductions (``x.sum()``, a ``cupy.ReductionKernel``) run CUB programs that NVRTC compiles in the
first process that calls them: 1.7–2.4 s each, 8.3 of the 9.2 s a first-ever Gaussian energy + step
spent in CuPy compiles on an H100 (benchmarks/results/gpu_nvrtc_h100_stop28.txt). These numba kernels
compile with the package's other kernels and load from the same disk cache.

Two passes, each in a fixed order (the same bits run to run for a given length): ``partial_sum`` /
``partial_max_abs`` reduce a 1-D array over a grid of :data:`REDUCE_THREADS`-thread blocks, each block
striding over the array and reducing its threads by a tree in shared memory into ``parts[block]``
(float64); a second launch of ``partial_sum`` / ``partial_max_abs`` on ``parts`` with one block gives
the result. Launch: ``[blocks, REDUCE_THREADS](x, parts)``.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import float64

from .core import SIMULATOR, compile_kernels, cuda, device, launch_view

__all__ = [
    "REDUCE_THREADS",
    "REDUCE_BLOCKS",
    "make_reduce_kernels",
    "reduce_signatures",
    "device_sum",
    "max_abs",
]

REDUCE_THREADS = 8 if SIMULATOR else 256  # a power of two (tree)
REDUCE_BLOCKS = 2 if SIMULATOR else 1024  # partial results of the first pass, at most


@functools.cache
def make_reduce_kernels() -> dict:
    """``partial_sum`` and ``partial_max_abs`` over a real 1-D array of any float dtype (module docstring)."""
    NT = REDUCE_THREADS

    def tree(red, t, is_max):
        h = NT // 2
        while h > 0:
            cuda.syncthreads()
            if t < h:
                red[t] = max(red[t], red[t + h]) if is_max else red[t] + red[t + h]
            h //= 2
        cuda.syncthreads()

    def partial_sum(x, parts):
        t = cuda.threadIdx.x
        acc = 0.0
        for i in range(cuda.blockIdx.x * NT + t, x.shape[0], NT * cuda.gridDim.x):
            acc += float64(x[i])
        red = cuda.shared.array(NT, float64)
        red[t] = acc
        tree(red, t, False)
        if t == 0:
            parts[cuda.blockIdx.x] = red[0]

    def partial_max_abs(x, parts):
        t = cuda.threadIdx.x
        acc = 0.0
        for i in range(cuda.blockIdx.x * NT + t, x.shape[0], NT * cuda.gridDim.x):
            v = float64(x[i])
            acc = max(acc, abs(v)) if math.isfinite(v) else math.inf
        red = cuda.shared.array(NT, float64)
        red[t] = acc
        tree(red, t, True)
        if t == 0:
            parts[cuda.blockIdx.x] = red[0]

    tree = device(tree)
    return compile_kernels({"partial_sum": partial_sum, "partial_max_abs": partial_max_abs})


def reduce_signatures(dtype: str) -> dict[str, str]:
    """Signature strings of the reduction kernels over a ``dtype`` array (first pass; the second pass
    reduces float64 partials)."""
    sig = f"void({np.dtype(dtype).name}[::1], float64[::1])"
    return {"partial_sum": sig, "partial_max_abs": sig}


def _two_pass(name: str, flat, out) -> None:
    """Kernel ``name``'s reduction of the non-empty 1-D array ``flat`` into the 1-element float64 device
    array ``out``: always two launches, so a result never depends on how many blocks the first took."""
    k = make_reduce_kernels()[name]
    nb = max(1, min(REDUCE_BLOCKS, -(-flat.shape[0] // REDUCE_THREADS)))
    parts = _xp(flat).empty(nb, np.float64)
    k[nb, REDUCE_THREADS](launch_view(flat), launch_view(parts))
    k[1, REDUCE_THREADS](launch_view(parts), launch_view(out))


def _flat(a, xp):
    v = xp.ascontiguousarray(a)
    v = v.view(v.real.dtype) if xp.iscomplexobj(v) else v
    return v.reshape(-1)


def device_sum(a):
    """The float64 sum of a real device (CuPy; NumPy under the simulator) array as a 0-d array on the
    device (no synchronisation); 0 for an empty array."""
    xp = _xp(a)
    if xp.iscomplexobj(a):
        raise TypeError(f"device_sum: a real array, got {a.dtype}")
    flat = _flat(a, xp)
    out = xp.zeros(1, np.float64)
    if flat.shape[0]:
        _two_pass("partial_sum", flat, out)
    return out.reshape(())


def max_abs(arrays) -> list[float]:
    """max |x| of each device array as a host float (+inf where an entry is NaN or Inf, 0 when empty;
    complex arrays over their real and imaginary parts), with one device-to-host transfer for all."""
    arrays = list(arrays)
    if not arrays:
        return []
    xp = _xp(arrays[0])
    out = xp.zeros(len(arrays), np.float64)
    for i, a in enumerate(arrays):
        flat = _flat(a, xp)
        if flat.shape[0]:
            _two_pass("partial_max_abs", flat, out[i : i + 1])
    return [float(v) for v in (out if xp is np else out.get())]


def _xp(a):
    if SIMULATOR or isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy
