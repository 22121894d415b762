"""Baseline: the PyTorch autograd version of the rollout of benchmarks/bench_quantum_dynamics.py, as a user
would write it (issue 13): the same model and loss, ``torch.linalg.matrix_exp`` for the propagators
U_i = exp(-i H_i dt) and the frames exp(-i phi_i . J), the Gibbs priors left out (no thermalising channel
in the benchmark problem), and ``backward()`` through all T steps (autograd keeps every intermediate:
memory ~ T (w + 4) N d^2 complex numbers; sizes that do not fit are reported as such).

Per step, for every agent i (Jacobi: senders read the states at t):
    x <- (1 - e_ik) x + e_ik tr(x) M_ik rho_j M_ik^dag,  k = 1..w (j = i - k, e_ik = eps0 exp(-k/ell))
    y <- U_i x U_i^dag;  z <- (1 - g) y + g diag(y), g = 1 - exp(-gamma dt)
    loss += -log((1 - f) z[y_ti, y_ti] + f/d)   (f = 1e-12 c128, 1e-6 c64)

PyTorch is not a dependency of vfesim: only this script (and bench_quantum_dynamics.py --torch) imports it.

    python benchmarks/torch_quantum_rollout.py --sizes 4096 65536 --ds 2 4 8 --dtypes complex128
    python benchmarks/torch_quantum_rollout.py --check      # loss and gradients vs vfesim.quantum.rollout
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import vfesim
from vfesim.quantum import spin_generators

FLOOR = {torch.complex128: 1e-12, torch.complex64: 1e-6}
DT, EPS0, ELL, GAMMA = 0.09, 0.3, 1.618, 0.2


def inputs(N: int, d: int, dtype: str, T: int, device, seed: int = 0):
    """The benchmark problem's arrays (same seeds as bench_quantum_dynamics.problem) as torch tensors."""
    cfg = vfesim.QuantumConfig(d=d, lambda_belief=0.0)
    st = vfesim.random_state(cfg, N, seed=seed, dtype=dtype)
    y = np.random.default_rng(seed).integers(0, d, size=(T, N))
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)
    J = torch.as_tensor(spin_generators(d), device=device).to(getattr(torch, dtype))
    return t(st.rho.values), t(st.hamiltonian.values), t(st.phi.values), J, t(y)


def loss_fn(rho, H, phi, J, y, T: int, window: int):
    N, d, _ = rho.shape
    dev, cdt = rho.device, rho.dtype
    f = FLOOR[cdt]
    K = torch.einsum("na,akl->nkl", phi.to(cdt), J)
    Uf = torch.linalg.matrix_exp(-1j * K)
    U = torch.linalg.matrix_exp(-1j * DT * 0.5 * (H + H.mH))
    i = torch.arange(N, device=dev)
    ks = torch.arange(1, window + 1, device=dev)
    j = i[:, None] - ks[None, :]
    mask = j >= 0
    j = j.clamp(min=0)  # masked senders get eps = 0
    eps = (EPS0 * torch.exp(-ks.double() / ELL))[None, :].expand(N, -1) * mask
    eps = eps.to(rho.real.dtype)
    M = Uf[:, None] @ Uf[j].mH  # (N, w, d, d) transports U_i U_j^dag
    g = 1.0 - np.exp(-GAMMA * DT)
    eye = torch.eye(d, dtype=cdt, device=dev)
    loss = torch.zeros((), dtype=rho.real.dtype, device=dev)
    for t in range(T):
        x = rho
        S = M @ rho[j] @ M.mH
        for k in range(window):
            e = eps[:, k, None, None]
            trx = torch.diagonal(x, dim1=-2, dim2=-1).sum(-1)[:, None, None]
            x = (1 - e) * x + e * trx * S[:, k]
        x = U @ x @ U.mH
        rho = (1 - g) * x + g * (x * eye)
        p = torch.diagonal(rho, dim1=-2, dim2=-1).real.gather(1, y[t][:, None])[:, 0]
        loss = loss - torch.log((1 - f) * p + f / d).sum()
    return loss


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(N: int, d: int, dtype: str, T: int, window: int, reps: int = 3) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rho, H, phi, J, y = inputs(N, d, dtype, T, device)
    times = []
    try:
        for _ in range(reps + 1):
            r, h, p = (a.clone().requires_grad_(True) for a in (rho, H, phi))
            sync(device)
            t0 = time.perf_counter()
            loss = loss_fn(r, h, p, J, y, T, window)
            loss.backward()
            sync(device)
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        return {"torch_rollout_s": float("nan"), "torch_note": "out of memory"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"torch_rollout_s": float(np.median(times[1:])), "torch_loss": float(loss)}


def check(N: int = 12, d: int = 3, T: int = 6, window: int = 3) -> None:
    """Loss and gradients (rho, H, phi) of this model against vfesim.quantum.rollout (complex128)."""
    from vfesim.quantum import QuantumDynamics, Schedule, rollout
    from vfesim.quantum.channels import causal_window

    cfg = vfesim.QuantumConfig(d=d, lambda_belief=0.0)
    st = vfesim.random_state(cfg, N, seed=0)
    yy = np.random.default_rng(0).integers(0, d, size=(T, N))
    dyn = QuantumDynamics(
        coupling_strength=EPS0, coupling_length=ELL, neighbours=causal_window(N, window), dephasing_rate=GAMMA
    )
    res = rollout(st, cfg, Schedule(dyn, DT, T, yy), "born")
    rho, H, phi, J, y = inputs(N, d, "complex128", T, torch.device("cpu"))
    r, h, p = (a.clone().requires_grad_(True) for a in (rho, H, phi))
    loss = loss_fn(r, h, p, J, y, T, window)
    loss.backward()
    # torch's gradient of a real loss w.r.t. a complex Z is conj(dL/dRe Z + i dL/dIm Z); vfesim's Hermitian
    # cotangent G (dL = tr(G dZ)) pairs with it as G = herm(conj(grad))^T, compared on traceless parts.
    herm = lambda X: 0.5 * (X + X.conj().swapaxes(-1, -2))
    tl = lambda X: X - np.trace(X, axis1=-2, axis2=-1)[:, None, None] / d * np.eye(d)
    g_rho = tl(herm(r.grad.numpy().conj()).swapaxes(-1, -2))
    g_H = herm(h.grad.numpy().conj()).swapaxes(-1, -2)
    print(f"loss   vfesim {res.loss:.15g}  torch {float(loss):.15g}")
    for name, a, b in (
        ("rho", res.grads["rho"], g_rho),
        ("hamiltonian", res.grads["hamiltonian"], g_H),
        ("phi", res.grads["phi"], p.grad.numpy()),
    ):
        print(f"{name:12s} max |vfesim - torch| = {np.abs(a - b).max():.3g} (scale {np.abs(a).max():.3g})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="*", default=[4096])
    ap.add_argument("--ds", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--dtypes", nargs="*", default=["complex128"])
    ap.add_argument("--T", type=int, default=100)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    if args.check:
        check()
        return
    print(f"# torch {torch.__version__}, T = {args.T}, window = {args.window}")
    for N in args.sizes:
        for d in args.ds:
            for dt in args.dtypes:
                print(N, d, dt, bench(N, d, dt, args.T, args.window), flush=True)


if __name__ == "__main__":
    main()
