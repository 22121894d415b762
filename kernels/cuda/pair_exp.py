"""The dense pair kernels' exponential, for the arguments they take: a logit less the row's running
maximum (<= 0, or a little above 0 by rounding), -inf (an empty row's maximum), or NaN.

``PAIR_EXPB[dtype] = (ex, LB)``: the exponential in the kernels' logit units. The SIMT kernels load their
feature rows times LB, so a logit y in those units has exp(y / LB) = ex(y):

- float32: LB = log2(e) and ex = the hardware's ex2.approx.ftz, one instruction per pair (libdevice's
  expf is 14, its fast_expf scales inputs below -126 around the same instruction to keep subnormal
  results; multiplying by log2(e) per pair cost one more until stop 39 folded it into the features). The
  relative error is that of the rounded argument, about 6e-8 |y| ln 2, far inside the 1e-4 of float32
  results. Results below 2^-126 flush to zero: such a weight is below 1e-38 of its row's largest, under
  float32's resolution of any row sum. The simulator computes exp(y ln 2), so the unit conversions run in
  CI too.
- float64: LB = 1 (natural units, also the tensor-core kernels') and ``math.exp`` (libdevice's: a
reduction to |r| <= ln2 / 2 and a degree-11 polynomial, about 18 double-precision operations). A
table-driven exponential (2^(j/32) from shared memory, a degree-6 polynomial, 10 operations, within 1 ulp
of ``math.exp``) made the pair kernels slower on an H100 (density-matrix pairs, complex128, N = 65 536:
53.5 -> 59.6 ms per evaluation; Gaussian float64 K = 3: 87 -> 101 ms): its shared-memory load sits in the
middle of each exponential's dependent chain, which two resident warps per scheduler cannot hide. A variant
without memory access (2^(j/8) picked by selects, a degree-8 polynomial, 13 operations against 16, within 1
ulp) was slower still (62.3 against 52.7 ms; Gaussian 107 against 86 ms): its floor test, word access and
selects cost more than the operations saved, where libdevice's exponential is one predicated sequence. Both
are described in benchmarks/results/gpu_exp64_h100_stop31.txt.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32

from .core import SIMULATOR, device

__all__ = ["PAIR_EXPB"]


def _exp(x):
    return math.exp(x)


_LN2 = math.log(2.0)


def _exp2_sim(y):
    return math.exp(y * _LN2)


if SIMULATOR:
    _EX2 = device(_exp2_sim)
else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _ex2_ftz(typingctx, x):
        """2 ** x for a float32 x by ex2.approx.ftz.f32 (one MUFU.EX2)."""
        if x != float32:
            return None

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.nvvm.ex2.approx.ftz.f")
            return builder.call(fn, args)

        return float32(float32), codegen

    def _exp2(y):
        return _ex2_ftz(y)

    _EX2 = device(_exp2)

PAIR_EXPB = {
    np.dtype(np.float32): (_EX2, np.float32(1.0 / _LN2)),
    np.dtype(np.float64): (device(_exp), np.float64(1.0)),
}
