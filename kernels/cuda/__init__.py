"""numba.cuda kernels (SPEC §2.1–2.4), one module per kernel family.

- :mod:`.core`: the ``numba.cuda`` import, launch constants, the device-function compiler and the per-pair
  math of :mod:`vfesim_kernels.pair_math` / per-agent scalars of :mod:`vfesim_kernels.agent_math` as
  device functions;
- :mod:`.pairwise`: family-free pairwise kernels over feature rows (dense streaming, sparse, GEMM rows),
  keyed by the feature width D; :mod:`.pair_mma` the float64 dense ones on the tensor cores, from the
  warp-level primitives of :mod:`.warp`;
- :mod:`.checks`: input checks of a Gaussian state on the device (every variable's largest entry, the
  covariances' SPD verdicts and condition-number bounds) in one launch;
- :mod:`.quantum`: density-matrix per-agent stages (Jacobi eigensolver, Daleckii–Krein adjoints), one
  thread per agent; :mod:`.eigh` the batched eigensolver with eight threads per matrix (large d);
- :mod:`.launch`: launches that keep each argument's kernel form (numba re-derives it every launch);
- :mod:`.ahead`: compiling the kernels a computation will launch ahead of it, in parallel processes;
- :mod:`.reduce`: whole-array sums and max |x| (numba kernels instead of CuPy's CUB reductions, which
  NVRTC compiles in every first-ever process);
- :mod:`.gaussian`: Gaussian per-agent stages, one source for two launch shapes: one thread per agent
  (small K) and one thread block per agent (large K).
Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on NumPy arrays.
"""

from __future__ import annotations

import numpy as np

from . import ahead, checks, eigh, gaussian, launch, pair_mma, quantum, reduce, warp
from .core import (
    BLOCK,
    PAIR_OPTS,
    PAIR_OPTS_NARROW,
    PAIR_THREADS,
    SHARED_BYTES,
    SIMULATOR,
    as_device_view,
    compile_report,
    cuda,
    feature_dim,
    launch_view,
    pair_opt,
)
from .gaussian import (
    BLOCK_SHARED_BYTES,
    BLOCK_THREADS_MAX,
    block_kernels_fit,
    block_threads,
    make_agent_kernels,
    make_block_kernels,
)
from .pairwise import (
    DENSE_MMA,
    DENSE_REGISTERS,
    ROW_THREADS,
    dense_layout,
    dense_registers,
    dense_slices,
    dense_splits,
    make_dense_kernels,
    make_gemm_row_kernel,
    make_points_kernels,
    make_sparse_kernels,
    merge_blocks,
)
from .quantum import make_quantum_kernels

__all__ = [
    "ahead",
    "checks",
    "eigh",
    "launch",
    "gaussian",
    "quantum",
    "reduce",
    "pair_mma",
    "warp",
    "SIMULATOR",
    "cuda",
    "as_device_view",
    "launch_view",
    "compile_report",
    "feature_dim",
    "dense_slices",
    "merge_blocks",
    "dense_splits",
    "dense_layout",
    "DENSE_MMA",
    "dense_registers",
    "DENSE_REGISTERS",
    "make_agent_kernels",
    "make_dense_kernels",
    "make_sparse_kernels",
    "make_block_kernels",
    "block_kernels_fit",
    "block_threads",
    "block_kernel_signatures",
    "make_gemm_row_kernel",
    "make_points_kernels",
    "make_quantum_kernels",
    "kernel_signatures",
    "points_kernel_signatures",
    "quantum_kernel_signatures",
    "BLOCK",
    "BLOCK_SHARED_BYTES",
    "BLOCK_THREADS_MAX",
    "PAIR_OPTS",
    "PAIR_OPTS_NARROW",
    "pair_opt",
    "PAIR_THREADS",
    "ROW_THREADS",
    "SHARED_BYTES",
]


def kernel_signatures(K: int, dtype: str) -> dict[str, str]:
    """Numba signature strings of every kernel for (K, dtype), for ``cuda.compile_ptx`` (tests)."""
    f = "float32" if np.dtype(dtype) == np.float32 else "float64"
    a1, a2, a3, a4 = (f"{f}[{', '.join([':'] * (n - 1) + ['::1'])}]" for n in (1, 2, 3, 4))
    i, d1 = "int64", "float64[::1]"
    return {
        "prep": f"void({a2}, {a3}, {i}, {a3}, {a4}, {f}, {i}, {i}, {a3}, {a4}, {a4}, {a3}, {a2})",
        "features": f"void({a4}, {a4}, {a3}, {a2}, {a2}, {a1}, {i}, {a3}, {a3}, {a2}, {a3}, {a3})",
        "self_kl": f"void({a3}, {a4}, {f}, {f}, {a1}, {a3}, {a4})",
        "adjoint": (
            f"void({a2}, {a3}, {a3}, {a3}, {a4}, {f}, {a3}, {a4}, {a3}, {a4}, {a4}, {a1}, {a1}, {i}, {i}, "
            f"{a3}, {a4}, {a2})"
        ),
        "stats": f"void({a3}, {a3}, {a2}, {f}, {i}, {i}, {i}, {a3}, {a3}, {a3}, {a4}, {a4})",
        "merge": f"void({a3}, {a3}, {a3}, {a1}, {i}, {a2}, {a2}, {a2}, {a2}, {a4}, {a4})",
        "grads": f"void({a3}, {a3}, {a2}, {f}, {a2}, {a2}, {a2}, {i}, {i}, {i}, {a4})",
        "rows": f"void({a3}, {a3}, {a2}, {i}[:, ::1], boolean[:, ::1], {a1}, {i}, {a3}, {a2}, {a4})",
        "senders": f"void({a3}, {a3}, {i}[::1], {i}[::1], {i}[::1], {i}, {a4})",
        "state": f"void({a2}, {a2}, {a2}, {a2}, {a3}, {a3}, {f}, int32[:, ::1], float64[:, ::1], {d1})",
    }


def points_kernel_signatures(dtype: str) -> dict[str, str]:
    """Signature strings of the weighted pairs batched over points (:func:`make_points_kernels`)."""
    f = "float32" if np.dtype(dtype) == np.float32 else "float64"
    r1, r2 = f"{f}[::1]", f"{f}[:, ::1]"
    i1, i2 = "int64[::1]", "int64[:, ::1]"
    return {
        "rows": (
            f"void({r2}, {r2}, {r1}, {r1}, {r1}, {i1}, {i1}, {i2}, {i2}, boolean[:, ::1], {f}, {r2}, {r1}, "
            f"{r2}, {r1}, {r1})"
        ),
        "senders": f"void({r2}, {r2}, {r1}, {r1}, {r1}, {i1}, {i1}, {i2}, {i1}, {i1}, {f}, {r2}, {r2}, {r1})",
    }


def quantum_kernel_signatures(dtype: str) -> dict[str, str]:
    """Signature strings of the density-matrix kernels (:func:`make_quantum_kernels`) for a complex dtype,
    as the cuda backend launches them: the per-agent arrays of the free energy and of the channel steps
    agent-minor (``vfesim.arrays.agent_minor``: a matrix batch (N, d, d) of layout "A", a (N, k) table
    Fortran-ordered), the pair kernels' feature rows, the (2, N) / (3, d, d) arrays and ``eigh``'s
    batches C-contiguous."""
    c = "complex64" if np.dtype(dtype) == np.complex64 else "complex128"
    f = "float32" if c == "complex64" else "float64"
    m, m4, J = f"{c}[:, :, :]", f"{c}[:, :, :, :]", f"{c}[:, :, ::1]"  # agent matrices, tapes; J
    r1, t2, r2, r3 = f"{f}[::1]", f"{f}[::1, :]", f"{f}[:, ::1]", f"{f}[:, :, ::1]"  # t2: (N, k) tables
    i2, b2 = "int64[::1, :]", "boolean[::1, :]"
    return {
        "energy_prep": (
            f"void({m}, {m}, {r1}, {t2}, {J}, int64, int64, int64, float64, float64, {m}, {t2}, {m}, "
            f"{m}, {r1}, {m}, {m}, {t2}, {t2}, {m}, {m}, {t2}, {m})"
        ),
        "energy_mats": f"void({m}, {m}, {t2}, {J}, int64, int64, int64, float64, {m}, {J})",
        "energy_finish": (
            f"void({r1}, int64, int64, int64, {r2}, {J}, {t2}, {m}, {m}, {r1}, {m}, {m}, {t2}, {t2}, {m}, "
            f"{m}, {t2}, {m})"
        ),
        "energy_features": (
            f"void(int64[::1], int64, int64, int64, int64, {m}, {m}, {r1}, {m}, {m}, {t2}, {t2}, {m}, "
            f"{r2}, {r3}, {r3}, {r2})"
        ),
        "energy_backward": (
            f"void({m}, {r1}, int64[::1], {J}, int64, int64, int64, int64, float64, float64, float64, "
            f"float64, float64, {r3}, {r3}, {r2}, {m}, {t2}, {m}, {m}, {m}, {m}, {t2}, {t2}, {m}, "
            f"{m}, {t2}, {m}, {m}, {m}, {r1}, {t2})"
        ),
        "sender_states": f"void({m}, {m}, {m})",
        "channel_step": (
            f"void({m}, {m}, {i2}, {b2}, {m}, {t2}, {t2}, {m}, {m}, {t2}, {r1}, "
            f"{r1}, int64[::1], float64, float64, float64, float64, float64, {m}, {r1})"
        ),
        "channel_step_vjp": (
            f"void({m}, {m}, {i2}, {b2}, {m}, {t2}, {t2}, {m}, {m}, {t2}, {r1}, "
            f"{r1}, {r2}, int64[::1], float64[::1], {m}, {m4}, {m4}, {m4}, {f}[:, :, :], {r2}, {t2}, "
            f"{r1}, int64[::1])"
        ),
        "incoming": f"void({m}, {m}, {i2}, {t2}, {m}, {m}, {m})",
        "eigh": f"void({J}, float64, {r2}, {J})",  # C-contiguous batches (the array code's)
        # flat views of states and offsets of their observed entries (int64 offsets above 2^31 entries)
        "born_logp": f"void({c}[::1], int32[::1], {f}, {f}, float64[::1])",
        "born_add": f"void({c}[::1], int32[::1], {c}[::1], int32[::1], {f}, {f}, {f})",
    }


def block_kernel_signatures(K: int, dtype: str) -> dict[str, str]:
    """Signature strings of the block-per-agent kernels of :func:`make_block_kernels` (the same as one
    thread per agent) and of the GEMM-path row kernel (``rows``, :func:`make_gemm_row_kernel`)."""
    sigs = kernel_signatures(K, dtype)
    f = "float32" if np.dtype(dtype) == np.float32 else "float64"
    rows = f"void({f}[:, ::1], {f}[::1], int64, {f}[::1], {f}[::1])"
    return {
        "rows": rows,
        "prep": sigs["prep"],
        "self_kl": sigs["self_kl"],
        "features": sigs["features"],
        "adjoint": sigs["adjoint"],
    }
