"""PNG figures of a run (``vfesim plot``): energies, final attention, belief paths, frame angles."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .family import family_of
from .io.reader import open_run
from .io.store import StoreError
from .observables import attention_entropy as _row_entropy
from .observables import rotation_angle
from .schema import term_var, var_term

__all__ = [
    "plot_run",
    "plot_energy",
    "plot_attention",
    "plot_beliefs",
    "plot_frames",
    "rotation_angle",
    "attention_entropy",
]

MAX_PATHS = 200
MAX_ATTENTION = 600
MAX_ENTROPY_FRAMES = 60
MAX_ENTROPY_AGENTS = 4096


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


TOP = (
    (term_var("total"), "F (free energy)"),
    (term_var("hamiltonian"), "H = F + kinetic"),
    (term_var("kinetic"), "kinetic"),
)


def run_config(ds):
    """The model config of a run store (any family): its ``model_config``, or, where that records sparse
    neighbour lists by their shape only, the config of its scenario (``population.neighbours`` rebuilds
    the lists)."""
    from .config import ConfigError
    from .family import family_named
    from .scenario import Scenario

    try:
        return family_named(ds.attrs["agent_family"]).config_type.from_json(ds.attrs["model_config"])
    except ConfigError as e:
        if e.key != "neighbours":
            raise
        return Scenario.from_json(ds.attrs["scenario"]).model


def plot_energy(ds, path: Path) -> Path:
    """F (and H, kinetic energy for Hamiltonian runs) on top, the terms of F below, against time."""
    plt = _plt()
    t = ds["time"].values
    fig, (a0, a1) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, constrained_layout=True)
    for k, label in TOP:
        if k in ds:
            a0.plot(t, ds[k].values, lw=1.6, label=label)
    a0.set_ylabel("energy (nats)")
    a0.set_title("free energy" + (" and Hamiltonian" if term_var("hamiltonian") in ds else ""))
    a0.legend(loc="best")
    zero = []
    top = {k for k, _ in TOP}
    for k in ds.data_vars:  # the family's terms, in the order the store has them
        term = var_term(k)
        if term is None or k in top:
            continue
        v = ds[k].values
        if np.all(v == 0):
            zero.append(term)
            continue
        a1.plot(t, v, lw=1.3, label=term)
    a1.set_xlabel("time (step * dt)")
    a1.set_ylabel("term (nats)")
    title = "terms of F"
    if zero:
        title += f" (identically zero: {', '.join(zero)})"
    a1.set_title(title, fontsize=10)
    if a1.lines:
        a1.legend(loc="best")
    for a in (a0, a1):
        a.grid(alpha=0.3)
        _log_if_it_helps(a)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_if_it_helps(ax) -> None:
    """Log y-axis when every plotted curve is positive and they span more than a factor of 20."""
    ys = [np.asarray(line.get_ydata(), float) for line in ax.lines]
    ys = [y[np.isfinite(y)] for y in ys]
    if ys and all(y.size and y.min() > 0 for y in ys):
        lo, hi = min(y.min() for y in ys), max(y.max() for y in ys)
        if hi / lo > 20:
            ax.set_yscale("log")


def _pca(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and top-2 principal axes (2, K) of rows of ``x`` (K = 1 pads with zero)."""
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    axes = np.zeros((2, x.shape[1]))
    axes[: min(2, vt.shape[0])] = vt[:2]
    return mean, axes


def _frame_arrays(ds, i: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The state variables of frame ``i`` (those saved once included)."""
    frame = ds.isel(time=i)
    return {k: frame[k].values for k in family_of(cfg).variables if k in frame}


def _dense_attention(arrays: dict[str, np.ndarray], cfg: ModelConfig) -> np.ndarray:
    """Belief attention beta (N, N) of one frame; pairs that are not neighbours are 0."""
    beta = np.asarray(family_of(cfg).attention(arrays, cfg, "belief"))
    if cfg.dense:
        return beta
    n, nb = beta.shape[0], cfg.neighbours
    dense = np.zeros((n, n))
    rows = np.repeat(np.arange(n)[:, None], nb.width, axis=1)
    dense[rows[nb.mask], nb.index[nb.mask]] = beta[nb.mask]
    return dense


def attention_entropy(beta: np.ndarray, n_neighbours: np.ndarray) -> np.ndarray:
    """Normalised attention entropy per receiver, H_i / log(n_i) in [0, 1]: 1 when agent i attends
    to all its n_i neighbours equally, 0 when it attends to one. beta (N, N) or (N, k); NaN where
    n_i < 2."""
    H = _row_entropy(beta)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(n_neighbours >= 2, H / np.log(n_neighbours), np.nan)


def _entropy_over_time(ds, cfg: ModelConfig, max_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """Times (T,) and normalised attention entropy (T, N) on at most ``max_frames`` frames."""
    T = ds.sizes["time"]
    frames = np.unique(np.linspace(0, T - 1, min(T, max_frames)).astype(int))
    n = ds.sizes["agent"]
    counts = np.full(n, n - 1) if cfg.dense else cfg.neighbours.mask.sum(axis=1)
    if "attention_entropy" in ds:  # saved by the run (nats): normalise
        with np.errstate(divide="ignore", invalid="ignore"):
            H = ds["attention_entropy"].isel(time=frames).values / np.log(counts)
        return ds["time"].values[frames], np.where(counts >= 2, H, np.nan)
    H = []
    for f in frames:
        arrays = _frame_arrays(ds, int(f), cfg)
        beta = np.asarray(family_of(cfg).attention(arrays, cfg, "belief"))
        H.append(attention_entropy(beta, counts))
    return ds["time"].values[frames], np.array(H)


def plot_attention(ds, cfg: ModelConfig, path: Path) -> Path:
    """Belief attention beta_ij at the first and last frame (agents sorted by that frame's belief PC1,
    one colour scale), and the normalised attention entropy of every agent over time."""
    plt = _plt()
    from matplotlib.colors import PowerNorm

    n = ds.sizes["agent"]
    panels = []
    for i in (0, -1):
        arrays = _frame_arrays(ds, i, cfg)
        beta = ds["attention"].isel(time=i).values if "attention" in ds else _dense_attention(arrays, cfg)
        mean, axes = _pca(arrays["mu_q"])
        order = np.argsort((arrays["mu_q"] - mean) @ axes[0], kind="stable")
        if n > MAX_ATTENTION:
            order = order[:: int(np.ceil(n / MAX_ATTENTION))]
        panels.append(beta[np.ix_(order, order)])
    off = np.concatenate([b[b > 0] for b in panels])
    # A few near-one weights would flatten the colour scale: clip at the 99th percentile. Pairs that
    # are not neighbours (the diagonal, sparse gaps) are drawn grey rather than as weight 0.
    vmax = float(np.quantile(off, 0.99)) if off.size else 1.0
    vmin = float(np.quantile(off, 0.01)) if off.size else 0.0
    vmin = 0.0 if vmin < 0.5 * vmax else vmin
    cmap = plt.get_cmap("magma").with_extremes(bad="0.75")
    norm = PowerNorm(0.5, vmin=vmin, vmax=vmax)

    fig = plt.figure(figsize=(11, 9), constrained_layout=True)
    grid = fig.add_gridspec(2, 2, height_ratios=(1.25, 1))
    shown = f"{len(panels[0])} of {n}" if len(panels[0]) < n else f"{n}"
    t0, t1 = ds["time"].values[[0, -1]]
    for j, (b, t) in enumerate(zip(panels, (t0, t1), strict=True)):
        ax = fig.add_subplot(grid[0, j])
        im = ax.imshow(np.where(b > 0, b, np.nan), cmap=cmap, interpolation="nearest", norm=norm)
        ax.set_title(f"belief attention at t = {t:g}\n({shown} agents, sorted by belief PC1)", fontsize=10)
        ax.set_xlabel("sender j")
        ax.set_ylabel("receiver i")
    extend = "max" if off.size and off.max() > vmax else "neither"
    fig.colorbar(im, ax=fig.axes, extend=extend, label="beta_ij (row i attends to column j)", shrink=0.8)

    ax = fig.add_subplot(grid[1, :])
    if n <= MAX_ENTROPY_AGENTS or "attention_entropy" in ds:
        times, H = _entropy_over_time(ds, cfg, MAX_ENTROPY_FRAMES)
    else:  # every frame costs an N x N attention matrix
        times, H = np.zeros(0), np.zeros((0, n))
        ax.text(0.5, 0.5, f"not computed for {n} > {MAX_ENTROPY_AGENTS} agents", ha="center")
    if np.isfinite(H).any():
        lo, med, hi = np.nanpercentile(H, [10, 50, 90], axis=1)
        ax.fill_between(times, lo, hi, alpha=0.3, label="10-90% of agents")
        ax.plot(times, med, lw=1.8, label="median agent")
        ax.legend(loc="best")
    ax.set_xlabel("time (step * dt)")
    ax.set_ylabel("H(beta_i.) / log(neighbours)")
    ax.set_title(
        "attention entropy per agent (1: attends to all neighbours equally; lower: to a few)", fontsize=10
    )
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_beliefs(ds, path: Path) -> Path:
    """Belief-mean trajectories projected on the top two principal axes of all frames."""
    plt = _plt()
    n = ds.sizes["agent"]
    pick = np.arange(n) if n <= MAX_PATHS else np.linspace(0, n - 1, MAX_PATHS).astype(int)
    mu = ds["mu_q"].isel(agent=pick).values  # (T, n, K)
    T, m, K = mu.shape
    mean, axes = _pca(mu.reshape(T * m, K))
    xy = (mu - mean) @ axes.T  # (T, n, 2)
    fig, ax = plt.subplots(figsize=(6.4, 5.6), constrained_layout=True)
    colour = plt.get_cmap("viridis")(np.linspace(0, 1, m)[np.argsort(np.argsort(xy[0, :, 0]))])
    for j in range(m):
        ax.plot(xy[:, j, 0], xy[:, j, 1], color=colour[j], lw=0.7, alpha=0.6)
    ax.scatter(xy[0, :, 0], xy[0, :, 1], s=14, facecolors="none", edgecolors=colour, label="start")
    ax.scatter(xy[-1, :, 0], xy[-1, :, 1], s=18, c=colour, marker="o", label="end")
    ax.set_xlabel("belief PC1")
    ax.set_ylabel("belief PC2")
    shown = f"{m} of {n}" if m < n else f"{n}"
    ax.set_title(f"belief means mu_q over time ({shown} agents, coloured by start PC1)", fontsize=10)
    ax.legend(loc="best")
    ax.set_aspect("equal", adjustable="datalim")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_frames(ds, path: Path) -> Path:
    """Histogram of the frame rotation angles (|phi_i| reduced to [0, pi]) at the first and last frame.

    Hamiltonian runs carry phi freely, so |phi| can exceed pi; the reduced angle is the same rotation.
    """
    plt = _plt()
    phi0 = ds["phi"].isel(time=0).values
    phi1 = ds["phi"].isel(time=-1).values
    bins = np.linspace(0, np.pi, 37)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), constrained_layout=True)
    t0, t1 = ds["time"].values[[0, -1]]
    ax.hist(rotation_angle(phi0), bins=bins, alpha=0.5, label=f"t = {t0:g}")
    ax.hist(rotation_angle(phi1), bins=bins, histtype="step", lw=2, label=f"t = {t1:g}")
    ax.set_xlabel("frame rotation angle (|phi| reduced to [0, pi], rad)")
    ax.set_ylabel("agents")
    ax.set_xlim(0, np.pi)
    title = "distribution of frame rotation angles"
    wrapped = int(np.sum(np.linalg.norm(phi1, axis=-1) > np.pi))
    if wrapped:
        title += f"\n({wrapped} of {len(phi1)} agents end with |phi| > pi, shown reduced)"
    ax.set_title(title, fontsize=10)
    ax.legend(loc="best")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Figures of the other families: family name -> module with ``figures(ds, outdir) -> [paths]``.
FAMILY_FIGURES = {"quantum": "vfesim.plots_quantum", "field": "vfesim.plots_fields"}
# Families whose figures take ``time`` (maps at a chosen time).
TIMED = ("field",)


def plot_run(store: str | Path, outdir: str | Path, *, time: float | None = None) -> list[Path]:
    """Write energy.png, attention.png, beliefs.png and frames.png for a run (other families: their
    module in FAMILY_FIGURES); return the paths. ``time``: the model time of the maps of a field run
    (nearest saved frame; default the last)."""
    ds = open_run(store)
    if ds.sizes["time"] == 0:
        raise StoreError(f"{store}: no saved frames to plot")
    family = ds.attrs.get("agent_family", "gaussian")
    if time is not None and family not in TIMED:
        raise ValueError(f"time: maps at a chosen time are drawn for field runs, this is a {family} run")
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    if family in FAMILY_FIGURES:
        kw = {"time": time} if family in TIMED else {}
        return importlib.import_module(FAMILY_FIGURES[family]).figures(ds, outdir, **kw)
    cfg = run_config(ds)
    return [
        plot_energy(ds, outdir / "energy.png"),
        plot_attention(ds, cfg, outdir / "attention.png"),
        plot_beliefs(ds, outdir / "beliefs.png"),
        plot_frames(ds, outdir / "frames.png"),
    ]
