"""Every numba.cuda kernel compiles to PTX for sm_90 (H100/H200) on a machine without a GPU.

The CUDA simulator runs untyped Python and accepts code that the compiler rejects; this test runs the
real front end and NVVM (``numba-cuda[cu13]``). It also guards two performance properties of the dense
pairwise kernels: float32 kernels contain no float64 arithmetic (a Python float literal in the per-pair
math would silently promote), and at K = 3 the per-thread arrays stay in registers (no local memory);
the float64 dense kernels run their products on the tensor cores (mma.sync m16n8k8).
"""

import functools
import os
import re

import numpy as np
import pytest
from conftest import needs_numba_cuda

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    pytest.skip("compile_ptx needs the real CUDA target, not the simulator", allow_module_level=True)
needs_numba_cuda(module=True)

from vfesim_kernels import cuda as kc  # noqa: E402

CASES = [(3, "float64"), (3, "float32"), (21, "float32")]


@pytest.fixture(autouse=True)
def _sm90_without_a_gpu(monkeypatch):
    """Device functions (vfesim_kernels.cuda.core.device) compile for the current device's compute
    capability, which a machine without a GPU has none of: give them sm_90's, the target here."""
    from types import SimpleNamespace

    import numba.cuda.dispatcher as dispatcher

    from vfesim.backends import cuda_available

    sm90 = SimpleNamespace(compute_capability=(9, 0))
    if not cuda_available():
        monkeypatch.setattr(dispatcher, "get_current_device", lambda: sm90)


def _families(K, dtype):
    checks = kc.checks.make_check_kernels(K, dtype, K >= kc.checks.WARP_FROM_K)
    fams = [("agent", kc.make_agent_kernels(K, dtype)), ("checks", checks)]
    for agg in ("expected", "softmin"):
        fams.append((f"dense-{agg}", kc.make_dense_kernels(kc.feature_dim(K), dtype, agg)))
        fams.append((f"sparse-{agg}", kc.make_sparse_kernels(kc.feature_dim(K), dtype, agg)))
    return fams


def _kernels():
    for K, dtype in CASES:
        for fam, ks in _families(K, dtype):
            for name in ks["_py"]:
                if K == 21 and (fam.startswith("sparse") or fam == "dense-softmin"):
                    continue  # the same code as K = 3; keeps the test short
                yield pytest.param(K, dtype, fam, name, id=f"K{K}-{dtype}-{fam}-{name}")


def _depot(ptx: str) -> int:
    """Bytes of local memory a kernel's PTX declares."""
    return sum(int(n) for n in re.findall(r"__local_depot\d+\[(\d+)\]", ptx))


@functools.cache
def _ptx(K, dtype, fam, name):
    """PTX of one kernel for sm_90 (compiled once per test session: compile_ptx takes seconds)."""
    ks = dict(_families(K, dtype))[fam]
    return kc.cuda.compile_ptx(ks["_py"][name], kc.kernel_signatures(K, dtype)[name], cc=(9, 0))[0]


@pytest.mark.parametrize("K, dtype, fam, name", list(_kernels()))
def test_kernel_compiles_for_sm90(K, dtype, fam, name):
    ptx = _ptx(K, dtype, fam, name)
    assert ".target sm_90" in ptx
    assert re.search(r"\.entry\s", ptx), "no kernel entry point"
    if fam.startswith("dense") and name in ("stats", "grads"):
        if dtype == "float32":
            assert not re.search(r"\.f64\b", ptx), "float64 arithmetic in a float32 pairwise kernel"
            # logits in base-2 units: the exponential is the hardware's ex2, with no scaling per pair
            assert "ex2.approx.ftz.f32" in ptx
            if name == "stats":  # the rescaling branch taken by whole warps, on a vote
                assert "vote.sync.any.pred" in ptx
        if K == 3:
            assert ".local" not in ptx, "per-thread arrays spilled to local memory at K = 3"
        if dtype == "float64":  # the tensor-core kernels: the sm_90 shapes, not Ampere's m8n8k4
            assert "mma.sync.aligned.m16n8k8.row.col.f64" in ptx
            assert "m8n8k4" not in ptx


def test_every_kernel_has_a_signature():
    sigs = kc.kernel_signatures(3, "float64")
    for _, ks in _families(3, "float64"):
        assert set(ks["_py"]) <= set(sigs)


# ------------------------------------------------------------------------------------------------
# Large-K block-per-agent kernels (make_block_kernels): compile for sm_90, matrices kept out of local
# memory (a per-agent K x K array in local memory is what made one thread per agent slow at K = 21).
# ------------------------------------------------------------------------------------------------

BLOCK_CASES = [(9, "float64"), (21, "float32"), (21, "float64")]


@pytest.mark.parametrize("name", ["prep", "self_kl", "adjoint"])
@pytest.mark.parametrize("K, dtype", BLOCK_CASES, ids=[f"K{k}-{d}" for k, d in BLOCK_CASES])
def test_block_kernel_compiles_for_sm90(K, dtype, name):
    import numpy as np

    assert kc.block_kernels_fit(K, dtype)
    ks = kc.make_block_kernels(K, dtype)
    ptx, _ = kc.cuda.compile_ptx(ks["_py"][name], kc.block_kernel_signatures(K, dtype)[name], cc=(9, 0))
    assert ".target sm_90" in ptx
    assert re.search(r"\.entry\s", ptx), "no kernel entry point"
    assert "bar.sync" in ptx, "block kernel without barriers"
    depot = _depot(ptx)
    assert depot < K * K * np.dtype(dtype).itemsize, f"{depot} bytes of local memory: a matrix spilled"
    if dtype == "float32" and name != "adjoint":
        # float64 only in the scalar set-up (scaling count, logs); never in the K x K element phases.
        assert len(re.findall(r"fma\.rn\.f64", ptx)) < len(re.findall(r"fma\.rn\.f32", ptx))


def test_block_kernels_fit_shared_memory():
    assert kc.block_kernels_fit(27, "float64") and not kc.block_kernels_fit(28, "float64")
    assert kc.block_kernels_fit(38, "float32") and not kc.block_kernels_fit(39, "float32")
    sigs = set(kc.block_kernel_signatures(9, "float64"))
    assert sigs == set(kc.make_block_kernels(9, "float64")["_py"]) | {"rows"}


@pytest.mark.parametrize("aggregator", ["expected", "softmin"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gemm_row_kernel_compiles_for_sm90(dtype, aggregator):
    k = kc.make_gemm_row_kernel(dtype, aggregator)
    ptx, _ = kc.cuda.compile_ptx(k["_py"]["rows"], kc.block_kernel_signatures(3, dtype)["rows"], cc=(9, 0))
    assert ".target sm_90" in ptx and "bar.sync" in ptx
    assert ".local" not in ptx
    if dtype == "float32":
        assert not re.search(r"\.f64\b", ptx), "float64 arithmetic in the float32 row kernel"


# --- integrator update kernels (vfesim_kernels.update_cuda) --------------------------------------
UPDATE_CASES = [(3, "float64"), (3, "float32")]


def _update_kernels():
    from vfesim_kernels import update_cuda as uc

    for K, dtype in UPDATE_CASES:
        for name in uc.make_update_kernels(K)["_py"]:
            yield pytest.param(K, dtype, name, id=f"update-K{K}-{dtype}-{name}")


@pytest.mark.parametrize("K, dtype, name", list(_update_kernels()))
def test_update_kernel_compiles_for_sm90(K, dtype, name):
    from vfesim_kernels import update_cuda as uc

    fn = uc.make_update_kernels(K)["_py"][name]
    ptx, _ = uc.cuda.compile_ptx(fn, uc.kernel_signatures(dtype)[name], cc=(9, 0))
    assert ".target sm_90" in ptx
    assert re.search(r"\.entry\s", ptx), "no kernel entry point"
    if name in ("gradient_flow", "kick_drift"):
        assert "atom.global" in ptx or "red.global" in ptx, "the guard flag is never raised"


def test_every_update_kernel_has_a_signature():
    from vfesim_kernels import update_cuda as uc

    assert set(uc.make_update_kernels(3)["_py"]) == set(uc.kernel_signatures("float64"))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_thread_per_agent_kernels_keep_matrices_in_registers(dtype):
    """One thread per agent at K = 3: the agent's 3 x 3 scratch stays in registers. (A loop with a
    run-time trip count around the element loops once kept four of them in local memory: 0.6 ms more at
    N = 4096 on an H100.)"""
    for name in ("prep", "features", "self_kl", "adjoint"):
        ptx = _ptx(3, dtype, "agent", name)
        depot = _depot(ptx)
        assert depot <= 64, f"{name}: {depot} bytes of local memory"


# ------------------------------------------------------------------------------------------------
# Density-matrix per-agent kernels (make_quantum_kernels): every kernel at d = 4 in complex128, and the
# kernels with the most complex64 / float64 mixing in complex64.
# ------------------------------------------------------------------------------------------------

QUANTUM_CASES = [("complex128", name) for name in kc.quantum_kernel_signatures("complex128")] + [
    ("complex64", name) for name in ("energy_prep", "energy_features", "energy_backward")
]


@pytest.mark.parametrize("dtype, name", QUANTUM_CASES, ids=[f"{d}-{n}" for d, n in QUANTUM_CASES])
def test_quantum_kernel_compiles_for_sm90(dtype, name):
    ks = kc.make_quantum_kernels(4, dtype)
    assert set(ks["_py"]) == set(kc.quantum_kernel_signatures(dtype))
    ptx = kc.cuda.compile_ptx(ks["_py"][name], kc.quantum_kernel_signatures(dtype)[name], cc=(9, 0))[0]
    assert ".target sm_90" in ptx
    assert re.search(r"\.entry\s", ptx), "no kernel entry point"
    if dtype == "complex64":  # the O(d^3) work in float32 (a float literal would promote it: quantum_math)
        ops = r"\n\s*(?:fma|mul|add|sub|div|sqrt|neg)\.[a-z.]*"
        f32, f64 = (len(re.findall(ops + t, ptx)) for t in ("f32", "f64"))
        assert f64 < f32 / 2, f"{name}: {f64} float64 operations against {f32} float32"


@pytest.mark.parametrize("dtype", ["complex128", "complex64"])
def test_cooperative_eigh_compiles_for_sm90(dtype):
    """From d = 6 the ``eigh`` kernel is the cooperative one (vfesim_kernels.cuda.eigh): its matrices in
    shared memory, its threads synchronised per warp and stopping by a warp vote, nothing in local memory."""
    ks = kc.make_quantum_kernels(8, dtype)
    assert ks["_lanes"] == {"eigh": kc.eigh.COOP_LANES}
    ptx = kc.cuda.compile_ptx(ks["_py"]["eigh"], kc.quantum_kernel_signatures(dtype)["eigh"], cc=(9, 0))[0]
    assert ".target sm_90" in ptx and re.search(r"\.entry\s", ptx)
    assert ".shared" in ptx and "bar.warp.sync" in ptx and "vote.sync.all" in ptx
    assert _depot(ptx) == 0
    assert kc.make_quantum_kernels(4, dtype)["_lanes"] == {}  # one thread per matrix below COOP_MIN_D


def _instructions(ptx: str) -> int:
    return len(re.findall(r"^\s+[a-z][\w.]*\s.*;", ptx, re.M))


# (The complex64 adjoint without modes, 30 s of compilation, is compiled once, in
# test_quantum_kernel_compiles_for_sm90; its mode sets in the test after this one.)
@pytest.mark.parametrize(
    "name, dtype",
    [("channel_step", "complex128"), ("channel_step", "complex64"), ("channel_step_vjp", "complex128")],
)
def test_channel_kernels_for_fixed_modes_compile_the_other_modes_away(name, dtype):
    """The channel kernels compiled for their modes (make_quantum_kernels(..., modes)): the other modes'
    branches compile away. For C1 coupling, computational dephasing and no gate (the rollout benchmark's
    problem) fewer than half the PTX instructions remain (complex128 adjoint at stop 36: 41 547 -> 13 986;
    ptxas: spill stores 6896 -> 3644 bytes, 396 since its unitary part works in H's eigenbasis); every mode
    set compiles for sm_90."""
    sig = kc.quantum_kernel_signatures(dtype)[name]
    newton = int(dtype == "complex64")
    ptx = {
        modes: kc.cuda.compile_ptx(kc.make_quantum_kernels(4, dtype, modes)["_py"][name], sig, cc=(9, 0))[0]
        for modes in (None, (1, 0, 0, newton), (2, 1, 1, newton))
    }
    for text in ptx.values():
        assert ".target sm_90" in text and re.search(r"\.entry\s", text)
    assert _instructions(ptx[(1, 0, 0, newton)]) < 0.5 * _instructions(ptx[None])
    assert _instructions(ptx[(2, 1, 1, newton)]) < _instructions(ptx[None])


def test_complex64_adjoint_mode_sets_compile_for_sm90():
    sig = kc.quantum_kernel_signatures("complex64")["channel_step_vjp"]
    for modes in ((1, 0, 0, 1), (2, 1, 1, 1)):
        fn = kc.make_quantum_kernels(4, "complex64", modes)["_py"]["channel_step_vjp"]
        ptx = kc.cuda.compile_ptx(fn, sig, cc=(9, 0))[0]
        assert ".target sm_90" in ptx and re.search(r"\.entry\s", ptx), modes


@pytest.mark.parametrize("dtype", ["complex128", "complex64"])
def test_density_matrix_kernels_keep_their_matrices_out_of_local_memory(dtype):
    """At d = 4 the per-agent scratch of the channel step, the C1 senders' adjoint, the sender states and
    the features pass stays in registers: the matrix products' loops are sized by their scratch output
    (quantum_math's module docstring). Sized by a view of a batched argument (U[n]), a loop's trip count
    is a run-time value, nothing unrolls, and every scratch it indexes went to local memory (complex128:
    552, 512, 256 and 256 bytes; the step's adjoint 1.2 us per agent of local traffic on an H100)."""
    sigs = kc.quantum_kernel_signatures(dtype)
    newton = int(dtype == "complex64")
    for name in ("channel_step", "incoming", "sender_states", "energy_features"):
        modes = (1, 0, 0, newton) if name == "channel_step" else None
        fn = kc.make_quantum_kernels(4, dtype, modes)["_py"][name]
        ptx = kc.cuda.compile_ptx(fn, sigs[name], cc=(9, 0))[0]
        assert _depot(ptx) <= 64, f"{name}: {_depot(ptx)} bytes of local memory"


def test_channel_kernels_take_four_mode_codes():
    """Mode sets are checked; every spelling of one kernel set is the same dispatchers (a second set of the
    energy kernels would compile again instead of the ahead-compiled ones), and a mode set shares every
    kernel but the channel step's two."""
    with pytest.raises(ValueError, match="four codes"):
        kc.make_quantum_kernels(4, "complex128", (1, 0, 0))
    base = kc.make_quantum_kernels(4, "complex128")
    assert kc.make_quantum_kernels(4, np.dtype("complex128"), None) is base
    fixed = kc.make_quantum_kernels(4, "complex128", (1, 0, 0, 0))
    assert kc.make_quantum_kernels(4, "complex128", [1, 0, 0, 0]) is fixed
    for name in base["_py"]:
        assert (fixed[name] is base[name]) == (name not in ("channel_step", "channel_step_vjp")), name


@pytest.mark.parametrize("dtype", ["complex128", "complex64"])
def test_quantum_kernel_signatures_are_the_launched_types(dtype):
    """The signatures (ahead-of-time compilation, this file's PTX) are the argument types the cuda
    backend's kernel_ops launches with (agent-minor layouts): a signature that drifted would have a first
    launch compile again instead of loading the ahead-compiled kernel."""
    import numba
    from numba.core import sigutils
    from quantum_stages import channel_case, stage_inputs, stage_outputs

    from vfesim.quantum.born import observed_outcomes
    from vfesim.quantum.kernel_ops import kernel_ops

    launched, modes_of = {}, {}

    def record(name, N, d, dt, *args, modes=None):
        launched[name] = tuple(numba.typeof(a) for a in args)
        if modes is not None:  # the codes the kernels are compiled for, and their array argument's
            modes_of[name] = (modes, tuple(args[{"channel_step": 12, "channel_step_vjp": 13}[name]]))

    ops = kernel_ops(lambda: np, record, agent_minor=True, batched_eigh_from=kc.eigh.COOP_MIN_D)
    stage_outputs(ops, stage_inputs(4, dtype, N=6))
    # d = 8: the forward's eigen-decompositions as one cooperative eigh launch (kernels recorded, not run)
    ops.forward(stage_inputs(8, dtype, N=6)[0], (1.0, 1.0, 1.0, 1.0))
    P, rho, dyn = channel_case(4, dtype, "C1", "computational", "none", N=9)
    out = ops.channel_step(P, rho, 0.1, dyn)
    ops.step_vjp(4)(P, out, out, 0.1, dyn)
    obs = observed_outcomes(np.zeros((1, out.shape[0]), np.int64), 4, np)  # a rollout's Born terms
    ops.born.logp(ops.born.start(np, out.shape[0]), out, obs, 0)
    ops.born.add(np.zeros_like(out), out, obs, 0, 1.0)
    sigs = kc.quantum_kernel_signatures(dtype)
    assert set(launched) == set(sigs)
    newton = int(dtype == "complex64")
    assert modes_of == {k: ((1, 0, 0, newton),) * 2 for k in ("channel_step", "channel_step_vjp")}
    for name, types in launched.items():
        want = sigutils.normalize_signature(sigs[name])[0]
        assert len(want) == len(types), name
        for k, (t, w) in enumerate(zip(types, want, strict=True)):
            if isinstance(w, numba.types.Array):
                assert (t.dtype, t.ndim, t.layout) == (w.dtype, w.ndim, w.layout), (name, k, t, w)
            else:
                assert t == w, (name, k, t, w)


# ------------------------------------------------------------------------------------------------
# Weighted pairs batched over grid points (make_points_kernels, field agents): K = 3 (D = 10) in both
# dtypes and aggregators, K = 21 (D = 253) in float32.
# ------------------------------------------------------------------------------------------------

POINTS_CASES = [
    (D, dtype, agg, name)
    for D, dtype, aggs in ((10, "float64", ("expected", "softmin")), (10, "float32", ("expected", "softmin")),
                           (253, "float32", ("expected",)))
    for agg in aggs
    for name in ("rows", "senders")
]  # fmt: skip


@pytest.mark.parametrize(
    "D, dtype, agg, name", POINTS_CASES, ids=["-".join(map(str, c)) for c in POINTS_CASES]
)
def test_points_kernel_compiles_for_sm90(D, dtype, agg, name):
    ks = kc.make_points_kernels(D, dtype, agg)
    assert set(ks["_py"]) == set(kc.points_kernel_signatures(dtype))
    ptx = kc.cuda.compile_ptx(ks["_py"][name], kc.points_kernel_signatures(dtype)[name], cc=(9, 0))[0]
    assert ".target sm_90" in ptx
    assert re.search(r"\.entry\s", ptx), "no kernel entry point"
    if dtype == "float32":
        assert not re.search(r"\.f64\b", ptx), "float64 arithmetic in a float32 kernel"


@pytest.mark.parametrize(
    "owners, others, row_bytes",
    [(262144, 1 << 20, 56), (1 << 20, 1 << 20, 56), (1 << 20, 1 << 20, 280), (65536, 65536, 56),
     (65536, 65536, 272), (37, 12289, 8), (12289, 5000, 8), (3, 3, 8)],
)  # fmt: skip
def test_dense_splits_cover_the_others_without_empty_slices(owners, others, row_bytes):
    """Slices of the other side: a multiple of the thread count each, none empty, together every row;
    at most SPLIT_MAX, partial sums within split_budget (unless one slice), about SPLIT_BLOCKS blocks."""
    from vfesim_kernels.cuda import pairwise as kp

    S, chunk = kc.dense_splits(owners, others, row_bytes)
    assert chunk % kc.PAIR_THREADS == 0 and 1 <= S <= kp.SPLIT_MAX
    assert (S - 1) * chunk < others <= S * chunk  # every slice has rows, together all of them
    assert S == 1 or S * owners * row_bytes <= kp.split_budget(owners)
    blocks = -(-owners // (kc.PAIR_THREADS * 2)) * S  # (dense_splits' default of 2 owners per thread)
    if (owners, others) == (262144, 1 << 20):  # a chunk of 2^20 agents on 4 GPUs: several waves
        assert blocks >= 8192
    if (owners, others, row_bytes) == (1 << 20, 1 << 20, 280):  # the in-process Gaussian passes at 2^20
        assert S == 3 and blocks == 3 * 4096  # 840 MB of partial sums (128 MiB would allow one slice)
    assert kc.dense_slices(12289, 24, 128) == (20, 640)  # rounding leaves 20 slices of 640, not 24


@pytest.mark.parametrize("name", ["partial_sum", "partial_max_abs", "final_max_abs"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reduce_kernels_compile_for_sm90(dtype, name):
    """The device reductions (vfesim_kernels.cuda.reduce): a shared-memory tree, float64 accumulation."""
    k = kc.reduce.make_reduce_kernels()
    ptx, _ = kc.cuda.compile_ptx(k["_py"][name], kc.reduce.reduce_signatures(dtype)[name], cc=(9, 0))
    assert ".target sm_90" in ptx and re.search(r"\.entry\s", ptx)
    assert "bar.sync" in ptx and ".shared" in ptx
    assert re.search(r"\.f64\b", ptx)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fold_kernel_compiles_for_sm90(dtype):
    """The slices' sum of the dense sender pass (vfesim_kernels.cuda.reduce.fold_slices), in the dtype."""
    k = kc.reduce.make_reduce_kernels()
    ptx, _ = kc.cuda.compile_ptx(k["_py"]["fold"], kc.reduce.reduce_signatures(dtype)["fold"], cc=(9, 0))
    assert ".target sm_90" in ptx and re.search(r"\.entry\s", ptx)
    assert bool(re.search(r"add(\.rn)?\.f64", ptx)) == (dtype == "float64")


def test_dense_owners_per_thread_by_dtype_and_width():
    """Owners per thread of the SIMT dense kernels: float32 rows up to D = 10 take 2 (PAIR_OPTS_NARROW),
    wider rows 3; float64 2. The launch layout and the kernels made agree."""
    widest, narrow = kc.PAIR_OPTS_NARROW["float32"]
    assert kc.pair_opt("float32", widest) == narrow == 2
    assert kc.pair_opt("float32", widest + 1) == kc.pair_opt("float32") == kc.PAIR_OPTS["float32"] == 3
    assert kc.pair_opt("float64", 4) == kc.pair_opt("float64", 64) == 2
    for D, opt in ((10, 2), (16, 3)):
        ks = kc.make_dense_kernels(D, "float32", "softmin")
        assert ks["opt"] == opt
        layout = (kc.PAIR_THREADS, opt * kc.PAIR_THREADS)
        assert kc.dense_layout(D, "float32") == (ks["threads"], ks["per_block"]) == layout
