"""PNG figures of density-matrix runs (``vfesim plot``): F and its terms, purity and von Neumann entropy
over time, the belief attention matrix, Bloch vectors (d = 2); fit runs: loss, gradient and H error."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .family import family_named
from .plots import _plt, plot_energy, run_config
from .quantum import QuantumConfig
from .schema import term_var

__all__ = ["figures", "plot_purity_entropy", "plot_attention", "plot_bloch", "plot_fit", "bloch_vectors"]

MAX_FRAMES = 200
MAX_AGENTS = 2000
MAX_LINES = 24
MAX_BLOCH = 16


def _frames(ds, limit: int) -> np.ndarray:
    T = ds.sizes["time"]
    return np.unique(np.linspace(0, T - 1, min(T, limit)).astype(int))


def _agents(n: int, limit: int) -> np.ndarray:
    return np.arange(n) if n <= limit else np.linspace(0, n - 1, limit).astype(int)


def purity_entropy(rho: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Purity tr rho^2 and von Neumann entropy S(rho) of states (..., d, d)."""
    s = np.linalg.eigvalsh(0.5 * (rho + np.conj(np.swapaxes(rho, -1, -2))))
    pos = s > 0
    return np.sum(s * s, axis=-1), -np.sum(np.where(pos, s * np.log(np.where(pos, s, 1.0)), 0.0), axis=-1)


def plot_purity_entropy(ds, path: Path) -> Path:
    """Purity and entropy of every agent over time: median, 10-90% band and a few agents' curves; the
    bounds 1/d and log d dashed."""
    plt = _plt()
    f = _frames(ds, MAX_FRAMES)
    pick = _agents(ds.sizes["agent"], MAX_AGENTS)
    rho = ds["rho"].isel(time=f, agent=pick).values
    t = ds["time"].values[f]
    d = rho.shape[-1]
    P, S = purity_entropy(rho)
    fig, axes = plt.subplots(2, 1, figsize=(7, 6), sharex=True, constrained_layout=True)
    lines = pick.size <= MAX_LINES
    for ax, v, name, bound in (
        (axes[0], P, "purity tr rho^2", 1 / d),
        (axes[1], S, "entropy S(rho)", np.log(d)),
    ):
        if lines:
            ax.plot(t, v, lw=0.8, alpha=0.6)
        else:
            lo, med, hi = np.percentile(v, [10, 50, 90], axis=1)
            ax.fill_between(t, lo, hi, alpha=0.3, label="10-90% of agents")
            ax.plot(t, med, lw=1.8, label="median agent")
            ax.legend(loc="best")
        ax.axhline(bound, ls="--", color="0.5", lw=1)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_title(
        f"purity and von Neumann entropy ({'each of the ' if lines else ''}{pick.size} agents; "
        f"dashed: maximally mixed, 1/d and log d)",
        fontsize=10,
    )
    axes[1].set_xlabel("time (step * dt)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _frame_arrays(ds, i: int) -> dict[str, np.ndarray]:
    frame = ds.isel(time=i)
    return {k: frame[k].values for k in frame.data_vars if frame[k].dims[:1] == ("agent",)}


def _dense(beta: np.ndarray, cfg: QuantumConfig) -> np.ndarray:
    if cfg.dense:
        return beta
    n, nb = beta.shape[0], cfg.neighbours
    out = np.zeros((n, n))
    rows = np.repeat(np.arange(n)[:, None], nb.index.shape[1], axis=1)
    out[rows[nb.mask], nb.index[nb.mask]] = beta[nb.mask]
    return out


def plot_attention(ds, cfg: QuantumConfig, path: Path) -> Path:
    """Belief attention beta_ij = softmax_j(-D(rho~_i || rho~_j) / kappa_beta) at the first and last frame
    (agents in index order); pairs that are not neighbours grey."""
    plt = _plt()
    attention = family_named("quantum").attention
    n = ds.sizes["agent"]
    pick = _agents(n, 600)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), constrained_layout=True)
    panels = [_dense(np.asarray(attention(_frame_arrays(ds, i), cfg, "belief")), cfg) for i in (0, -1)]
    off = np.concatenate([b[b > 0] for b in panels])
    vmax = float(off.max()) if off.size else 1.0
    cmap = plt.get_cmap("magma").with_extremes(bad="0.75")
    for ax, b, i in zip(axes, panels, (0, -1), strict=True):
        b = b[np.ix_(pick, pick)]
        im = ax.imshow(np.where(b > 0, b, np.nan), cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"belief attention at t = {ds['time'].values[i]:g}", fontsize=10)
        ax.set_xlabel("sender j")
        ax.set_ylabel("receiver i")
    fig.colorbar(im, ax=list(axes), label="beta_ij (row i attends to column j)", shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bloch_vectors(rho: np.ndarray) -> np.ndarray:
    """Bloch vectors (..., 3) of qubit states (..., 2, 2): rho = (I + r . sigma)/2, r = (2 Re rho_01,
    -2 Im rho_01, rho_00 - rho_11)."""
    r01 = rho[..., 0, 1]
    return np.stack([2 * r01.real, -2 * r01.imag, (rho[..., 0, 0] - rho[..., 1, 1]).real], axis=-1)


def plot_bloch(ds, path: Path) -> Path:
    """Bloch-vector paths of up to MAX_BLOCH agents (d = 2) inside the unit sphere; start open, end filled."""
    plt = _plt()
    pick = _agents(ds.sizes["agent"], MAX_BLOCH)
    r = bloch_vectors(ds["rho"].isel(time=_frames(ds, MAX_FRAMES), agent=pick).values)  # (T, m, 3)
    fig = plt.figure(figsize=(6.4, 6.4), constrained_layout=True)
    ax = fig.add_subplot(projection="3d")
    u, v = np.meshgrid(np.linspace(0, 2 * np.pi, 25), np.linspace(0, np.pi, 13))
    ax.plot_wireframe(np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v), color="0.85", lw=0.4)
    colour = plt.get_cmap("viridis")(np.linspace(0, 1, pick.size))
    for j in range(pick.size):
        ax.plot(r[:, j, 0], r[:, j, 1], r[:, j, 2], color=colour[j], lw=0.8)
    ax.scatter(*r[0].T, s=14, facecolors="none", edgecolors=colour, label="start")
    ax.scatter(*r[-1].T, s=16, c=colour, label="end")
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_zlabel("z")
    ax.set_box_aspect((1, 1, 1))
    n = ds.sizes["agent"]
    ax.set_title(f"Bloch vectors over time ({pick.size} of {n} agents)" if pick.size < n else
                 f"Bloch vectors over time ({n} agents)", fontsize=10)  # fmt: skip
    ax.legend(loc="upper left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_fit(ds, path: Path) -> Path:
    """A fit run: Born loss of the rollout, |dL/dtheta|_inf and the Hamiltonian error per iteration."""
    plt = _plt()
    step = ds["step"].values
    fig, axes = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True, constrained_layout=True)
    for ax, term, label in zip(
        axes,
        ("born_loss", "grad_norm", "hamiltonian_error"),
        ("Born loss of the rollout", "|dL/dtheta|_inf", "rms |traceless(H - H_true)|_F"),
        strict=True,
    ):
        ax.plot(step, ds[term_var(term)].values, lw=1.5)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].set_title("Hamiltonian learning (one Adam step per run step)", fontsize=10)
    axes[-1].set_xlabel("iteration (run step)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figures(ds, outdir: Path) -> list[Path]:
    """Every figure of a density-matrix run: energy.png (F and its terms), purity_entropy.png,
    attention.png and, for d = 2, bloch.png; a fit run: fit.png."""
    if term_var("born_loss") in ds:
        return [plot_fit(ds, outdir / "fit.png")]
    cfg = run_config(ds)
    out = [
        plot_energy(ds, outdir / "energy.png"),
        plot_purity_entropy(ds, outdir / "purity_entropy.png"),
        plot_attention(ds, cfg, outdir / "attention.png"),
    ]
    if cfg.d == 2:
        out.append(plot_bloch(ds, outdir / "bloch.png"))
    return out
