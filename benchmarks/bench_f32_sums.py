"""How the float32 sums of the pair cotangents limit a family's float32 / complex64 gradients, on the CPU.

The dense pair kernels sum gA_i = 1/2 sum_j W_ij B_j and gB_j = 1/2 sum_i W_ij A_i over up to N terms. The
CUDA SIMT kernels carry each owner's sums in float32 across a whole slice of the other side; the CPU kernels
carry a float32 partial over one tile and add the tiles in float64. This tool replaces a family's pair
kernel by one that computes the weights exactly (float64) and sums the rows in float32 in either pattern,
keeps every per-agent stage in float64, and prints each gradient's max-norm relative error against the same
pairs summed in float64: the part of the narrow dtype's error that the sums alone cause, at sizes a GPU
runs, without a GPU.

    python benchmarks/bench_f32_sums.py --family gaussian quantum --n 4096 16384 --sums slice tile

``slice``: one float32 sum per owner over all others (the SIMT kernels' pattern, one slice); ``tile``:
float32 over ``--tile`` others at a time, the partials added in float64 (the CPU kernels' scheme; they
group 256 senders for gA and 32 receivers for gB);
``kahan``: the same partials added into a float32 total with a float32 compensation (no float64).
Softmin aggregator, self + belief terms (Gaussian K = 3; density-matrix d = --d), seed 0.
"""

from __future__ import annotations

import argparse

import numba
import numpy as np

import vfesim
from vfesim import pairwise
from vfesim.pairwise import blocks


@numba.njit(parallel=True, cache=True)
def _weighted_sums(other, A, B, c, kappa, m, inv_s, receivers, tile, compensated):
    """Per owner o: 1/2 sum_k W_ok other_k (receivers: W_ok = W[o, k]; else W_ok = W[k, o]) with W_ij =
    exp(-(A_i . B_j + c_i) / (2 kappa) - m_i) / s_i computed in float64, the products and sums in
    float32; tile > 0: float32 partials over ``tile`` terms, added in float64, or (``compensated``) into
    a float32 total with a float32 compensation term (Kahan: no float64 arithmetic)."""
    N, D = other.shape
    out = np.empty((N, D), np.float32)
    for o in numba.prange(N):
        part = np.zeros(D, np.float32)
        total = np.zeros(D, np.float64)
        hi = np.zeros(D, np.float32)
        lo = np.zeros(D, np.float32)
        n_in = 0
        for k in range(N):
            if k == o:
                continue
            # the pair's receiver r and sender q (int64 both: prange's index may be unsigned)
            r, q = (np.int64(o), np.int64(k)) if receivers else (np.int64(k), np.int64(o))
            x = 0.0
            for d in range(D):
                x += A[r, d] * B[q, d]
            w = np.float32(np.exp(-0.5 * (x + c[r]) / kappa - m[r]) * inv_s[r])
            for d in range(D):
                part[d] += w * np.float32(other[k, d])
            n_in += 1
            if tile > 0 and n_in == tile:
                for d in range(D):
                    if compensated:
                        y = part[d] - lo[d]
                        t = hi[d] + y
                        lo[d] = (t - hi[d]) - y
                        hi[d] = t
                    else:
                        total[d] += part[d]
                    part[d] = 0.0
                n_in = 0
        for d in range(D):
            if compensated:
                out[o, d] = np.float32(0.5) * (hi[d] + (part[d] - lo[d]))
            else:
                out[o, d] = np.float32(0.5) * np.float32(total[d] + part[d])
    return out


def _rows(A, B, c, kappa, block: int = 1024):
    """The receivers' softmin row summary (energy, m, 1/s) from the pairwise layer's block API, streamed
    over sender blocks (no N x N array)."""
    stats = blocks.empty_stats(A.shape[0], np.float64)
    for s0 in range(0, B.shape[0], block):
        stats = blocks.merge_stats(stats, blocks.block_stats(A, c, B[s0 : s0 + block], kappa, 0, s0))
    return blocks.finish_rows(stats, kappa, "softmin")


def summed_in_float32(sums: str, tile: int):
    """A dense pair function (vfesim.pairwise signature) whose cotangent sums run in float32."""

    def dense(A, B, c, kappa, aggregator):
        if aggregator != "softmin":
            raise ValueError(f"bench_f32_sums: softmin weights only, got {aggregator!r}")
        rows = _rows(A, B, c, kappa)
        t = 0 if sums == "slice" else tile
        kahan = sums == "kahan"
        gA = _weighted_sums(B, A, B, c, kappa, rows.m, rows.inv_s, True, t, kahan).astype(np.float64)
        gB = _weighted_sums(A, A, B, c, kappa, rows.m, rows.inv_s, False, t, kahan).astype(np.float64)
        gc = 0.5 * (rows.inv_s > 0)  # softmin: each receiver's weights sum to 1
        return rows.energy.sum(), gA, gB, gc

    return dense


def family_case(family: str, N: int, d: int):
    """(label, evaluate(pairwise_dense) -> gradients) of a random population of the family."""
    if family == "gaussian":
        from vfesim.gaussian import energy

        cfg = vfesim.ModelConfig(K=3, aggregator="softmin")
        keys = None
        label = "K=3"
    else:
        from vfesim.quantum import energy

        cfg = vfesim.QuantumConfig(d=d, aggregator="softmin")
        keys = ("rho", "hamiltonian", "temperature", "phi")
        label = f"d={d}"
    state = vfesim.random_state(cfg, n_agents=N, seed=0)
    arrays = {k: state[k].values for k in (keys or state.data_vars)}
    return label, lambda dense: energy.energy_and_gradient_arrays(arrays, cfg, pairwise_dense=dense)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", nargs="+", default=["gaussian", "quantum"], choices=["gaussian", "quantum"])
    ap.add_argument("--n", nargs="+", type=int, default=[4096])
    ap.add_argument("--d", type=int, default=4, help="density-matrix dimension")
    ap.add_argument("--sums", nargs="+", default=["slice", "tile"], choices=["slice", "tile", "kahan"])
    ap.add_argument("--tile", type=int, default=64, help="others per float32 partial (--sums tile, kahan)")
    args = ap.parse_args()
    print(f"{'family':>8} {'case':>5} {'N':>7} {'sums':>6}  max-norm relative error of each gradient")
    for family in args.family:
        for N in args.n:
            label, evaluate = family_case(family, N, args.d)
            exact = evaluate(pairwise.pairwise_dense)
            for sums in args.sums:
                g = evaluate(summed_in_float32(sums, args.tile))
                errs = " ".join(
                    f"{k} {float(np.abs(g[k] - exact[k]).max() / np.abs(exact[k]).max()):.1e}" for k in exact
                )
                print(f"{family:>8} {label:>5} {N:>7} {sums:>6}  {errs}", flush=True)


if __name__ == "__main__":
    main()
