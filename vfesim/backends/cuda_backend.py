"""CUDA backend: CuPy-resident arrays and numba.cuda kernels (SPEC §2.3–2.4, §4).

Arrays in and out are CuPy arrays; under the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the same
code path runs on NumPy arrays. One evaluation is about a dozen launches: input copies into cached
device buffers, self KL, frames + features, three dense pairwise kernels (or two sparse ones), one
adjoint kernel, and a single device-to-host transfer of the energy sums. Buffers are allocated once
per (N, K, dtype, irreps, neighbours) and wrapped once as numba device views (cheaper launches).

For K >= LARGE_K the per-agent kernels run one thread block per agent and dense pairs run as cuBLAS
GEMMs plus one row kernel (about the same number of launches).

The energy is assembled by the one assembly of :mod:`vfesim.gaussian.energy`; this backend supplies its
stages (:class:`FusedStages`: both alignment terms per launch, energies kept on the device until one
transfer) and its pair kernels. Where the block kernels' matrices do not fit in shared memory, the
array-generic stages run on CuPy arrays with the device GEMM and sparse pair kernels. The observation
term (rare, cheap) is array-generic code in the assembly. Kernels: :mod:`vfesim_kernels.cuda`.

Field agents: the array-generic Gaussian per-agent stages on CuPy arrays over the covered (point,
agent) rows, and the weighted pairs batched over grid points in the kernels of
:func:`vfesim_kernels.cuda.make_points_kernels` (:func:`_pairwise_points`).

Density-matrix agents run the one assembly of :mod:`vfesim.quantum.energy` with the per-agent kernels
of :func:`vfesim_kernels.cuda.make_quantum_kernels` (Jacobi eigensolver, Daleckii–Krein adjoints; one
thread per agent) and this backend's family-free pair functions: dense pairs of short feature rows
(D <= STREAM_MAX_D, e.g. D = 16 at d = 4) in the streaming kernels, longer ones as row-blocked GEMMs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
from vfesim_kernels import cuda as kc
from vfesim_kernels import kernel_cache_dir
from vfesim_kernels.cuda.launch import launch as _launch
from vfesim_kernels.pairwise_cpu import incoming_csr, range_error

from ..arrays import device_constant, host_array, host_floats
from ..config import ModelConfig
from ..gaussian.energy import NUMPY_AGENT_OPS, StagedStages
from ..groups import generators
from ..pairwise.gemm import pairwise_dense_gemm, pairwise_gemm
from ..quantum.config import QuantumConfig
from ..quantum.energy import NUMPY_OPS
from ..quantum.kernel_ops import jacobi_tol2, kernel_ops, sized_ops
from ..quantum.linalg import EIGENSOLVERS, herm
from . import Backend

__all__ = [
    "BACKEND",
    "SIMULATOR",
    "array_module",
    "to_device",
    "to_host",
    "energy_and_gradient",
    "clear_cache",
]

SIMULATOR = kc.SIMULATOR
log = logging.getLogger("vfesim")

# Workspaces kept alive; one at N = 10^6, K = 3 in float64 is ~0.5 GB.
MAX_WORKSPACES = 2
# From this K on, per-agent work runs in block-per-agent kernels (kc.make_block_kernels; the batched
# CuPy array code where their shared matrices do not fit) and dense pairs as row-blocked cuBLAS GEMMs
# with one row kernel (vfesim.pairwise.gemm). Measured on the H200 at K = 21 (benchmarks/results/gpu_bench_*):
# the one-thread-per-agent kernels keep 6 K x K matrices per thread in local memory, which thrashes L1,
# and the streaming pairwise kernel re-reads its (2, D = 253) per-thread rows from local memory per pair.
# float32, K = 21: kernels 74 ms (N = 1024) and 162 ms (N = 4096); batched CuPy path 7.5 ms and 14 ms;
# block kernels + GEMMs 1.15 ms (N = 1024). At K = 3 the thread-per-agent kernels win (their per-thread
# arrays stay in registers).
LARGE_K = 9
# Dense pairs of feature rows up to this width run in the streaming kernels (no N x N slab in memory),
# longer ones as GEMMs (vfesim.pairwise.gemm). Measured on an H100 at N = 65 536 (density-matrix agents,
# benchmarks/results/quantum_cuda_h100.log): D = 16 streaming 37 ms (float32) / 104 ms (float64) against
# GEMMs ~90 / ~115 ms; D = 64 streaming 197 / 2048 ms (per-thread rows spill to local memory).
STREAM_MAX_D = 16
# Register cap of the block-per-agent kernels (None: the compiler's choice).
BLOCK_MAX_REGISTERS = None


def array_module():
    """CuPy on a GPU; NumPy under the CUDA simulator (kernels then take host arrays)."""
    if SIMULATOR:
        return np
    import cupy

    return cupy


def to_device(arrays: dict) -> dict:
    """NumPy -> device arrays (CuPy; NumPy under the simulator)."""
    xp = array_module()
    return {k: xp.asarray(v) for k, v in arrays.items()}


def to_host(arrays: dict) -> dict:
    """Device arrays -> NumPy."""
    return {k: v if isinstance(v, np.ndarray) else v.get() for k, v in arrays.items()}


class FirstUse:
    """Announces (log INFO) the first use in a process of each set of CUDA kernels, and how it went: a
    first compilation takes seconds, a later process loads the kernels from the disk cache."""

    def __init__(self):
        self.seen: set = set()

    def begin(self, key, what) -> tuple[str, float] | None:
        """Announce the kernels ``key`` at their first use (``what``: their description, or a function
        making it: made only then)."""
        if SIMULATOR or key in self.seen:
            return None
        self.seen.add(key)
        what = what() if callable(what) else what
        log.info("preparing CUDA kernels: %s (compiled once, cached in %s)", what, kernel_cache_dir())
        return what, time.perf_counter()

    @staticmethod
    def end(token: tuple[str, float] | None, *kernel_sets: dict) -> None:
        if token is None:
            return
        compiled, loaded = kc.compile_report(*kernel_sets)
        log.info(
            "CUDA kernels ready in %.1f s: %s (%d compiled, %d loaded from the cache)",
            time.perf_counter() - token[1], token[0], compiled, loaded,
        )  # fmt: skip


FIRST_USE = FirstUse()


class _Plan(list):
    """Compile-ahead jobs (:class:`vfesim_kernels.cuda.ahead.Job`) in launch-cost order."""

    def add(self, module, factory: str, args: tuple, sigs: dict, *names: str) -> None:
        self.extend(kc.ahead.Job(module.__name__, factory, args, n, sigs[n]) for n in names)

    def pairs(self, D: int, dt: str, aggregator: str, dense: bool, streaming: bool) -> None:
        """The pair kernels over feature rows of width D: sparse lists, dense streaming, or the GEMM
        path's row kernel."""
        sigs = kc.kernel_signatures(1, dt)  # (the pair kernels' signatures hold no K)
        if not dense:
            self.add(kc.pairwise, "make_sparse_kernels", (D, dt, aggregator), sigs, "rows", "senders")
        elif streaming:
            args = (D, dt, aggregator)
            self.add(kc.pairwise, "make_dense_kernels", args, sigs, "grads", "stats", "merge")
        else:
            rows = kc.block_kernel_signatures(1, dt)
            self.add(kc.pairwise, "make_gemm_row_kernel", (dt, aggregator), rows, "rows")

    def reductions(self, dt: str) -> None:
        """Sums (first pass over ``dt``, second over float64) and max |x| of ``dt`` arrays."""
        for f in dict.fromkeys((dt, "float64")):
            self.add(kc.reduce, "make_reduce_kernels", (), kc.reduce.reduce_signatures(f), "partial_sum")
        rsigs = kc.reduce.reduce_signatures(dt)
        self.add(kc.reduce, "make_reduce_kernels", (), rsigs, "partial_max_abs", "final_max_abs")


def gaussian_jobs(K: int, dtype: str, aggregator: str, dense: bool) -> list:
    """The kernels (:class:`vfesim_kernels.cuda.ahead.Job`) a first Gaussian evaluation of latent
    dimension K in ``dtype`` launches, with its state checks, reductions and the integrators' update
    kernels, the costliest first (K = 3, float32, compiled by 8 processes at once on an H100 host,
    benchmarks/results/gpu_cold_h100_stop29.txt: gradient_flow 4.3 s, prep 3.7, adjoint 3.5, kick_drift
    2.7, state check 2.2, self_kl 2.2, the dense pair kernels 0.7-2.1, features 1.1, the rest below 0.5)."""
    from vfesim_kernels import update_cuda as uc

    dt = np.dtype(dtype).name
    mode = _mode(K, np.dtype(dtype))
    plan = _Plan()
    sigs, usigs = kc.kernel_signatures(K, dt), uc.kernel_signatures(dt)
    agent = {
        "kernels": ("make_agent_kernels", (K, dt), sigs),
        "block": ("make_block_kernels", (K, dt, BLOCK_MAX_REGISTERS), kc.block_kernel_signatures(K, dt)),
    }.get(mode)  # "batched": CuPy array code
    if agent:
        plan.add(kc.gaussian, *agent, "adjoint")
    plan.add(uc, "make_update_kernels", (K,), usigs, "gradient_flow")
    if agent:
        plan.add(kc.gaussian, *agent, "prep")
    plan.add(uc, "make_update_kernels", (K,), usigs, "kick_drift")
    plan.add(kc.checks, "make_check_kernels", (K, dt, K >= kc.checks.WARP_FROM_K), sigs, "state")
    if agent:
        plan.add(kc.gaussian, *agent, "self_kl")
    plan.pairs(kc.feature_dim(K), dt, aggregator, dense, streaming=mode == "kernels")
    if agent:
        plan.add(kc.gaussian, *agent, "features")
    plan.add(uc, "make_update_kernels", (K,), usigs, "adam", "theta_to_sigma")
    plan.reductions(dt)
    return plan


def quantum_jobs(d: int, dtype: str, aggregator: str, dense: bool) -> list:
    """The kernels a first density-matrix free energy of d x d states in complex ``dtype`` launches: the
    per-agent stages, the pair kernels over the d^2 Hermitian coordinates, the reductions (the rollouts'
    channel-step kernels compile at their first launch)."""
    cdt = np.dtype(dtype).name
    rdt = np.finfo(np.dtype(dtype)).dtype.name
    plan = _Plan()
    stages = ("energy_backward", "energy_prep", "energy_features")
    if d >= kc.eigh.COOP_MIN_D:  # the forward's eigen-decompositions as one cooperative eigh launch
        stages = ("energy_backward", "eigh", "energy_mats", "energy_finish", "energy_features")
    plan.add(kc.quantum, "make_quantum_kernels", (d, cdt), kc.quantum_kernel_signatures(cdt), *stages)
    streaming = d * d <= STREAM_MAX_D
    plan.pairs(d * d, rdt, aggregator, dense, streaming=streaming)
    if dense and streaming:  # the sender slices' sum (_dense_grads)
        plan.add(kc.reduce, "make_reduce_kernels", (), kc.reduce.reduce_signatures(rdt), "fold")
    plan.reductions(rdt)
    return plan


_PREPARED: set = set()
_REAL = (np.dtype(np.float32), np.dtype(np.float64))
_COMPLEX = (np.dtype(np.complex64), np.dtype(np.complex128))


def prepare(arrays: dict, cfg, *, stepping: bool = False) -> None:
    """Get the kernels a first evaluation of ``cfg`` on ``arrays`` and an integrator's steps will launch
    ready before they do: the ones the disk cache lacks compile in parallel processes
    (:func:`vfesim_kernels.cuda.ahead.compile_ahead`). Once per configuration and process; Gaussian and
    density-matrix agents (field agents compile at first launch). Called by
    :func:`vfesim.energy_and_gradient` (which waits only for the energy's kernels: the integrators'
    update kernels go on compiling in the workers) and by the device integrators (``stepping``: they
    wait for those too); ``energy_and_gradient_arrays`` and the dask backend's chunk tasks do not call
    it (their kernels compile at first launch, or load from the cache)."""
    if SIMULATOR:
        return
    if isinstance(cfg, ModelConfig) and np.dtype(getattr(arrays.get("mu_q"), "dtype", object)) in _REAL:
        key = ("gaussian", cfg.K, np.dtype(arrays["mu_q"].dtype).name, cfg.aggregator, cfg.dense)
    elif isinstance(cfg, QuantumConfig) and np.dtype(getattr(arrays.get("rho"), "dtype", object)) in _COMPLEX:
        rho = arrays["rho"]
        if rho.ndim != 3 or not 2 <= rho.shape[-1] <= QUANTUM_KERNEL_MAX_D:  # (the state checks name it)
            return
        key = ("quantum", rho.shape[-1], np.dtype(rho.dtype).name, cfg.aggregator, cfg.dense)
    else:  # other families, or a dtype the state checks refuse
        return
    if key in _PREPARED:
        if stepping:  # the update kernels an energy's call left compiling
            kc.ahead.finish()
        return
    _PREPARED.add(key)
    jobs = (gaussian_jobs if key[0] == "gaussian" else quantum_jobs)(*key[1:])
    later = [] if stepping else [job for job in jobs if job.factory == "make_update_kernels"]
    report = kc.ahead.compile_ahead(jobs, later=later)
    if report["compiled"] or report["later"]:
        log.info(
            "CUDA kernels compiled ahead in %.1f s: %d in %d processes, %d loaded from the cache%s",
            report["seconds"], report["compiled"], report["workers"], report["loaded"],
            f"; {report['later']} integrator kernels still compiling" if report["later"] else "",
        )  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Workspace:
    """Device buffers of one problem shape, each held as an array and as a numba device view."""

    def __init__(
        self,
        N: int,
        K: int,
        dtype: np.dtype,
        irreps: tuple[int, ...],
        width: int | None,
        mode: str,
        pairs: bool = True,
    ):
        xp = array_module()
        D = kc.feature_dim(K)
        self.N, self.K, self.dtype, self.dense = N, K, dtype, width is None
        # Dense pairs: sender slices of the streaming kernels; the GEMM path (large K) has one slice, and
        # so has a workspace whose pairs are given (``pairs`` False: no pair kernel writes into it).
        streaming = self.dense and mode == "kernels" and pairs
        # per slice and agent: two terms' gAr (D + 1), gBs (D), pm, ps, pt and, for "expected", gAx (D + 1)
        row_bytes = 2 * (3 * D + 5) * np.dtype(dtype).itemsize
        nt, per_block = kc.dense_layout(D, dtype)
        self.S, self.chunk = kc.dense_splits(N, N, row_bytes, per_block, nt) if streaming else (1, 0)
        self.buf: dict[str, Any] = {}
        self.dev: dict[str, Any] = {}
        shapes = {
            "mu": (2, N, K),
            "sigma": (2, N, K, K),
            "phi": (N, 3),
            "G": (3, K, K),
            "R": (N, K, K),
            "lam": (2, N, K, K),
            "P": (2, N, K, K),
            "nu": (2, N, K),
            "nuc": (2, N, K),
            "Pnu": (2, N, K),
            "nubar": (2, K),
            "ld": (2, N),
            "A": (2, N, D),
            "B": (2, N, D),
            "c": (2, N),
            "e_self": (N,),
            "m": (2, N),
            "inv_s": (2, N),
            "abar": (2, N),
            "energy": (2, N),
            "gAr": (self.S, 2, N, D + 1),
            "gBs": (self.S, 2, N, D),
            "g_mu": (2, N, K),
            "g_sigma": (2, N, K, K),
            "g_phi": (N, 3),
            "kappa": (2,),
            "feat_scale": (2,),
            "lam_w": (2,),
        }
        if streaming:
            shapes |= {k: (self.S, 2, N) for k in ("pm", "ps", "pt")}
        elif not self.dense:
            shapes["W"] = (2, N, width)
        for name, shape in shapes.items():
            a = xp.zeros(shape, dtype)
            self.buf[name] = a
            self.dev[name] = kc.as_device_view(a)
        # The receiver sums, complete in slice 0 (the streaming kernels' merge sums the slices into it).
        self.dev["gAr0"] = kc.as_device_view(self.buf["gAr"][:1])
        self.buf["G"][...] = xp.asarray(generators(irreps), dtype=dtype)
        self.params: tuple | None = None

    def expected_sums(self, aggregator: str):
        """The streaming kernels' second receiver sums (``gAx``, the ``expected`` aggregator only; a
        one-element placeholder otherwise), allocated at first use."""
        shape = (self.S, 2, self.N, kc.feature_dim(self.K) + 1) if aggregator == "expected" else (1, 1, 1, 1)
        if self.buf.get("gAx") is None or self.buf["gAx"].shape != shape:
            self.buf["gAx"] = array_module().zeros(shape, self.dtype)
            self.dev["gAx"] = kc.as_device_view(self.buf["gAx"])
        return self.dev["gAx"]

    def set_params(self, cfg: ModelConfig) -> None:
        """Upload kappa, 1/(2 kappa) and lambda of both alignment terms when they changed."""
        p = (cfg.kappa_beta, cfg.kappa_gamma, cfg.lambda_belief, cfg.lambda_prior)
        if p == self.params:
            return
        xp = array_module()
        self.buf["kappa"][...] = xp.asarray(p[:2], dtype=self.dtype)
        self.buf["feat_scale"][...] = xp.asarray([0.5 / p[0], 0.5 / p[1]], dtype=self.dtype)
        self.buf["lam_w"][...] = xp.asarray(p[2:], dtype=self.dtype)
        self.params = p


class _Neighbours:
    """Sparse neighbour lists (n_r, k) into ``n_senders`` sender rows on the device, with their transpose
    (incoming edges per sender, :func:`_incoming`). Built once per list object (see :data:`_neighbours`)."""

    def __init__(self, index, mask, n_senders: int):
        xp = array_module()
        # Writable copies: the config holds read-only arrays (the simulator writes kernel arguments back).
        index = np.array(index, dtype=np.int64, order="C")
        mask = np.array(mask, dtype=bool, order="C")
        if index.ndim != 2 or mask.shape != index.shape:
            raise ValueError(f"index/mask: expected two (n, k) arrays, got {index.shape} and {mask.shape}")
        listed = index[mask]
        if listed.size and not (0 <= listed.min() and listed.max() < n_senders):
            raise ValueError(f"index: listed senders must be rows 0 .. {n_senders - 1}")
        host = {"index": index, "mask": mask, **_incoming(index, mask, n_senders)}
        self.buf = {k: xp.asarray(v) for k, v in host.items()}
        self.dev = {k: kc.as_device_view(v) for k, v in self.buf.items()}
        self.width = index.shape[1]


_workspaces: OrderedDict = OrderedDict()
# Device lists, keyed by the identity of the host list objects (a config's lists; each entry keeps them,
# so their ids cannot be reused meanwhile) or by a name the caller gives (a dask plan's receiver chunk), so
# that each chunk's lists and their transpose reach its GPU once per run, not once per evaluation. List
# arrays are not modified in place (configs hold read-only ones). Up to MAX_LISTS entries (a GPU serving
# more receiver chunks than that transposes their lists again at every evaluation).
_neighbours: OrderedDict = OrderedDict()
MAX_LISTS = 16
_LOCK = threading.RLock()  # the caches are shared by the scheduler's threads


def clear_cache() -> None:
    """Drop the cached device buffers."""
    _workspaces.clear()
    _neighbours.clear()
    _points_layouts.clear()


def _lru(cache: OrderedDict, key, make, limit: int = MAX_WORKSPACES):
    with _LOCK:  # lookups, inserts and evictions of the scheduler's threads one at a time
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        value = make()
        cache[key] = value
        while len(cache) > limit:
            cache.popitem(last=False)
        return value


def _neighbour_lists(nb) -> _Neighbours:
    # Keyed by identity; the config object is kept in the entry so its id cannot be reused meanwhile.
    n = nb.index.shape[0]
    return _lru(_neighbours, id(nb), lambda: (nb, _Neighbours(nb.index, nb.mask, n)), MAX_LISTS)[1]


def _check_arrays(arrays: dict, cfg: ModelConfig, xp) -> np.dtype:
    mu = arrays["mu_q"]
    dtype = np.dtype(mu.dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"backend 'cuda': arrays must be float32 or float64, got {dtype}")
    for k, v in arrays.items():
        if xp is not np and not isinstance(v, xp.ndarray):
            raise TypeError(
                f"backend 'cuda': {k} must be a CuPy array (use to_device), got {type(v).__name__}"
            )
        if v.dtype != dtype:
            raise TypeError(f"backend 'cuda': {k} has dtype {v.dtype}, expected {dtype} like mu_q")
    if mu.shape[1] != cfg.K:
        raise ValueError(f"backend 'cuda': mu_q has K={mu.shape[1]}, config has K={cfg.K}")
    return dtype


def _mode(K: int, dtype: np.dtype) -> str:
    """Per-agent code path: "kernels" (one thread per agent, K < LARGE_K), "block" (one thread block
    per agent, dense pairs by GEMMs) or "batched" (CuPy array code, where the block kernels' shared
    matrices do not fit)."""
    if K < LARGE_K:
        return "kernels"
    return "block" if kc.block_kernels_fit(K, dtype) else "batched"


class FusedStages:
    """The Gaussian per-agent stages of one evaluation in fused device kernels (the stages protocol of
    :class:`vfesim.gaussian.energy.StagedStages`, run by the one assembly of :mod:`vfesim.gaussian.energy`).

    Inputs are copied into cached workspace buffers; gradients accumulate in the workspace (``grads`` are
    views of it); both alignment terms share each launch (a term axis); energies stay on the device until
    :meth:`collect` fetches them with one transfer.

    A chunk of a population (the dask backend, :func:`chunk_stages`) gives ``centre`` (mean variable ->
    (K,), the population's mean of nu, instead of the agents' own) and ``given_pairs``: the pairs of each
    term then come from the assembly's pairwise function (the chunk's recorded or replayed pair results,
    in the contract of :func:`vfesim.pairwise.pairwise_dense`) instead of the device's pair kernels.
    """

    def __init__(
        self,
        arrays: dict,
        cfg: ModelConfig,
        dtype: np.dtype,
        mode: str,
        centre: dict | None = None,
        given_pairs: bool = False,
    ):
        xp = array_module()
        N, K = arrays["mu_q"].shape
        width = None if cfg.dense else cfg.neighbours.width
        if given_pairs and width is not None:
            raise ValueError("given_pairs: the pairs of a chunk come with dense-neighbour configs only")
        key = (N, K, dtype.str, cfg.irreps, width, mode, given_pairs)
        make = lambda: _Workspace(N, K, dtype, cfg.irreps, width, mode, not given_pairs)  # noqa: E731
        self.ws = ws = _lru(_workspaces, key, make)
        self.cfg, self.dtype, self.N, self.K, self.xp = cfg, dtype, N, K, xp
        self.centre, self.given_pairs = centre, given_pairs
        b = ws.buf
        b["mu"][0] = arrays["mu_q"]
        b["mu"][1] = arrays["mu_p"]
        b["sigma"][0] = arrays["sigma_q"]
        b["sigma"][1] = arrays["sigma_p"]
        b["phi"][...] = arrays["phi"]
        for g in ("g_mu", "g_sigma", "g_phi"):
            b[g].fill(0)
        ws.set_params(cfg)
        self.jitter = dtype.type(cfg.jitter)
        self.block = mode == "block"
        self.nblk = _cdiv(N, kc.BLOCK)
        # One source, two launch shapes: a thread block per agent (large K) or a thread per agent.
        if self.block:
            self.kern = kc.make_block_kernels(K, dtype.name, BLOCK_MAX_REGISTERS)
            self.per_agent, self.nt = (N, kc.block_threads(K)), kc.block_threads(K)
        else:
            self.kern = kc.make_agent_kernels(K, dtype.name)
            self.per_agent, self.nt = (self.nblk, kc.BLOCK), kc.BLOCK
        self.pair_kern: dict = {}
        pairs = "dense" if width is None else "sparse"
        what = f"gaussian agents, K={K}, {dtype.name}, {pairs} pairs ({cfg.aggregator})"
        self.first_use = FIRST_USE.begin((key, cfg.aggregator), what)
        self.grads = {
            "mu_q": b["g_mu"][0],
            "sigma_q": b["g_sigma"][0],
            "mu_p": b["g_mu"][1],
            "sigma_p": b["g_sigma"][1],
            "phi": b["g_phi"],
        }
        if "obs" in arrays:
            self.grads["obs"] = xp.zeros_like(arrays["obs"])

    @staticmethod
    def total(e):
        return kc.reduce.device_sum(e)

    def self_term(self, lam: float):
        d = self.ws.dev
        _launch(
            self.kern["self_kl"],
            *self.per_agent,
            d["mu"],
            d["sigma"],
            self.jitter,
            self.dtype.type(lam),
            d["e_self"],
            d["g_mu"],
            d["g_sigma"],
        )
        return kc.reduce.device_sum(self.ws.buf["e_self"])

    def alignment(self, active, pairwise_dense=None, pairwise_sparse=None, neighbours=None) -> list:
        """Both alignment terms through the same launches (the device's own pair kernels run them, or
        with ``given_pairs`` the assembly's ``pairwise_dense``; otherwise the assembly's pairwise functions
        serve the staged path)."""
        cfg, ws, kern, N, K = self.cfg, self.ws, self.kern, self.N, self.K
        b, d, dt = ws.buf, ws.dev, self.dtype.name
        terms = [("belief_align", "prior_align").index(a[0]) for a in active]  # slots, ascending
        f0, nf = terms[0], len(terms)
        nblk, blk = self.nblk, kc.BLOCK
        _launch(kern["prep"], *self.per_agent,
            d["phi"], d["G"], max(cfg.irreps), d["mu"], d["sigma"], self.jitter, f0, nf,
            d["R"], d["lam"], d["P"], d["nu"], d["ld"],
        )  # fmt: skip
        # Centre the means on the population mean of nu (see vfesim.gaussian.features).
        if self.centre is None:
            b["nubar"][f0 : f0 + nf] = b["nu"][f0 : f0 + nf].mean(axis=1)
        else:
            for f in terms:
                b["nubar"][f] = self.xp.asarray(self.centre[("mu_q", "mu_p")[f]], dtype=self.dtype)
        grid = (N, nf) if self.block else (nblk, nf)
        _launch(kern["features"], grid, self.nt,
            d["lam"], d["P"], d["nu"], d["nubar"], d["ld"], d["feat_scale"], f0,
            d["A"], d["B"], d["c"], d["nuc"], d["Pnu"],
        )  # fmt: skip
        D = kc.feature_dim(K)
        if self.given_pairs:
            given = self._given_pairs(terms, active, pairwise_dense)
        elif ws.dense and self.block:
            for f in terms:
                # Features hold A / (2 kappa) and c / (2 kappa): logits -KL / kappa, energies / kappa.
                pairwise_gemm(
                    b["A"][f], b["B"][f], b["c"][f], cfg.aggregator,
                    out=(b["energy"][f], b["gAr"][0, f, :, :-1], b["gAr"][0, f, :, -1], b["gBs"][0, f]),
                )  # fmt: skip
                b["energy"][f] *= b["kappa"][f]
        elif ws.dense:
            k = self.pair_kern = kc.make_dense_kernels(D, dt, cfg.aggregator)
            nt = k["threads"]
            nb = _cdiv(N, k["per_block"])
            gAx = ws.expected_sums(cfg.aggregator)
            _launch(
                k["stats"],
                (nb, ws.S, nf),
                nt,
                d["A"],
                d["B"],
                d["c"],
                self.dtype.type(1.0),  # (the workspace's features come scaled)
                0,
                f0,
                ws.chunk,
                d["pm"],
                d["ps"],
                d["pt"],
                d["gAr"],
                gAx,
            )
            _launch(k["merge"], (kc.merge_blocks(N, D), nf), blk,
                d["pm"], d["ps"], d["pt"], d["kappa"], f0, d["m"], d["inv_s"], d["abar"], d["energy"],
                d["gAr"], gAx,
            )  # fmt: skip
            _launch(
                k["grads"],
                (nb, ws.S, nf),
                nt,
                d["A"],
                d["B"],
                d["c"],
                self.dtype.type(1.0),
                d["m"],
                d["inv_s"],
                d["abar"],
                0,
                f0,
                ws.chunk,
                d["gBs"],
            )
        else:
            k = self.pair_kern = kc.make_sparse_kernels(D, dt, cfg.aggregator)
            nbr = _neighbour_lists(cfg.neighbours).dev
            _launch(k["rows"], (nblk, nf), blk,
                d["A"], d["B"], d["c"], nbr["index"], nbr["mask"], d["kappa"], f0,
                d["W"], d["energy"], d["gAr"],
            )  # fmt: skip
            _launch(
                k["senders"],
                (nblk, nf),
                blk,
                d["A"],
                d["W"],
                nbr["ptr"],
                nbr["row"],
                nbr["slot"],
                f0,
                d["gBs"],
            )
        _launch(kern["adjoint"], *self.per_agent,
            d["phi"], d["G"], d["R"], d["mu"], d["sigma"], self.jitter, d["nuc"], d["P"], d["Pnu"],
            d["gAr0"], d["gBs"], d["lam_w"], d["kappa"], f0, nf, d["g_mu"], d["g_sigma"], d["g_phi"],
        )  # fmt: skip
        if self.given_pairs:
            as_value = lambda E: self.xp.asarray(E, dtype=np.float64)  # noqa: E731 - a device scalar
            return [(name, as_value(lam * E)) for E, (name, lam, *_) in zip(given, active, strict=True)]
        return [
            (name, lam * kc.reduce.device_sum(b["energy"][f]))
            for f, (name, lam, *_) in zip(terms, active, strict=True)
        ]

    def _given_pairs(self, terms: list, active, pairwise) -> list:
        """Each term's pairs from ``pairwise`` (contract of :func:`vfesim.pairwise.pairwise_dense`) on its
        features, written into the workspace as the device's pair kernels write them: the kernels hold
        A / (2 kappa), c / (2 kappa) and B, and return gAr = [sum_j W_ij B_j, sum_j W_ij] (= 2 [gA, gc])
        and gBs = sum_i W_ij A_i / (2 kappa) (= gB / kappa). Returns the terms' energies."""
        b, energies = self.ws.buf, []
        for f, (_, _, kappa, *_) in zip(terms, active, strict=True):
            scale = 2.0 * kappa
            # Fresh arrays: the workspace is reused by the next evaluation of this size.
            A, B, c = b["A"][f] * scale, b["B"][f].copy(), b["c"][f] * scale
            E, gA, gB, gc = pairwise(A, B, c, kappa, self.cfg.aggregator)
            b["gAr"][0, f, :, :-1] = 2 * gA
            b["gAr"][0, f, :, -1] = 2 * gc
            b["gBs"][0, f] = gB / kappa  # (a given-pairs workspace has one slice: S = 1)
            energies.append(E)
        return energies

    def collect(self, values: list) -> dict[str, float]:
        """Energy values from device scalars with one device-to-host transfer (and synchronisation)."""
        if not values:
            return {}
        host = host_floats(dict(values))
        FIRST_USE.end(self.first_use, self.kern, self.pair_kern)
        self.first_use = None
        return host

    def result(self) -> dict:
        """Fresh copies of the gradients (the workspace is reused by the next evaluation)."""
        return {k: v.copy() if k != "obs" else v for k, v in self.grads.items()}


def _stages(arrays: dict, cfg: ModelConfig, S: dict):
    """The stages of one evaluation: fused kernels, or (K >= LARGE_K whose block kernels' shared matrices do
    not fit) the staged array code on CuPy arrays with the device pair kernels."""
    dtype = _check_arrays(arrays, cfg, array_module())
    mode = _mode(arrays["mu_q"].shape[1], dtype)
    if mode == "batched":
        return StagedStages(NUMPY_AGENT_OPS, arrays, cfg, S)
    return FusedStages(arrays, cfg, dtype, mode)


def chunk_stages(centre: dict, arrays: dict, cfg: ModelConfig, S: dict):
    """The Gaussian stages of one chunk of a population on the device (the dask backend's tasks with
    inner "cuda"): the fused kernels centred on the population's ``centre`` (mean variable -> (K,)), with
    each term's pairs from the assembly's pairwise function; the staged array code with that centre where
    the fused kernels do not fit."""
    dtype = _check_arrays(arrays, cfg, array_module())
    mode = _mode(arrays["mu_q"].shape[1], dtype)
    if mode == "batched":
        from ..gaussian.chunks import chunk_agent_ops

        xp = array_module()  # the centre beside the chunk's arrays
        return StagedStages(chunk_agent_ops({k: xp.asarray(v) for k, v in centre.items()}), arrays, cfg, S)
    return FusedStages(arrays, cfg, dtype, mode, centre=centre, given_pairs=True)


# Per family, the stages of a population's chunk given the population's centre (dask_backend.POPULATION).
CHUNK_STAGES = {"gaussian": chunk_stages}


def energy_and_gradient(arrays: dict, cfg: ModelConfig) -> tuple[dict[str, float], dict]:
    """Energy terms (floats) and the exact gradient (device arrays, fresh copies) of SPEC §2.2.

    arrays: mu_q, mu_p (N, K); sigma_q, sigma_p (N, K, K); phi (N, 3); obs (N, D) if present.
    """
    return BACKEND.energy_and_gradient(arrays, cfg)


def _device_updates(K: int):
    """The device-resident integrator operations (fused CUDA update kernels and the on-device guard)."""
    from ..integrators.device import Device

    return Device(K)


def _pairwise_sparse(A, B, c, index, mask, kappa: float, aggregator: str):
    """Sparse pairs (the contract of :func:`vfesim.pairwise.pairwise_sparse`) in the sparse kernels, E as
    a 0-d device array (no synchronisation)."""
    xp = array_module()
    N, D = A.shape
    dt = A.dtype
    scale = dt.type(0.5 / kappa)
    host = host_array
    # Keyed by identity like _neighbour_lists (the assembly passes the config's arrays every call); the
    # entry keeps the arrays, so their ids cannot be reused meanwhile.
    make = lambda: ((index, mask), _Neighbours(host(index), host(mask), N))
    nbr = _lru(_neighbours, (id(index), id(mask)), make, MAX_LISTS)[1].dev
    k = kc.make_sparse_kernels(D, dt.name, aggregator)
    Ah, Bb, ch = (xp.ascontiguousarray(a[None]) for a in (A * scale, B, c * scale))
    W = xp.zeros((1, N, index.shape[1]), dt)
    energy = xp.zeros((1, N), dt)
    gAr = xp.zeros((1, 1, N, D + 1), dt)
    gBs = xp.zeros((1, 1, N, D), dt)
    kap = _unit_kappa(xp, dt)
    nblk = _cdiv(N, kc.BLOCK)
    _launch(k["rows"], (nblk, 1), kc.BLOCK, Ah, Bb, ch, nbr["index"], nbr["mask"], kap, 0, W, energy, gAr)
    _launch(k["senders"], (nblk, 1), kc.BLOCK, Ah, W, nbr["ptr"], nbr["row"], nbr["slot"], 0, gBs)
    E = kc.reduce.device_sum(energy[0]) * kappa
    return E, 0.5 * gAr[0, 0, :, :-1], kappa * gBs[0, 0], 0.5 * gAr[0, 0, :, -1]


def _unit_kappa(xp, dt):
    """A one-entry kappa of 1 in ``dt`` (the pair kernels read it), made once per device."""
    return device_constant(xp, ("unit kappa", np.dtype(dt).str), lambda: xp.ones(1, dt))


def _dense_stats(Ah, Bb, ch, scale, r0: int, aggregator: str, splits: int | None = None):
    """The receiver pass of the streaming kernels (``stats`` then ``merge``) on features Ah, Bb, ch (1, n,
    D), the receivers' Ah and ch scaled by ``scale`` (1 / (2 kappa), :func:`_kernel_rows`; the kernels
    scale them as they load them, vfesim_kernels.cuda.pairwise), receivers r0 .. r0 + n_r - 1 against
    all senders: (row energies / kappa, sum_j W_ij B_j, sum_j W_ij, m, inv_s, abar), each (n_r, ...) in the
    dtype, the first three summed over sender slices in slice order. ``splits``: the number of sender
    slices (default: :func:`vfesim_kernels.cuda.dense_splits`)."""
    xp = array_module()
    NR, D = Ah.shape[1:]
    N = Bb.shape[1]
    dt = Ah.dtype
    k = kc.make_dense_kernels(D, dt.name, aggregator)
    nt = k["threads"]
    if splits is None:
        per_row = (D + 4 + (D + 1) * (aggregator == "expected")) * dt.itemsize  # gAr, pm, ps, pt (, gAx)
        S, chunk_s = kc.dense_splits(NR, N, per_row, k["per_block"], nt)
    else:
        S, chunk_s = kc.dense_slices(N, splits, nt)
    pm, ps, pt = xp.empty((3, S, 1, NR), dt)  # (one allocation per kind: fewer host calls)
    m, inv_s, abar, energy = xp.empty((4, 1, NR), dt)
    gAr = xp.empty((S, 1, NR, D + 1), dt)
    gAx = xp.empty((S, 1, NR, D + 1) if aggregator == "expected" else (1, 1, 1, 1), dt)
    kap = _unit_kappa(xp, dt)
    nb_r = _cdiv(NR, k["per_block"])
    _launch(k["stats"], (nb_r, S, 1), nt, Ah, Bb, ch, scale, r0, 0, chunk_s, pm, ps, pt, gAr, gAx)
    grid = (kc.merge_blocks(NR, D), 1)
    _launch(k["merge"], grid, kc.BLOCK, pm, ps, pt, kap, 0, m, inv_s, abar, energy, gAr, gAx)
    gA = gAr[0, 0]  # (merge summed the slices into slice 0, in slice order)
    return energy[0], gA[:, :-1], gA[:, -1], m, inv_s, abar


def _dense_grads(Ah, Bb, ch, scale, m, inv_s, abar, r0: int, aggregator: str, splits: int | None = None):
    """The sender pass of the streaming kernels (``grads``) on features scaled as in _dense_stats: every
    receiver (rows of Ah, ch (1, n_r, D) with statistics m, inv_s, abar (1, n_r), global index r0 + i)
    against the senders Bb (1, n_s, D), the pair with sender r0 + i excluded (r0 may be negative: -s0
    for senders s0 .. of all agents). Returns sum_i W_ij scale Ah_i (n_s, D) in the dtype, summed over
    receiver slices in slice order. ``splits``: the number of receiver slices (default: enough blocks for
    the senders, :func:`vfesim_kernels.cuda.dense_splits`)."""
    xp = array_module()
    NR, D = Ah.shape[1:]
    NS = Bb.shape[1]
    dt = Ah.dtype
    k = kc.make_dense_kernels(D, dt.name, aggregator)
    nt = k["threads"]
    if splits is None:
        S, chunk_r = kc.dense_splits(NS, NR, D * dt.itemsize, k["per_block"], nt)
    else:
        S, chunk_r = kc.dense_slices(NR, splits, nt)
    gBs = xp.empty((S, 1, NS, D), dt)
    nb_s = _cdiv(NS, k["per_block"])
    _launch(k["grads"], (nb_s, S, 1), nt, Ah, Bb, ch, scale, m, inv_s, abar, r0, 0, chunk_r, gBs)
    return kc.reduce.fold_slices(gBs)[0]  # the slices in order: a fixed summation order


def _kernel_rows(A, c, kappa: float):
    """A, c as C-contiguous (1, n, ...) arrays and their scale 1 / (2 kappa) in the dtype (the kernels'
    logits are -KL / kappa, vfesim_kernels.cuda.pairwise)."""
    xp = array_module()
    return xp.ascontiguousarray(A)[None], xp.ascontiguousarray(c)[None], A.dtype.type(0.5 / kappa)


def _dense_streaming(A_r, c_r, B, r0: int, kappa: float, aggregator: str):
    """Receivers r0 .. r0 + n_r - 1 (features A_r, c_r) against all senders B in the streaming kernels:
    (row energies (n_r,), gA_r, gc_r, gB (N, D)) in the dtype, each sum over slices in slice order."""
    xp = array_module()
    Ah, ch, scale = _kernel_rows(A_r, c_r, kappa)
    Bb = xp.ascontiguousarray(B)[None]
    energy, gA, gc, m, inv_s, abar = _dense_stats(Ah, Bb, ch, scale, r0, aggregator)
    gB = _dense_grads(Ah, Bb, ch, scale, m, inv_s, abar, r0, aggregator)
    # gA = 1/2 sum_j W B_j, gc = 1/2 sum_j W, gB = 1/2 sum_i W A_i = kappa sum_i W Ah_i
    return kappa * energy, 0.5 * gA, 0.5 * gc, kappa * gB


def _pairwise_dense(A, B, c, kappa: float, aggregator: str):
    """Dense pairs (the contract of :func:`vfesim.pairwise.pairwise_dense`) on device arrays: the
    streaming kernels for D <= STREAM_MAX_D (no N x N array; E as a 0-d device array, no
    synchronisation), else row-blocked GEMMs."""
    if A.shape[1] > STREAM_MAX_D:
        return pairwise_dense_gemm(A, B, c, kappa, aggregator)
    erow, gA, gc, gB = _dense_streaming(A, c, B, 0, kappa, aggregator)
    return kc.reduce.device_sum(erow), gA, gB, gc


def pairwise_dense_rows(A_r, c_r, B, r0: int, kappa: float, aggregator: str):
    """One receiver range against all senders on the device (the unit of work of a scheduler task; the
    contract of :func:`vfesim_kernels.pairwise_cpu.pairwise_dense_rows`): receivers r0 .. r0 + n_r - 1
    with features A_r (n_r, D), c_r (n_r,), every sender's B (N, D). Returns (row energies (n_r,)
    float64, gA_r (n_r, D), gc_r (n_r,), gB_part (N, D) float64: these receivers' share of gB)."""
    N, D = B.shape
    NR = A_r.shape[0]
    if not (0 <= r0 and r0 + NR <= N):
        raise ValueError(range_error("receivers", r0, NR, N))
    xp = array_module()
    if N < 2 or NR == 0:
        return xp.zeros(NR), xp.zeros((NR, D), A_r.dtype), xp.zeros(NR, A_r.dtype), xp.zeros((N, D))
    erow, gA, gc, gB = _dense_streaming(A_r, c_r, B, r0, kappa, aggregator)
    return erow.astype(np.float64), gA, gc, gB.astype(np.float64)


def pairwise_dense_receivers(A_r, c_r, B, r0: int, kappa: float, aggregator: str):
    """Pass 1 of the two-pass dense split on the device (the contract of
    :func:`vfesim_kernels.pairwise_cpu.pairwise_dense_receivers`): receivers r0 .. r0 + n_r - 1 (A_r,
    c_r) against every sender B (N, D), the ``stats`` and ``merge`` kernels only. Returns (row energies
    (n_r,) float64, gA_r (n_r, D), gc_r (n_r,), m, inv_s, abar (n_r,) in the dtype). The statistics are
    those of logits -KL / kappa (the kernels' scaling): only :func:`pairwise_dense_senders` reads them."""
    N, D = B.shape
    NR = A_r.shape[0]
    if not (0 <= r0 and r0 + NR <= N):
        raise ValueError(range_error("receivers", r0, NR, N))
    xp = array_module()
    dt = A_r.dtype
    if N < 2 or NR == 0:
        zeros = (xp.zeros(NR, dt) for _ in range(3))
        return xp.zeros(NR), xp.zeros((NR, D), dt), xp.zeros(NR, dt), *zeros
    Ah, ch, scale = _kernel_rows(A_r, c_r, kappa)
    Bb = xp.ascontiguousarray(B)[None]
    energy, gA, gc, m, inv_s, abar = _dense_stats(Ah, Bb, ch, scale, r0, aggregator)
    erow = kappa * energy.astype(np.float64)
    return erow, 0.5 * gA, 0.5 * gc, m[0], inv_s[0], abar[0]


def pairwise_dense_senders(A, c, m, inv_s, abar, B_s, s0: int, kappa: float, aggregator: str):
    """Pass 2 of the two-pass dense split on the device (the contract of
    :func:`vfesim_kernels.pairwise_cpu.pairwise_dense_senders`): gB (n_s, D) float64 of senders s0 ..
    s0 + n_s - 1 (B_s) from every receiver's A (N, D), c (N,) and the statistics of
    :func:`pairwise_dense_receivers`, in the ``grads`` kernel with receiver offset -s0 (receiver i meets
    itself as local sender i - s0)."""
    N, D = A.shape
    NS = B_s.shape[0]
    if not (0 <= s0 and s0 + NS <= N):
        raise ValueError(range_error("senders", s0, NS, N))
    if not (m.shape == inv_s.shape == abar.shape == (N,)):
        raise ValueError(f"row statistics m, inv_s, abar must have shape ({N},) (one per receiver)")
    xp = array_module()
    if N < 2 or NS == 0:
        return xp.zeros((NS, D))
    Ah, ch, scale = _kernel_rows(A, c, kappa)
    stats = (xp.ascontiguousarray(xp.asarray(a, A.dtype)[None]) for a in (m, inv_s, abar))
    gB = _dense_grads(Ah, xp.ascontiguousarray(B_s)[None], ch, scale, *stats, -s0, aggregator)
    return kappa * gB.astype(np.float64)


def _quantum_launch(name: str, N: int, d: int, dtype, *args, modes=None) -> None:
    """Launch density-matrix kernel ``name`` with N threads (vfesim.quantum.kernel_ops): one per agent, or
    per part of an agent's work (``energy_prep``: N = 3 x agents). The channel step's kernels are compiled
    for their ``modes`` (make_quantum_kernels: the other modes' branches compile away)."""
    ks = kc.make_quantum_kernels(d, dtype, modes)
    FIRST_USE.begin(("quantum", d, dtype), lambda: f"density-matrix agents, d={d}, {np.dtype(dtype)}")
    lanes = ks["_lanes"].get(name)  # (threads per item of the cooperative eigensolver)
    if lanes is None:
        _launch(ks[name], _cdiv(N, kc.BLOCK), kc.BLOCK, *args)
    else:
        _launch(ks[name], _cdiv(N * lanes, kc.eigh.COOP_THREADS), kc.eigh.COOP_THREADS, *args)


# One thread per agent up to d = 8 (each matrix in local memory, the agents' arrays agent-minor: a warp's
# accesses coalesce; from d = 6 the eigen-decompositions eight threads per matrix, vfesim_kernels.cuda.eigh);
# above, the batched CuPy stages (cuSOLVER's eigh).
QUANTUM_KERNEL_MAX_D = 8


def batched_eigh(X):
    """(w ascending (..., d), V (..., d, d)) of herm(X) for a device batch X (..., d, d) of complex
    matrices: the ``eigh`` kernel (Jacobi to :func:`jacobi_tol2`, one thread per matrix; eight from
    ``vfesim_kernels.cuda.eigh.COOP_MIN_D``) for d up to QUANTUM_KERNEL_MAX_D, the array module's
    ``linalg.eigh`` (cuSOLVER) otherwise. Registered as the array code's eigensolver of CuPy arrays
    (``vfesim.quantum.linalg.EIGENSOLVERS``)."""
    xp = array_module()
    X = xp.asarray(X)
    d = X.shape[-1]
    if X.ndim < 2 or X.dtype not in _COMPLEX or not 1 < d <= QUANTUM_KERNEL_MAX_D or X.size == 0:
        return xp.linalg.eigh(herm(X))
    batch = X.shape[:-2]
    Xc = xp.ascontiguousarray(X.reshape(-1, d, d))
    n = Xc.shape[0]
    w = xp.empty((n, d), np.finfo(X.dtype).dtype)
    V = xp.empty((n, d, d), X.dtype)
    _quantum_launch("eigh", n, d, X.dtype, Xc, jacobi_tol2(X.dtype), w, V)
    return w.reshape(batch + (d,)), V.reshape(batch + (d, d))


EIGENSOLVERS["cupy"] = batched_eigh
QUANTUM_OPS = sized_ops(
    kernel_ops(
        array_module,
        _quantum_launch,
        (_pairwise_dense, _pairwise_sparse),
        agent_minor=True,
        batched_eigh_from=kc.eigh.COOP_MIN_D,
    ),
    NUMPY_OPS,
    QUANTUM_KERNEL_MAX_D,
)


class _PointsLayout:
    """A batched-pairs layout (see :func:`_pairwise_points`) on the device, with the maps the kernels read:
    each receiver's point, (point, list row) -> receiver row, each sender's point and agent, and the
    reverse index of the neighbour lists (incoming edges per agent, by list row then slot)."""

    def __init__(self, n_r: int, n_s: int, offsets, lists, rowmap, index, mask):
        from vfesim_kernels.pairwise_cpu import check_points

        xp = array_module()
        offsets, lists, rowmap = (np.asarray(host_array(a), np.int64) for a in (offsets, lists, rowmap))
        index, mask = np.asarray(host_array(index), np.int64), np.asarray(host_array(mask), bool)
        check_points(n_r, n_s, offsets, lists, rowmap, index, mask)
        P, n = rowmap.shape
        point = np.repeat(np.arange(P, dtype=np.int64), np.diff(offsets))
        r_rowmap = np.full((P, index.shape[0]), -1, np.int64)
        r_rowmap[point, lists] = np.arange(n_r)
        if (r_rowmap >= 0).sum() != n_r:
            raise ValueError("lists: two receivers of one point share a list row")
        flat = np.flatnonzero(rowmap.ravel() >= 0)
        rows = rowmap.ravel()[flat]
        s_point, s_agent = np.zeros(n_s, np.int64), np.full(n_s, -1, np.int64)
        s_point[rows], s_agent[rows] = flat // n, flat % n
        inc = _incoming(index, mask, n)
        host = dict(point=point, lists=lists, rowmap=rowmap, index=index, mask=mask, r_rowmap=r_rowmap,
                    s_point=s_point, s_agent=s_agent, ptr=inc["ptr"], src_list=inc["row"])  # fmt: skip
        # Writable copies: the config holds read-only lists (the simulator writes kernel arguments back).
        self.buf = {k: xp.asarray(np.array(v, order="C")) for k, v in host.items()}
        self.dev = {k: kc.as_device_view(v) for k, v in self.buf.items()}


_points_layouts: OrderedDict = OrderedDict()


def _pairwise_points(A, B, c, u, v, offsets, lists, rowmap, index, mask, kappa: float, aggregator: str):
    """Weighted pairs batched over grid points (the contract of
    :func:`vfesim.pairwise.weighted.pairwise_points_weighted`) in the kernels of
    :func:`vfesim_kernels.cuda.make_points_kernels`: features and weights on the device, the layout
    (offsets, lists, rowmap, index, mask) host or device arrays, prepared once per set of arrays (the
    two alignment terms of an evaluation share it). Returns (E, gA, gB, gc, gu, gv)."""
    xp = array_module()
    MR, D = A.shape
    MS = B.shape[0]
    dt = np.dtype(A.dtype)
    if dt not in (np.float32, np.float64):
        raise TypeError(f"features must be float32 or float64, got {dt}")
    key = tuple(id(a) for a in (offsets, lists, rowmap, index, mask)) + (MR, MS)
    make = lambda: (
        (offsets, lists, rowmap, index, mask),
        _PointsLayout(MR, MS, offsets, lists, rowmap, index, mask),
    )
    lay = _lru(_points_layouts, key, make)[1].dev
    k = kc.make_points_kernels(D, dt.name, aggregator)
    half = dt.type(0.5)
    cont = lambda a: xp.ascontiguousarray(a, dtype=dt)
    Ah, Bc, ch, uc, vc = cont(A * half), cont(B), cont(c * half), cont(u), cont(v)
    stats = xp.empty((5, MR), dt)
    erow, gc, gu = xp.zeros(MR, dt), xp.zeros(MR, dt), xp.zeros(MR, dt)
    gA, gB, gv = xp.zeros((MR, D), dt), xp.zeros((MS, D), dt), xp.zeros(MS, dt)
    kap = dt.type(kappa)
    if MR:
        _launch(k["rows"], _cdiv(MR, kc.BLOCK), kc.BLOCK,
            Ah, Bc, ch, uc, vc, lay["point"], lay["lists"], lay["rowmap"], lay["index"], lay["mask"], kap,
            stats, erow, gA, gc, gu,
        )  # fmt: skip
    if MS and MR:
        _launch(k["senders"], _cdiv(MS, kc.BLOCK), kc.BLOCK,
            Ah, Bc, ch, uc, vc, lay["s_point"], lay["s_agent"], lay["r_rowmap"], lay["ptr"],
            lay["src_list"], kap, stats, gB, gv,
        )  # fmt: skip
    gA *= half
    gc *= half
    return float(kc.reduce.device_sum(erow)), gA, gB, gc, gu, gv


BACKEND = Backend(
    name="cuda",
    array_module=array_module,
    to_device=to_device,
    to_host=to_host,
    pairwise_dense=_pairwise_dense,
    pairwise_sparse=_pairwise_sparse,
    updates=_device_updates,
    agent_ops={"gaussian": _stages, "quantum": QUANTUM_OPS},
    on_device=True,
    pairwise_points=_pairwise_points,
    prepare=prepare,
)


def _incoming(index: np.ndarray, mask: np.ndarray, n_senders: int) -> dict:
    """The transpose of neighbour lists (n_r, k) into ``n_senders`` rows: per sender its incoming edges
    (receiver row, slot), ordered by receiver then slot (a fixed summation order), as CSR (ptr, row,
    slot) host arrays (the CPU kernels' stable counting sort); one padding entry keeps the edge arrays
    non-empty."""
    index = np.ascontiguousarray(index, np.int64)
    k = max(index.shape[1], 1)
    ptr, flat = incoming_csr(index, np.ascontiguousarray(mask, np.bool_), n_senders)
    pad = lambda a: np.concatenate([a, np.zeros(1, np.int64)])
    return {"ptr": ptr, "row": pad(flat // k), "slot": pad(flat % k)}


def pairwise_sparse_rows(A_r, c_r, B_s, index, mask, kappa: float, aggregator: str, key=None):
    """Receivers A_r (n_r, D), c_r (n_r,) with neighbour lists index/mask (n_r, k) into the rows of B_s
    (n_s, D), a gathered subset of the senders (local row numbers), on the device: the unit of work of a
    scheduler task (the contract of :func:`vfesim_kernels.pairwise_cpu.pairwise_sparse_rows`).

    Returns (row energies (n_r,) float64, gA_r (n_r, D), gc_r (n_r,) in the dtype, gB_part (n_s, D)
    float64: these receivers' share of the gathered senders' gB, each sender's sum over its incoming
    edges in (receiver, slot) order). The sparse kernels of :func:`vfesim_kernels.cuda.make_sparse_kernels`:
    one thread per receiver, then one per sender. Memory: O((n_r k + n_s) D) on the device.

    The lists are checked, transposed and copied to the device on their first use only: cached under
    ``key`` (a name the caller gives these lists, e.g. a dask plan's chunk; the same name must always
    mean the same lists), else under the identity of ``index`` and ``mask``.
    """
    xp = array_module()
    NR, D = A_r.shape
    NS = B_s.shape[0]
    dt = A_r.dtype

    def make():
        host = lambda a: a if isinstance(a, np.ndarray) else a.get()
        index_h, mask_h = np.asarray(host(index), np.int64), np.asarray(host(mask), bool)
        if index_h.ndim != 2 or index_h.shape[0] != NR or mask_h.shape != index_h.shape:
            raise ValueError(f"index/mask: expected ({NR}, k) lists, got {index_h.shape} and {mask_h.shape}")
        return (index, mask), _Neighbours(index_h, mask_h, NS)  # which checks the listed rows

    # The lists of one receiver chunk are one object for a whole dask run: checked, transposed and moved
    # to the device on their first use only.
    name = ("lists", key, NR, NS) if key is not None else (id(index), id(mask), NS)
    nbr = _lru(_neighbours, name, make, MAX_LISTS)[1]
    if NR == 0:
        return xp.zeros(0), xp.zeros((0, D), dt), xp.zeros(0, dt), xp.zeros((NS, D))
    k = kc.make_sparse_kernels(D, dt.name, aggregator)
    scale = dt.type(0.5 / kappa)
    Ah, Bb, ch = (xp.ascontiguousarray(a[None]) for a in (A_r * scale, B_s, c_r * scale))
    W = xp.zeros((1, NR, nbr.width), dt)
    energy = xp.zeros((1, NR), dt)
    gAr = xp.zeros((1, 1, NR, D + 1), dt)
    gBs = xp.zeros((1, 1, NS, D), dt)
    kap = _unit_kappa(xp, dt)
    lists = nbr.dev
    nblk = (_cdiv(NR, kc.BLOCK), 1)
    _launch(k["rows"], nblk, kc.BLOCK, Ah, Bb, ch, lists["index"], lists["mask"], kap, 0, W, energy, gAr)
    if NS:
        ptr, row, slot = lists["ptr"], lists["row"], lists["slot"]
        _launch(k["senders"], (_cdiv(NS, kc.BLOCK), 1), kc.BLOCK, Ah, W, ptr, row, slot, 0, gBs)
    erow = (kappa * energy[0]).astype(np.float64)
    return erow, 0.5 * gAr[0, 0, :, :-1], 0.5 * gAr[0, 0, :, -1], (kappa * gBs[0, 0]).astype(np.float64)
