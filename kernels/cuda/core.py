"""Shared pieces of the numba.cuda kernels: the CUDA import, launch constants, device-function compiler.

The only place the package imports ``numba.cuda`` (ECOSYSTEM: a later switch of the CUDA Python layer is
then one edit); the kernel modules take ``cuda`` from here (bound at their module level, as the simulator
needs). Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on NumPy arrays.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, float32, float64
from numba.core import config as _numba_config

from .. import agent_math as _am
from .. import pair_math as _pm

__all__ = [
    "SIMULATOR",
    "cuda",
    "BLOCK",
    "PAIR_THREADS",
    "PAIR_OPTS",
    "PAIR_OPTS_NARROW",
    "pair_opt",
    "SHARED_BYTES",
    "NB_TYPES",
    "device",
    "compile_kernels",
    "compile_report",
    "feature_dim",
    "as_device_view",
    "launch_view",
]

SIMULATOR = bool(_numba_config.ENABLE_CUDASIM)
if SIMULATOR:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray as _FakeCUDAArray

    _DeviceNDArray = ()
else:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray as _DeviceNDArray
# Small grids are deliberate at small N; numba's low-occupancy warning would be an error under pytest.
_numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = False

# Threads per block of the per-agent kernels. The simulator spawns one Python thread per CUDA thread
# of a block, so it gets small blocks.
BLOCK = 8 if SIMULATOR else 128
# Dense pairwise: threads per block, owners per thread by dtype (register blocking: each shared-memory row
# is reused by OPT owners); the slices of the other side: vfesim_kernels.cuda.pairwise.dense_splits. On an
# H100 (benchmarks/results/gpu_opt_h100_stop31.txt, whole evaluations, two alternations) float32 took 3
# owners: the density-matrix pairs (D = 16, complex64) at N = 16 384 3.40-3.80 -> 2.78-3.12 ms, at 65 536
# 22.4-22.6 -> 21.9-22.3 ms, Gaussian K = 3 (D = 10, two terms) at 65 536 35.0-35.2 -> 34.4-34.7 ms; 4 owners
# (200 registers at D = 16, 2 blocks per SM) were slower. float64 keeps 2: 3 owners made the complex128 pairs
# at 65 536 53.5 -> 61 ms and Gaussian float64 87 -> 92 ms. (float64 dense pairs now default to the
# tensor-core kernels of vfesim_kernels.cuda.pair_mma; these serve them with ``mma=False``.)
# Stop 39's kernels (fewer instructions per pair, so occupancy counts for more) moved float32 feature rows up
# to D = 10 back to 2 owners (PAIR_OPTS_NARROW): Gaussian K = 3 (D = 10, one term) at N = 65 536 took
# 15.3-16.4 ms against 16.7-16.9 (expected) and 12.5-12.6 against 12.9 (softmin), its statistics kernel 120
# registers against 162 (expected); the density-matrix pairs (D = 16) stayed faster at 3 (17.3-17.8 against
# 18.2 ms at 65 536; benchmarks/results/gpu_pairs_h100_stop39.txt).
PAIR_THREADS = 4 if SIMULATOR else 128
PAIR_OPTS = {"float32": 3, "float64": 2}
PAIR_OPTS_NARROW = {"float32": (10, 2)}  # dtype -> (widest D, owners per thread up to that width)


def pair_opt(dtype, D: int | None = None) -> int:
    """Owners per thread of the dense pair kernels in ``dtype`` for feature width D (PAIR_OPTS, and
    PAIR_OPTS_NARROW for narrow rows; D None: PAIR_OPTS)."""
    name = np.dtype(dtype).name
    narrow = PAIR_OPTS_NARROW.get(name)
    if D is not None and narrow is not None and D <= narrow[0]:
        return narrow[1]
    return PAIR_OPTS[name]


# Static shared memory per block stays under the 48 KB that needs no opt-in.
SHARED_BYTES = 40 * 1024

NB_TYPES = {np.dtype(np.float32): float32, np.dtype(np.float64): float64}


def device(fn):
    """Compile a plain Python function as a CUDA device function that NVVM inlines into its callers
    (``forceinline``: the ``alwaysinline`` attribute).

    Numba's own IR-level inlining (``inline="always"``) gives the same machine code (ptxas for sm_90: the
    same registers, stack and spills) but deep-copies the callee's IR at every call site: the
    density-matrix adjoint kernel compiled in 296 s that way and in 13 s this way (``compile_ptx``, the
    2-core CPU). A device function compiles for the current device's compute capability, so
    ``compile_ptx`` without a GPU needs one given (tests/test_cuda_ptx.py does).
    """
    if SIMULATOR:  # the simulator runs Python: nothing to inline
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def compile_kernels(pyfuncs: dict, *, cache: bool = True, registers: dict | None = None, **opts) -> dict:
    """A factory's kernels as ``cuda.jit`` dispatchers, name -> kernel, plus the Python functions under
    ``"_py"`` (for ``compile_ptx``). Compiled at first launch and cached on disk (``cache=True``): a later
    process loads the compiled code instead of compiling again (see :mod:`vfesim_kernels` for where).
    ``registers``: name -> register cap (``max_registers``) of that kernel (ignored by the simulator).
    Numba's disk cache does not key on the cap: give capped variants that the source does not fix
    ``cache=False``."""
    registers = {} if SIMULATOR or registers is None else registers
    out = {}
    for name, fn in pyfuncs.items():
        cap = {"max_registers": registers[name]} if registers.get(name) else {}
        out[name] = cuda.jit(fn, cache=cache, **opts, **cap)
    return out | {"_py": pyfuncs}


def compile_report(*kernel_sets: dict) -> tuple[int, int]:
    """(compiled, loaded from the disk cache) so far over the kernels of the given factory outputs."""
    compiled = loaded = 0
    if SIMULATOR:
        return compiled, loaded
    for ks in kernel_sets:
        for name, k in ks.items():
            if name != "_py" and hasattr(k, "stats"):
                compiled += sum(k.stats.cache_misses.values())
                loaded += sum(k.stats.cache_hits.values())
    return compiled, loaded


pair_kl = device(_pm.pair_kl)
pair_logit = device(_pm.pair_logit)
lse_push = device(_pm.lse_push)
lse_push_e = device(_pm.lse_push_e)
lse_merge = device(_pm.lse_merge)
row_abar = device(_pm.row_abar)
row_energy = device(_pm.row_energy)
pair_weight = device(_pm.pair_weight)
pair_weight_e = device(_pm.pair_weight_e)
accumulate_row = device(_pm.accumulate_row)
lse_push_w = device(_pm.lse_push_w)
row_unit_energy_w = device(_pm.row_unit_energy_w)
row_means_w = device(_pm.row_means_w)
pair_weight_w = device(_pm.pair_weight_w)
jr_coeffs = device(_am.jr_coeffs)
jr_transpose_apply = device(_am.jr_transpose_apply)
AGG_CODES = {"expected": _pm.AGG_EXPECTED, "softmin": _pm.AGG_SOFTMIN}


_NB = NB_TYPES


def feature_dim(K: int) -> int:
    return K * (K + 1) // 2 + K + 1


def as_device_view(a):
    """A numba device view of a CuPy array (wrapped once, then reused: cheaper launches); NumPy and views
    as they are. No synchronisation on the exporter's stream (``sync=False``): the kernels launch on the
    legacy default stream, which runs after the work CuPy queued on its default stream or any blocking
    stream, so a device-wide wait per wrap (numba's default) would only stall the host. The package's
    CUDA work assumes those streams: CuPy work on a non-blocking stream (or numba's per-thread default
    stream) is not ordered with its kernels."""
    if SIMULATOR:
        return _simulator_view(a)
    if isinstance(a, (np.ndarray, _DeviceNDArray)):
        return a
    return cuda.as_cuda_array(a, sync=False)


def _simulator_view(a):
    """Under the simulator, a strided NumPy array (neither C nor F contiguous: an agent-minor one) wrapped
    as the simulator's device array, which its kernels then read and write in place: the simulator
    copies a plain NumPy argument to a contiguous buffer and refuses a strided one."""
    if isinstance(a, np.ndarray) and a.ndim and not (a.flags.c_contiguous or a.flags.f_contiguous):
        return _FakeCUDAArray(a)
    return a


# Descriptors of CuPy arrays for one launch, by (pointer, shape, strides, dtype): CuPy's memory pool hands
# the same blocks out step after step, so a run's per-step arrays find their descriptor here.
_LAUNCH_VIEWS: dict = {}
_LAUNCH_VIEWS_MAX = 1024


def launch_view(a):
    """A numba device view of a CuPy array for one kernel launch (NumPy and views as they are): a
    descriptor holding no reference to the array, cached by (pointer, shape, strides, dtype), so a
    launch does not pay numba's wrapping (tens of microseconds per array). The caller keeps the array
    alive until the launch is queued; CuPy's pool reuses a freed block only in stream order, after the
    kernel that reads it. (UVA: device pointers are unique across the process's GPUs.)"""
    if SIMULATOR:
        return _simulator_view(a)
    if isinstance(a, (np.ndarray, _DeviceNDArray)):
        return a
    key = (a.data.ptr, a.shape, a.strides, a.dtype.char)
    v = _LAUNCH_VIEWS.get(key)
    if v is None:
        if len(_LAUNCH_VIEWS) >= _LAUNCH_VIEWS_MAX:
            _LAUNCH_VIEWS.clear()
        v = _LAUNCH_VIEWS[key] = cuda.from_cuda_array_interface(
            a.__cuda_array_interface__, owner=None, sync=False
        )
    return v
