"""Whole-array reductions on the device: float64 sums and max |x| (+inf when an entry is not finite).

CuPy's reductions (``x.sum()``, a ``cupy.ReductionKernel``) run CUB programs that NVRTC compiles in the
first process that calls them: 1.7–2.4 s each, 8.3 of the 9.2 s a first-ever Gaussian energy + step
spent in CuPy compiles on an H100 (benchmarks/results/gpu_nvrtc_h100_stop28.txt). These numba kernels
compile with the package's other kernels and load from the same disk cache.

Two passes, each in a fixed order (the same bits run to run for a given length): ``partial_sum``
reduces a 1-D array over a grid of :data:`REDUCE_THREADS`-thread blocks, each block striding over the
array and reducing its threads by a tree in shared memory into ``parts[block]`` (float64); a second
launch of ``partial_sum`` on ``parts`` with one block gives the result. Launch:
``[blocks, REDUCE_THREADS](x, parts)``. Max |x| takes up to :data:`MAX_ABS_ARRAYS` arrays of one dtype
at once (checks reduce every variable of a state or gradient): ``partial_max_abs[(blocks, n),
REDUCE_THREADS](x0, ..., x5, parts)`` (grid row a reduces x_a into ``parts[a]``; x_a past n are not read),
then ``final_max_abs[n, REDUCE_THREADS](parts, out, o0)`` writes row a's max to ``out[o0 + a]``: two
launches for a whole state instead of two per variable. ``fold_slices`` sums the slices of a pair pass's
partial sums (S, n) into row 0, slice by slice (:func:`fold_slices`): one launch instead of S - 1.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import float64

from .core import SIMULATOR, compile_kernels, cuda, device
from .launch import launch

__all__ = [
    "REDUCE_THREADS",
    "REDUCE_BLOCKS",
    "MAX_ABS_ARRAYS",
    "make_reduce_kernels",
    "reduce_signatures",
    "device_sum",
    "max_abs",
    "fold_slices",
]

REDUCE_THREADS = 8 if SIMULATOR else 256  # a power of two (tree)
REDUCE_BLOCKS = 2 if SIMULATOR else 1024  # partial results of the first pass, at most
MAX_ABS_ARRAYS = 6  # arrays per max |x| launch


@functools.cache
def make_reduce_kernels() -> dict:
    """``partial_sum`` over a real 1-D array of any float dtype, ``partial_max_abs`` over up to six of
    them and its second pass ``final_max_abs`` (module docstring)."""
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

    def partial_max_abs(x0, x1, x2, x3, x4, x5, parts):
        a = cuda.blockIdx.y
        x = x0 if a == 0 else x1 if a == 1 else x2 if a == 2 else x3 if a == 3 else x4 if a == 4 else x5
        t = cuda.threadIdx.x
        acc = 0.0
        for i in range(cuda.blockIdx.x * NT + t, x.shape[0], NT * cuda.gridDim.x):
            v = float64(x[i])
            acc = max(acc, abs(v)) if math.isfinite(v) else math.inf
        red = cuda.shared.array(NT, float64)
        red[t] = acc
        tree(red, t, True)
        if t == 0:
            parts[a, cuda.blockIdx.x] = red[0]

    def final_max_abs(parts, out, o0):
        a = cuda.blockIdx.x
        t = cuda.threadIdx.x
        acc = 0.0
        for i in range(t, parts.shape[1], NT):
            acc = max(acc, parts[a, i])  # (inf stays inf; the partials hold no NaN)
        red = cuda.shared.array(NT, float64)
        red[t] = acc
        tree(red, t, True)
        if t == 0:
            out[o0 + a] = red[0]

    def fold(parts):
        e = cuda.grid(1)
        if e < parts.shape[1]:
            acc = parts[0, e]
            for s in range(1, parts.shape[0]):
                acc += parts[s, e]
            parts[0, e] = acc

    tree = device(tree)
    pyfuncs = {
        "partial_sum": partial_sum,
        "partial_max_abs": partial_max_abs,
        "final_max_abs": final_max_abs,
        "fold": fold,
    }
    return compile_kernels(pyfuncs)


def reduce_signatures(dtype: str) -> dict[str, str]:
    """Signature strings of the reduction kernels over ``dtype`` arrays (``partial_sum``'s second pass
    reduces float64 partials: the float64 signature)."""
    x = f"{np.dtype(dtype).name}[::1]"
    return {
        "partial_sum": f"void({x}, float64[::1])",
        "partial_max_abs": f"void({', '.join([x] * MAX_ABS_ARRAYS)}, float64[:, ::1])",
        "final_max_abs": "void(float64[:, ::1], float64[::1], int64)",
        "fold": f"void({np.dtype(dtype).name}[:, ::1])",
    }


def _blocks(n: int) -> int:
    """Blocks of a first pass over n entries (each block strides over the array)."""
    return max(1, min(REDUCE_BLOCKS, -(-n // REDUCE_THREADS)))


def _flat(a, xp):
    """The real entries of ``a`` (complex: real and imaginary parts) as one C-contiguous vector, in C
    order of ``a`` (a copy where ``a`` is not C-contiguous)."""
    v = xp.ascontiguousarray(a)
    v = v.view(v.real.dtype) if xp.iscomplexobj(v) else v
    return v.reshape(-1)


def _memory_flat(a, xp):
    """:func:`_flat` in memory order instead: a view wherever ``a``'s entries fill one block in some order
    of its axes (C, F, agent-minor layouts), for reductions whose result does not depend on the order."""
    t = a.transpose(sorted(range(a.ndim), key=lambda k: -abs(a.strides[k])))
    return _flat(t, xp)


def device_sum(a):
    """The float64 sum of a real device (CuPy; NumPy under the simulator) array as a 0-d array on the
    device (no synchronisation); 0 for an empty array."""
    xp = _xp(a)
    if xp.iscomplexobj(a):
        raise TypeError(f"device_sum: a real array, got {a.dtype}")
    flat = _flat(a, xp)
    if not flat.shape[0]:
        return xp.zeros((), np.float64)
    # always two launches: a result never depends on how many blocks the first took
    k = make_reduce_kernels()["partial_sum"]
    parts = xp.empty(_blocks(flat.shape[0]) + 1, np.float64)  # the blocks' sums, then the total
    blocks = parts[:-1]
    launch(k, blocks.shape[0], REDUCE_THREADS, flat, blocks)
    launch(k, 1, REDUCE_THREADS, blocks, parts[-1:])
    return parts[-1]


def fold_slices(parts):
    """Sum the slices of a real (S, ...) C-contiguous device array into ``parts[0]``, in slice order
    (parts[0] + parts[1] + ... per element; the same bits as that loop of additions), in one launch; returns
    parts[0]."""
    S = parts.shape[0]
    if S > 1 and parts[0].size:
        flat = parts.reshape(S, -1)
        k = make_reduce_kernels()["fold"]
        launch(k, -(-flat.shape[1] // REDUCE_THREADS), REDUCE_THREADS, flat)
    return parts[0]


def max_abs(arrays) -> list[float]:
    """max |x| of each device array as a host float (+inf where an entry is NaN or Inf, 0 when empty;
    complex arrays over their real and imaginary parts), with one device-to-host transfer for all: two
    launches per run of up to MAX_ABS_ARRAYS consecutive arrays of one real dtype."""
    flats = [_memory_flat(a, _xp(a)) for a in arrays]
    if not flats:
        return []
    xp = _xp(flats[0])
    out = xp.zeros(len(flats), np.float64)
    k = make_reduce_kernels()
    i = 0
    while i < len(flats):
        run = flats[i : i + MAX_ABS_ARRAYS]
        run = run[: next((r for r, f in enumerate(run) if f.dtype != run[0].dtype), len(run))]
        longest = max(f.shape[0] for f in run)
        if longest:
            nb = _blocks(longest)
            parts = xp.empty((len(run), nb), np.float64)
            xs = list(run)
            xs += xs[:1] * (MAX_ABS_ARRAYS - len(run))  # fillers: rows past len(run) are not launched
            launch(k["partial_max_abs"], (nb, len(run)), REDUCE_THREADS, *xs, parts)
            launch(k["final_max_abs"], len(run), REDUCE_THREADS, parts, out, i)
        i += len(run)
    return [float(v) for v in (out if xp is np else out.get())]


def _xp(a):
    if SIMULATOR or isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy
