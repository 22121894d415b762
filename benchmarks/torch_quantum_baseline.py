"""Baseline: the PyTorch autograd version of the density-matrix free energy a user would write
(issue 10): self + belief terms, dense softmin.

Per agent ``torch.linalg.eigh`` for log x and ``torch.linalg.matrix_exp`` for the Gibbs prior and the
frames; all D_ij = tr(x~_i log x~_i) - tr(x~_i log x~_j) as one real (N, 2 d^2) x (2 d^2, N) product
(``tr(a b) = Re a . Re b + Im a . Im b`` for Hermitian a, b); the softmin over each row without the
diagonal; ``backward()`` for the gradient of every input. PyTorch is not a dependency of vfesim: only this
script (run by ``bench_quantum.py --torch``) imports it.

    python benchmarks/torch_quantum_baseline.py --sizes 1024 4096 16384 65536 --ds 4 8
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import vfesim
from vfesim.quantum import spin_generators

EPS = {torch.complex128: 1e-12, torch.complex64: 1e-6}


def free_energy(rho, H, T, phi, J, kappa=1.0):
    N, d, _ = rho.shape
    eye = torch.eye(d, dtype=rho.dtype, device=rho.device)
    eps = EPS[rho.dtype]
    x = (1 - eps) * 0.5 * (rho + rho.mH) + (eps / d) * eye
    s, W = torch.linalg.eigh(x)
    log_x = (W * torch.log(s).to(rho.dtype).unsqueeze(-2)) @ W.mH
    # Gibbs prior by matrix_exp, normalised; log sigma = -H/T - log Z.
    Hh = 0.5 * (H + H.mH)
    e = torch.linalg.matrix_exp(-Hh / T[:, None, None].to(rho.dtype))
    Z = torch.diagonal(e, dim1=-2, dim2=-1).sum(-1).real
    log_sigma = -Hh / T[:, None, None].to(rho.dtype) - torch.log(Z)[:, None, None].to(rho.dtype) * eye
    tr = lambda a, b: torch.einsum("nkl,nlk->n", a, b).real
    self_term = (tr(x, log_x) - tr(x, log_sigma)).sum()
    # Frames and pulled-back states.
    U = torch.linalg.matrix_exp(-1j * torch.einsum("na,akl->nkl", phi.to(rho.dtype), J))
    xt = U.mH @ x @ U
    lt = U.mH @ log_x @ U
    A = torch.view_as_real(xt).reshape(N, -1)
    B = torch.view_as_real(lt).reshape(N, -1)
    c = tr(x, log_x)
    D = c[:, None] - A @ B.T
    logits = -D / kappa
    logits = logits.masked_fill(torch.eye(N, dtype=torch.bool, device=rho.device), float("-inf"))
    belief = (-kappa * torch.logsumexp(logits, dim=1)).sum()
    return self_term + belief


def bench(N: int, d: int, dtype: str, reps: int = 5) -> dict:
    cfg = vfesim.QuantumConfig(d=d, lambda_prior=0.0)
    st = vfesim.random_state(cfg, n_agents=N, seed=0, dtype=dtype)
    dev = torch.device("cuda")
    leaf = lambda a: torch.tensor(np.asarray(a), device=dev, requires_grad=True)
    rho, H, T, phi = (leaf(st[k].values) for k in ("rho", "hamiltonian", "temperature", "phi"))
    J = torch.tensor(spin_generators(d), device=dev, dtype=rho.dtype)
    row = dict(kind="torch", N=N, d=d, dtype=dtype)
    try:
        times = []
        for r in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for a in (rho, H, T, phi):
                a.grad = None
            F = free_energy(rho, H, T, phi, J)
            F.backward()
            torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - t0)
        row["t_s"] = float(np.median(times))
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # what the baseline does at large N
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--ds", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--dtypes", nargs="*", default=["complex128", "complex64"])
    args = ap.parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        for d in args.ds:
            for N in args.sizes:
                rows.append(bench(N, d, dtype))
                print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
