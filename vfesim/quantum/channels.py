"""CPTP channels of density-matrix agents (spec/quantum.md §3.2) and their adjoints (§4.1 R3, R4).

Every channel acts on a batch of states (N, d, d) complex with per-agent strengths eps (N,) in [0, 1]
and is linear in rho (so the adjoints below are exact on all Hermitian directions, not only traceless
ones). Cotangents follow §0: for Hermitian X the cotangent X_bar is Hermitian with dL = tr(X_bar dX).

- computational-basis dephasing  D_eps(rho)   = (1 - eps) rho + eps Delta(rho)           (self-adjoint)
- energy-basis dephasing         D^H_eps(rho) = (1 - eps) rho + eps V Delta(V^dag rho V) V^dag,
                                 H = V diag(lam) V^dag (commutes with exp(-iHt), fixes sigma_i)
- partial replacement (C1) and thermalising channel
                                 M_eps(rho; s) = (1 - eps) rho + eps tr(rho) s
  (C1: s = U_ij rho_j U_ij^dag, U_ij = U_i U_j^dag; thermalising: s = sigma_i, the Gibbs prior)
- neighbour-basis dephasing (C2) C_eps(rho; W) = (1 - eps) rho + eps W Delta(W^dag rho W) W^dag,
  W the eigenvectors of U_ij rho_j U_ij^dag. Its eigenprojectors are not differentiable at degenerate
  spectra (dPi ~ 1/gap), so rho_j (and the frames through U_ij) are **stop-gradient** in C2: the adjoint
  treats W as a constant and is exact only for that surrogate; only eps (hence eps0, ell) and the
  receiving state get cotangents.

Strengths: dephasing eps = 1 - exp(-gamma dt) (the exact Lindblad flow of L_k = sqrt(gamma)|k><k| over
dt, §3.2); coupling eps_ij = eps0 exp(-dist(i, j)/ell) over a neighbour window (dense: every j != i in
increasing order; sparse: the row of a SparseNeighbours, in its order), with dist the Euclidean
distance of agent positions or the sequence distance |i - j|.
"""

from __future__ import annotations

import numpy as np

from ..arrays import array_module as _xp
from ..arrays import host_array
from ..config import SparseNeighbours, resolve_neighbours
from .linalg import dagger, diag_part, herm, pinch, trace

__all__ = [
    "dephasing_strength",
    "dephasing_strength_vjp",
    "dephase",
    "dephase_vjp",
    "dephase_energy",
    "dephase_energy_vjp",
    "mix",
    "mix_vjp",
    "pinch_mix",
    "pinch_mix_vjp",
    "causal_window",
    "coupling_window",
    "pair_distances",
    "coupling_strengths",
    "coupling_strengths_vjp",
    "transports",
    "transports_vjp",
    "incoming_slots",
    "add_incoming",
]


def _col(eps):
    return eps[..., None, None]


def _eye_like(X):
    return _xp(X).eye(X.shape[-1], dtype=X.dtype)


def _tr_real(A, B):
    """Re tr(A B) per matrix (A, B (..., d, d))."""
    return _xp(A).einsum("...kl,...lk->...", A, B).real


# ---------------------------------------------------------------------------------------- strengths


def dephasing_strength(rate, dt):
    """eps = 1 - exp(-rate dt) (rate >= 0, per agent (N,)); eps = 0 for rate = 0 (identity channel)."""
    xp = _xp(rate)
    return -xp.expm1(-rate * dt)


def dephasing_strength_vjp(eps_bar, rate, dt):
    """rate_bar = eps_bar dt exp(-rate dt) (rule R3)."""
    return eps_bar * dt * _xp(rate).exp(-rate * dt)


# -------------------------------------------------------------------------------------- dephasing


def dephase(rho, eps):
    """D_eps(rho) = (1 - eps) rho + eps Delta(rho): rho (N, d, d), eps (N,)."""
    return rho + _col(eps) * (diag_part(rho) - rho)


def dephase_vjp(rho_bar_out, rho_in, eps):
    """Rule R3: rho_bar_in = D_eps(rho_bar_out) (self-adjoint),
    eps_bar = tr(rho_bar_out (Delta(rho) - rho))."""
    return dephase(rho_bar_out, eps), _tr_real(rho_bar_out, diag_part(rho_in) - rho_in)


def dephase_energy(rho, eps, V):
    """D^H_eps(rho) = (1 - eps) rho + eps V Delta(V^dag rho V) V^dag: V (N, d, d) eigenvectors of H_i."""
    return rho + _col(eps) * (pinch(rho, V) - rho)


def dephase_energy_vjp(rho_bar_out, rho_in, eps, V, lam, *, gap_tol: float = 1e-9):
    """Adjoint of :func:`dephase_energy` -> (rho_bar_in, eps_bar, H_bar).

    The pinching P(rho) = V diag(rho^) V^dag (rho^ = V^dag rho V) depends on H through V: with
    dV = V K, K_kl = (V^dag dH V)_kl / (lam_l - lam_k) (k != l), dP = V([K, D] + diag([rho^, K])) V^dag,
    D = diag(rho^). For P^_bar = V^dag P_bar V, P_bar = eps rho_bar_out:
    Q = [D, P^_bar] + [diag(P^_bar), rho^], H^_bar_lk = Q_lk / (lam_l - lam_k) (l != k, 0 on the diagonal),
    H_bar = herm(V H^_bar V^dag). Not differentiable at degenerate H (the pinching jumps): raises
    ValueError naming the agent when a gap is below ``gap_tol`` (max(1, |lam|) relative).
    """
    xp = _xp(rho_in)
    P = pinch(rho_in, V)
    rho_bar_in = dephase_energy(rho_bar_out, eps, V)  # self-adjoint: pinching is an orthogonal projection
    eps_bar = _tr_real(rho_bar_out, P - rho_in)
    gap = lam[:, :, None] - lam[:, None, :]  # gap[l, k] = lam_l - lam_k
    d = lam.shape[-1]
    off = ~xp.eye(d, dtype=bool)
    scale = xp.maximum(xp.abs(lam).max(axis=1), 1.0)[:, None, None]
    bad = (xp.abs(gap) < gap_tol * scale) & off
    if bool(bad.any()):
        i = int(xp.argmax(bad.reshape(bad.shape[0], -1).any(axis=1)))
        raise ValueError(
            f"hamiltonian[agent={i}]: energy-basis dephasing is not differentiable at a degenerate spectrum "
            f"(eigenvalue gap below {gap_tol:g} relative)"
        )
    r = dagger(V) @ rho_in @ V
    Pb = dagger(V) @ (_col(eps) * rho_bar_out) @ V
    D, Pbd = diag_part(r), diag_part(Pb)
    Q = (D @ Pb - Pb @ D) + (Pbd @ r - r @ Pbd)
    Hh = xp.where(off, Q / xp.where(off, gap, 1.0), 0.0)
    return rho_bar_in, eps_bar, herm(V @ Hh @ dagger(V))


# ------------------------------------------------------------------------ replacement / thermalising


def mix(rho, sigma, eps):
    """M_eps(rho; sigma) = (1 - eps) rho + eps tr(rho) sigma (C1 coupling, thermalising channel)."""
    return (1.0 - _col(eps)) * rho + _col(eps * trace(rho)) * sigma


def mix_vjp(rho_bar_out, rho_in, sigma, eps):
    """Rule R4 -> (rho_bar_in, sigma_bar, eps_bar):
    rho_bar_in = (1 - eps) rho_bar_out + eps tr(rho_bar_out sigma) I, sigma_bar = eps tr(rho) rho_bar_out,
    eps_bar = tr(rho_bar_out (tr(rho) sigma - rho))."""
    trr = trace(rho_in).real
    rho_bar_in = (1.0 - _col(eps)) * rho_bar_out + _col(eps * _tr_real(rho_bar_out, sigma)) * _eye_like(
        rho_in
    )
    sigma_bar = _col(eps * trr) * rho_bar_out
    eps_bar = _tr_real(rho_bar_out, _col(trr) * sigma - rho_in)
    return rho_bar_in, sigma_bar, eps_bar


def pinch_mix(rho, W, eps):
    """C2: (1 - eps) rho + eps W Delta(W^dag rho W) W^dag, W (N, d, d) the neighbour's eigenbasis."""
    return rho + _col(eps) * (pinch(rho, W) - rho)


def pinch_mix_vjp(rho_bar_out, rho_in, W, eps):
    """Adjoint of C2 with W stop-gradient -> (rho_bar_in, eps_bar) (self-adjoint in rho)."""
    return pinch_mix(rho_bar_out, W, eps), _tr_real(rho_bar_out, pinch(rho_in, W) - rho_in)


# ------------------------------------------------------------------------------ coupling geometry


def causal_window(n_agents: int, width: int) -> SparseNeighbours:
    """Sequence neighbours j in [i - width, i) (nearest first: i-1, i-2, ...); agent 0 has none."""
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise ValueError(f"width: must be an integer >= 1, got {width!r}")
    return SparseNeighbours.from_lists(
        [[i - k for k in range(1, width + 1) if i - k >= 0] for i in range(n_agents)]
    )


def coupling_window(n_agents: int, neighbours) -> tuple[np.ndarray, np.ndarray]:
    """(index (N, w) int64, mask (N, w) bool) of the coupling channels' senders, in application order.

    neighbours: "dense" (every j != i, increasing j; w = N - 1) or a SparseNeighbours (its rows)."""
    nb = resolve_neighbours(neighbours)
    if isinstance(nb, str):
        j = np.arange(n_agents - 1)[None, :]
        i = np.arange(n_agents)[:, None]
        index = j + (j >= i)
        return index.astype(np.int64), np.ones(index.shape, bool)
    if nb.n_agents != n_agents:
        raise ValueError(f"neighbours: lists are for {nb.n_agents} agents, the state has {n_agents}")
    return np.asarray(nb.index), np.asarray(nb.mask)


def pair_distances(index, mask, positions=None, start: int | None = None, xp=np):
    """dist(i, j) (n, w) float64 for the window rows (index, mask) of receivers i = start .. start + n - 1
    (start None: the whole window, n = N): Euclidean distance of ``positions`` (N, p) or, when None, the
    sequence distance |i - j|. 0 under mask == False. Computed with array module ``xp`` (index and mask
    are moved there; on a GPU the host's time for N w entries is saved)."""
    n = index.shape[0]
    index, mask = xp.asarray(index), xp.asarray(mask)
    rows = xp.arange(n) if start is None else xp.arange(start, start + n)
    if positions is None:
        dist = xp.abs(index - rows[:, None]).astype(np.float64)
    else:
        pos = np.asarray(positions, dtype=np.float64)
        if pos.ndim != 2 or (pos.shape[0] != n if start is None else pos.shape[0] < start + n):
            raise ValueError(f"positions: must have shape (N={n}, p), got {pos.shape}")
        pos = xp.asarray(pos)
        dist = xp.linalg.norm(pos[rows][:, None, :] - pos[index], axis=-1)
    return xp.where(mask, dist, 0.0)


def coupling_strengths(eps0: float, ell: float, dist, mask):
    """eps_ij = eps0 exp(-dist_ij / ell) under mask, 0 elsewhere (N, w), where dist lives."""
    xp = _xp(dist)
    return xp.where(xp.asarray(mask), eps0 * xp.exp(-dist / ell), 0.0)


def coupling_strengths_vjp(eps_bar, eps0: float, ell: float, dist, mask) -> tuple[float, float]:
    """(eps0_bar, ell_bar) from eps_bar (N, w): d eps/d eps0 = exp(-dist/ell), d eps/d ell = eps dist/ell^2
    (masked slots contribute nothing). Computed where eps_bar lives (dist and mask go there), two floats
    back."""
    xp = _xp(eps_bar)
    dist = xp.asarray(dist if _xp(dist) is xp else np.asarray(host_array(dist), np.float64))
    mask = xp.asarray(mask if _xp(mask) is xp else np.asarray(host_array(mask), bool))
    eps_bar = xp.where(mask, eps_bar, 0.0)
    decay = eps_bar * xp.exp(-dist / ell)
    sums = xp.stack([decay.sum(dtype=np.float64), (decay * dist).sum(dtype=np.float64)])
    e0_bar, d_bar = (float(v) for v in host_array(sums))
    return e0_bar, d_bar * eps0 / ell**2


def transports(U, index):
    """U_ij = U_i U_j^dag for the window (N, w, d, d) from the frames U (N, d, d)."""
    return U[:, None] @ dagger(U[index])


def transports_vjp(M_bar, U, index):
    """(U_bar (N, d, d)) from M_bar (N, w, d, d) of M = U_i U_j^dag: U_i_bar += M_bar U_j,
    U_j_bar += M_bar^dag U_i (dL = Re tr(U_bar^dag dU))."""
    xp = _xp(U)
    Uj = U[xp.asarray(index)]
    U_bar = (M_bar @ Uj).sum(axis=1)
    return add_incoming(U_bar, dagger(M_bar) @ U[:, None], incoming_slots(index, None, U.shape[0], xp))


def incoming_slots(index, mask, n_agents: int, xp=np):
    """The transpose of a window (index, mask) (N, w) (mask None: every slot): per agent j the flat slots
    n w + k with index[n, k] == j (under mask), ordered by receiver n then slot k, padded with N w
    (a zero row :func:`add_incoming` appends) -> (n_agents, m) int64 array of ``xp`` (made there: on a
    GPU the sort takes a fraction of the host's time), m the largest in-degree (at least 1)."""
    index = xp.asarray(np.asarray(host_array(index), np.int64))
    flat = xp.arange(index.size, dtype=np.int64)
    if mask is not None:
        flat = flat[xp.asarray(np.asarray(host_array(mask), bool)).ravel()]
    senders = index.ravel()[flat]
    order = xp.argsort(senders, kind="stable")
    senders, flat = senders[order], flat[order]
    count = xp.bincount(senders, minlength=n_agents)
    start = xp.cumsum(count) - count
    rank = xp.arange(senders.size, dtype=np.int64) - start[senders]
    out = xp.full((n_agents, max(1, int(count.max()) if count.size else 0)), index.size, np.int64)
    out[senders, rank] = flat
    return out


def add_incoming(bar, parts, slots):
    """bar (N, d, d) plus, per agent j, the parts (N, w, d, d) of the slots that read j (``slots`` of
    :func:`incoming_slots`): a gather and sums in a fixed order (receiver, then slot), deterministic on
    NumPy and CuPy (no atomics). Columns of ``slots`` are summed in blocks of w, so the gathered block is
    no larger than ``parts``; the work is N d^2 times the largest in-degree."""
    xp = _xp(bar)
    d = bar.shape[1:]
    flat = xp.concatenate([parts.reshape(-1, *d), xp.zeros((1, *d), parts.dtype)])
    slots = xp.asarray(slots)
    block = max(1, parts.shape[1])
    for c in range(0, slots.shape[1], block):
        bar = bar + flat[slots[:, c : c + block]].sum(axis=1)
    return bar
