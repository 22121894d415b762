"""Figures of field-agent runs (``vfesim plot``): F and its terms, maps at a chosen time, agents' belief
maps, and an animation of a 2-D run.

Maps (one frame, at ``time``; default the last saved one), every quantity weighted by the supports chi_i:

- ``|mu_q|``: sum_i chi_i |mu_i(c)| / sum_i chi_i, the size of the beliefs at c;
- local spread: the RMS distance of mu_i(c) from the chi-weighted mean of the agents at c (0: local
  consensus);
- frame angle ``|phi|``: the chi-weighted mean rotation angle in [0, pi];
- attention: the chi-weighted mean over receivers of the normalised entropy of their attention at c,
  H(beta_i.(c)) / log(number of neighbours at c), in [0, 1] (1: attends to all neighbours there equally).

2-D grids draw these as images over (x, y) (with the supports' chi = 0.5 contours); 1-D grids as
(agent, x) images of each agent's own value (blank outside its support).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .fields import FieldConfig
from .fields.energy import attention
from .fields.supports import neighbour_lists
from .observables import rotation_angle
from .plots import _plt, plot_energy, run_config

__all__ = ["figures", "frame_index", "field_maps", "plot_maps", "plot_agents", "animate"]

log = logging.getLogger("vfesim")

MAX_AGENT_PANELS = 16
MAX_ANIMATION_FRAMES = 40
VARS = ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi", "support")


def frame_index(ds, time: float | None) -> int:
    """The saved frame nearest to model time ``time`` (None: the last one)."""
    if time is None:
        return ds.sizes["time"] - 1
    t = ds["time"].values
    if not np.isfinite(time):
        raise ValueError(f"time: must be a finite model time, got {time}")
    return int(np.argmin(np.abs(t - float(time))))


def _frame(ds, i: int) -> dict[str, np.ndarray]:
    f = ds.isel(time=i)
    return {k: np.asarray(f[k].values) for k in VARS if k in f}


def _wmean(chi: np.ndarray, v: np.ndarray) -> np.ndarray:
    """sum_i chi_i v_i / sum_i chi_i over agents (axis 0); NaN where no agent covers the point."""
    tot = chi.sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, (chi * v).sum(axis=0) / np.where(tot > 0, tot, 1.0), np.nan)


def _spread(chi: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Per agent and point, |mu_i(c) - m(c)|^2 with m the chi-weighted mean at c: (N, *grid)."""
    tot = chi.sum(axis=0)
    m = (chi[..., None] * mu).sum(axis=0) / np.where(tot > 0, tot, 1.0)[..., None]
    return np.sum((mu - m) ** 2, axis=-1)


def _entropy(arrays: dict, cfg: FieldConfig) -> np.ndarray:
    """Normalised attention entropy of each agent at each point (N, *grid); NaN where the agent is
    absent or has fewer than two neighbours there."""
    chi = arrays["support"]
    n = chi.shape[0]
    beta = attention(arrays, cfg, "belief").reshape(n, chi[0].size, -1)
    index, mask = neighbour_lists(chi, cfg)
    flat = chi.reshape(n, -1) > 0
    present = np.swapaxes(flat[index], 1, 2) & mask[:, None, :] & flat[:, :, None]  # (N, P, k)
    count = present.sum(axis=-1)
    H = -np.sum(beta * np.log(np.where(beta > 0, beta, 1.0)), axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(flat & (count >= 2), H / np.log(np.maximum(count, 2)), np.nan)
    return out.reshape(chi.shape)


def field_maps(arrays: dict, cfg: FieldConfig, with_attention: bool = True) -> dict[str, np.ndarray]:
    """Per-agent maps (N, *grid) of one frame: ``mu`` |mu_q|, ``spread`` |mu_i - m|^2, ``angle`` the frame
    angle, ``entropy`` the normalised attention entropy (with_attention), NaN outside the supports."""
    chi = np.asarray(arrays["support"], np.float64)
    mu = np.asarray(arrays["mu_q"], np.float64)
    out = {
        "mu": np.linalg.norm(mu, axis=-1),
        "spread": _spread(chi, mu),
        "angle": rotation_angle(arrays["phi"]),
    }
    if with_attention:
        out["entropy"] = _entropy(arrays, cfg)
    return {k: np.where(chi > 0, v, np.nan) for k, v in out.items()}


def _population_maps(maps: dict, chi: np.ndarray) -> dict[str, np.ndarray]:
    """The chi-weighted means over agents of per-agent maps (local spread: its square root)."""
    w = np.asarray(chi, np.float64)
    out = {}
    for k, v in maps.items():
        ok = np.isfinite(v)
        out[k] = _wmean(np.where(ok, w, 0.0), np.where(ok, v, 0.0))
    out["spread"] = np.sqrt(out["spread"])
    return out


TITLES = {
    "mu": ("|mu_q| (support-weighted mean)", "viridis", None),
    "spread": ("local spread of mu_q (0: consensus)", "magma", None),
    "angle": ("frame angle |phi| (rad)", "plasma", (0.0, None)),
    "entropy": ("attention entropy / log(neighbours)", "cividis", (0.0, 1.0)),
}


def _extent(ds) -> list[float]:
    x, y = ds["x"].values, ds["y"].values
    hx = 0.5 * (x[1] - x[0]) if x.size > 1 else 0.5
    hy = 0.5 * (y[1] - y[0]) if y.size > 1 else 0.5
    return [x[0] - hx, x[-1] + hx, y[0] - hy, y[-1] + hy]


def plot_maps(ds, cfg: FieldConfig, path: Path, i: int) -> Path:
    """Maps of |mu_q|, the local spread, the frame angle and the attention entropy at frame ``i``."""
    plt = _plt()
    arrays = _frame(ds, i)
    maps = field_maps(arrays, cfg)
    t = float(ds["time"].values[i])
    fig, axes = plt.subplots(2, 2, figsize=(10, 8.4), constrained_layout=True)
    if cfg.ndim == 2:
        pop = _population_maps(maps, arrays["support"])
        ext = _extent(ds)
        for ax, k in zip(axes.ravel(), TITLES, strict=True):
            title, cmap, lim = TITLES[k]
            lo, hi = lim or (None, None)
            im = ax.imshow(pop[k].T, origin="lower", extent=ext, cmap=cmap, vmin=lo, vmax=hi,
                           interpolation="nearest")  # fmt: skip
            fig.colorbar(im, ax=ax, shrink=0.85)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("x")
            ax.set_ylabel("y")
        x, y = ds["x"].values, ds["y"].values
        for chi in arrays["support"]:
            if chi.max() > 0.5 and chi.min() < 0.5:
                axes[0, 0].contour(x, y, chi.T, levels=[0.5], colors="white", linewidths=0.6, alpha=0.7)
        what = "population maps (agents weighted by their supports; white: chi_i = 0.5)"
    else:
        x = ds["x"].values
        n = arrays["support"].shape[0]
        for ax, k in zip(axes.ravel(), TITLES, strict=True):
            title, cmap, lim = TITLES[k]
            lo, hi = lim or (None, None)
            v = np.sqrt(maps[k]) if k == "spread" else maps[k]
            im = ax.pcolormesh(x, np.arange(n), v, cmap=cmap, vmin=lo, vmax=hi, shading="nearest")
            fig.colorbar(im, ax=ax, shrink=0.85)
            ax.set_title(title.replace(" (support-weighted mean)", ""), fontsize=10)
            ax.set_xlabel("x")
            ax.set_ylabel("agent")
        what = "each agent's fields (blank outside its support)"
    fig.suptitle(f"field run at t = {t:g} (step {int(ds['step'].values[i])}): {what}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_agents(ds, cfg: FieldConfig, path: Path, i: int) -> Path:
    """|mu_q| of up to MAX_AGENT_PANELS agents at frame ``i`` (2-D), one colour scale, blank outside the
    support; 1-D: |mu_i(x)| as lines."""
    plt = _plt()
    arrays = _frame(ds, i)
    mu = field_maps(arrays, cfg, with_attention=False)["mu"]
    n = mu.shape[0]
    pick = np.arange(n) if n <= MAX_AGENT_PANELS else np.linspace(0, n - 1, MAX_AGENT_PANELS).astype(int)
    t = float(ds["time"].values[i])
    if cfg.ndim == 1:
        fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
        for j in pick:
            ax.plot(ds["x"].values, mu[j], lw=1.2, label=f"agent {j}")
        ax.set_xlabel("x")
        ax.set_ylabel("|mu_q|")
        if pick.size <= 10:
            ax.legend(loc="best", fontsize=8)
    else:
        cols = int(np.ceil(np.sqrt(pick.size)))
        rows = int(np.ceil(pick.size / cols))
        fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols + 1, 2.4 * rows), squeeze=False,
                                 constrained_layout=True)  # fmt: skip
        vmax = float(np.nanmax(mu[pick]))
        ext = _extent(ds)
        for ax in axes.ravel()[pick.size :]:
            ax.axis("off")
        for ax, j in zip(axes.ravel(), pick, strict=False):
            im = ax.imshow(mu[j].T, origin="lower", extent=ext, cmap="viridis", vmin=0, vmax=vmax)
            ax.set_title(f"agent {j}", fontsize=9)
            ax.set_xticks([])
            ax.set_yticks([])
        fig.colorbar(im, ax=axes, shrink=0.8, label="|mu_q|")
    shown = f"{pick.size} of {n}" if pick.size < n else f"{n}"
    fig.suptitle(f"|mu_q| of {shown} agents at t = {t:g}", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pillow() -> bool:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def animate(ds, cfg: FieldConfig, path: Path) -> Path | None:
    """A GIF of the population maps of |mu_q| and the local spread over the run's frames (2-D grids;
    at most MAX_ANIMATION_FRAMES, evenly spaced). None (logged) without Pillow."""
    if not _pillow():
        log.info("animation skipped: it needs Pillow (pip install pillow)")
        return None
    plt = _plt()
    from matplotlib.animation import FuncAnimation, PillowWriter

    T = ds.sizes["time"]
    frames = np.unique(np.linspace(0, T - 1, min(T, MAX_ANIMATION_FRAMES)).astype(int))
    pops = []
    for i in frames:
        arrays = _frame(ds, int(i))
        pops.append(_population_maps(field_maps(arrays, cfg, with_attention=False), arrays["support"]))
    ext = _extent(ds)
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.4), constrained_layout=True)
    images = []
    for ax, k in zip(axes, ("mu", "spread"), strict=True):
        title, cmap, _ = TITLES[k]
        vals = np.stack([p[k] for p in pops])
        im = ax.imshow(pops[0][k].T, origin="lower", extent=ext, cmap=cmap, vmin=np.nanmin(vals),
                       vmax=np.nanmax(vals), interpolation="nearest")  # fmt: skip
        fig.colorbar(im, ax=ax, shrink=0.85)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        images.append((im, k))
    label = fig.suptitle("")
    times = ds["time"].values[frames]

    def draw(j):
        for im, k in images:
            im.set_data(pops[j][k].T)
        label.set_text(f"t = {times[j]:g}")
        return [im for im, _ in images] + [label]

    anim = FuncAnimation(fig, draw, frames=len(frames), blit=False)
    anim.save(path, writer=PillowWriter(fps=8), dpi=80)
    plt.close(fig)
    return path


def figures(ds, outdir: Path, time: float | None = None) -> list[Path]:
    """Every figure of a field run: energy.png, maps.png and agents.png at ``time`` (default: the last
    frame) and, for a 2-D grid with several frames, animation.gif."""
    cfg = run_config(ds)
    i = frame_index(ds, time)
    out = [
        plot_energy(ds, outdir / "energy.png"),
        plot_maps(ds, cfg, outdir / "maps.png", i),
        plot_agents(ds, cfg, outdir / "agents.png", i),
    ]
    if cfg.ndim == 2 and ds.sizes["time"] > 1:
        gif = animate(ds, cfg, outdir / "animation.gif")
        if gif is not None:
            out.append(gif)
    return out
