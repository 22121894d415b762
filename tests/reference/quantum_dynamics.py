"""Slow, obviously-correct oracles for the dynamics of density-matrix agents (spec/quantum.md §3, §4).

Naive on purpose and independent of vfesim: Python loops over steps, agents and neighbours, scipy
``expm`` for every exponential (frames, unitary steps, Gibbs states, Liouvillians), ``logm``-free
relative entropies by numpy ``eigh`` of the (full-rank) floored state, explicit Kraus sums and explicit
projector sums for every pinching. complex128 only; keep N, d, T small.

Model (the same as vfesim.quantum.evolve; see its docstring): per step and agent i, with senders j in
window order: x <- (1 - e_ij) x + e_ij tr(x) U_ij rho_j U_ij^dag (C1) or
x <- (1 - e_ij) x + e_ij sum_k P_k x P_k, P_k the eigenprojectors of U_ij rho_j U_ij^dag (C2);
g = sigmoid((D(x_f || sigma_i) - theta)/tau) (soft gate) or 1; y = expm(-i H_i g dt) x expm(..)^dag;
z = (1 - e) y + e sum_k P_k y P_k with P_k = |k><k| or the eigenprojectors of H_i, e = 1 - exp(-gamma dt);
rho_i' = (1 - e_th) z + e_th tr(z) sigma_i; then ``mirror["steps"]`` Armijo mirror-descent steps of the
whole population (:func:`mirror_step`). Loss: Born cross-entropy on the floored states after each step
plus w_F F(rho^T) (tests/reference/quantum.py energy_terms).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg

from .quantum import EPS, energy_terms, frame, frame_generators

__all__ = [
    "choi",
    "dephase",
    "gibbs_state",
    "relative_entropy",
    "rollout_loss",
    "mirror_gradient",
    "mirror_step",
    "liouvillian",
    "lindblad_exact",
]


def choi(channel, d: int) -> np.ndarray:
    """Choi matrix sum_kl |k><l| (x) Phi(|k><l|) (d^2, d^2) of a Hermiticity-preserving linear map Phi.

    Phi is only ever evaluated on Hermitian matrices (the domain of the implementations, which may
    symmetrise their output): Phi(|k><l|) = Phi(X) + i Phi(Y) with the Hermitian X = (E + E^dag)/2,
    Y = (E - E^dag)/(2i), E = |k><l|."""
    C = np.zeros((d * d, d * d), complex)
    for k in range(d):
        for l in range(d):
            E = np.zeros((d, d), complex)
            E[k, l] = 1.0
            X, Y = (E + E.conj().T) / 2, (E - E.conj().T) / 2j
            C += np.kron(E, channel(X) + 1j * channel(Y))
    return C


def dephase(rho: np.ndarray, eps: float, basis: np.ndarray | None = None) -> np.ndarray:
    """(1 - eps) rho + eps sum_k P_k rho P_k, P_k = |b_k><b_k| for the columns b_k of ``basis``
    (default I)."""
    d = rho.shape[0]
    B = np.eye(d) if basis is None else basis
    out = (1 - eps) * rho
    for k in range(d):
        P = np.outer(B[:, k], B[:, k].conj())
        out = out + eps * P @ rho @ P
    return out


def gibbs_state(H: np.ndarray, T: float) -> np.ndarray:
    """expm(-H/T) / tr expm(-H/T)."""
    G = scipy.linalg.expm(-H / T)
    return G / np.trace(G).real


def _logh(X):
    s, W = np.linalg.eigh(0.5 * (X + X.conj().T))
    return (W * np.log(s)) @ W.conj().T


def relative_entropy(rho: np.ndarray, sigma: np.ndarray, eps: float = EPS) -> float:
    """D(x || sigma) of the floored x = (1 - eps) rho + eps I/d (sigma full rank)."""
    d = rho.shape[0]
    x = (1 - eps) * rho + eps * np.eye(d) / d
    return float(np.trace(x @ (_logh(x) - _logh(sigma))).real)


def _window(n, neighbours):
    if neighbours is None or isinstance(neighbours, str):
        return [[j for j in range(n) if j != i] for i in range(n)]
    idx, mask = np.asarray(neighbours.index), np.asarray(neighbours.mask)
    return [[int(idx[i, k]) for k in range(idx.shape[1]) if mask[i, k]] for i in range(n)]


def mirror_gradient(rho, H, T, qcfg, outcome=None, eps: float = EPS) -> np.ndarray:
    """dF/drho (N, d, d), traceless, of the self and observation terms in closed form:
    (1 - eps) P0[lambda_self (log x - log sigma) - lambda_obs |y><y| / x_yy], x the floored state, log sigma
    = -H/T - log Z (prior alignment does not depend on rho; belief alignment is not covered here)."""
    if qcfg["lambda_belief"]:
        raise ValueError("mirror_gradient: the closed form covers the self and observation terms only")
    n, d = len(rho), rho[0].shape[0]
    out = []
    for i in range(n):
        x = (1 - eps) * rho[i] + eps * np.eye(d) / d
        G = np.zeros((d, d), complex)
        if qcfg["lambda_self"]:
            Gs = scipy.linalg.expm(-H[i] / T[i])
            logsig = -H[i] / T[i] - np.log(np.trace(Gs).real) * np.eye(d)
            G += qcfg["lambda_self"] * (_logh(x) - logsig)
        if qcfg["lambda_obs"]:
            y = outcome[i]
            G[y, y] -= qcfg["lambda_obs"] / x[y, y].real
        G = (1 - eps) * G
        out.append(G - np.trace(G) / d * np.eye(d))
    return np.array(out)


def mirror_step(rho, H, T, phi, qcfg, outcome, *, eta0, armijo_c, max_backtracks, grad_F=None):
    """One Armijo mirror-descent step of all agents: log rho_i <- log x_i - eta G_i, normalised, eta halved
    from eta0 until F(new) <= F(rho) + c sum_i tr(G_i (new_i - rho_i)); unchanged if none passes.
    G = grad_F(rho, H, T, phi) (default :func:`mirror_gradient`). Returns (new states, eta)."""
    rho = np.array(rho)
    n, d = rho.shape[:2]
    G = mirror_gradient(rho, H, T, qcfg, outcome) if grad_F is None else grad_F(rho, H, T, phi)
    F = lambda r: energy_terms(r, H, T, phi, outcome, qcfg, log="eigh")["total"]
    F0 = F(rho)
    logx = [_logh((1 - EPS) * r + EPS * np.eye(d) / d) for r in rho]
    eta = eta0
    for _ in range(max_backtracks + 1):
        new = np.array([scipy.linalg.expm(logx[i] - eta * G[i]) for i in range(n)])
        new /= np.trace(new, axis1=1, axis2=2).real[:, None, None]
        dec = sum(np.trace(G[i] @ (new[i] - rho[i])).real for i in range(n))
        if F(new) <= F0 + armijo_c * dec:
            return new, eta
        eta *= 0.5
    return rho, 0.0


def rollout_loss(
    rho0,
    H,
    T,
    phi,
    *,
    dts,
    coupling="C1",
    eps0=0.0,
    ell=1.0,
    neighbours=None,
    positions=None,
    order="jacobi",
    gamma=None,
    gamma_th=None,
    basis="computational",
    gate="none",
    theta=0.0,
    tau=1.0,
    outcomes=None,
    w_born=0.0,
    w_F=0.0,
    qcfg=None,
    outcome_F=None,
    c2_bases=None,
    record=None,
    mirror=None,
):
    """Loss of a rollout (module docstring) -> (loss, final states (N, d, d)).

    gamma, gamma_th: per-agent rates (N,) (None: 0). c2_bases: a dict {(t, i, k): W} of frozen C2 bases
    (the stop-gradient surrogate); record: a dict that receives the bases of this run. mirror: None or
    dict(steps, eta0, armijo_c, max_backtracks, grad_F=None, outcome=None) (:func:`mirror_step` after
    every step; ``outcome`` the state's Born outcomes of F's observation term; a record dict gets the
    accepted eta under key ("eta", t, k)).
    """
    rho = [np.array(r, complex) for r in rho0]
    n, d = len(rho), rho[0].shape[0]
    gamma = np.zeros(n) if gamma is None else np.asarray(gamma, float)
    gamma_th = np.zeros(n) if gamma_th is None else np.asarray(gamma_th, float)
    J = frame_generators(d)
    U = [frame(phi[i], J) for i in range(n)]
    sig = [gibbs_state(H[i], T[i]) for i in range(n)]
    win = _window(n, neighbours)
    loss = 0.0
    for t, dt in enumerate(dts):
        old = [r.copy() for r in rho]
        new = [r.copy() for r in rho]
        for i in range(n):
            src = new if order == "gauss_seidel" else old
            x = old[i].copy()
            for k, j in enumerate(win[i]):
                dist = abs(i - j) if positions is None else float(np.linalg.norm(positions[i] - positions[j]))
                e = eps0 * np.exp(-dist / ell)
                Uij = U[i] @ U[j].conj().T
                s = Uij @ src[j] @ Uij.conj().T
                if coupling == "C1":
                    x = (1 - e) * x + e * np.trace(x) * s
                else:
                    W = c2_bases[(t, i, k)] if c2_bases is not None else np.linalg.eigh(s)[1]
                    if record is not None:
                        record[(t, i, k)] = W
                    x = dephase(x, e, W)
            g = 1.0
            if gate == "soft":
                g = 1.0 / (1.0 + np.exp(-(relative_entropy(x, sig[i]) - theta) / tau))
            Ut = scipy.linalg.expm(-1j * H[i] * g * dt)
            y = Ut @ x @ Ut.conj().T
            e = 1 - np.exp(-gamma[i] * dt)
            z = dephase(y, e, None if basis == "computational" else np.linalg.eigh(H[i])[1])
            e = 1 - np.exp(-gamma_th[i] * dt)
            new[i] = (1 - e) * z + e * np.trace(z) * sig[i]
        rho = new
        for k in range((mirror or {}).get("steps", 0)):
            kw = {key: mirror[key] for key in ("eta0", "armijo_c", "max_backtracks")}
            rho, eta = mirror_step(
                rho, H, T, phi, qcfg, mirror.get("outcome"), grad_F=mirror.get("grad_F"), **kw
            )
            rho = list(rho)
            if record is not None:
                record[("eta", t, k)] = eta
        if w_born:
            for i in range(n):
                yy = outcomes[t][i]
                if yy >= 0:
                    p = (1 - EPS) * rho[i][yy, yy].real + EPS / d
                    loss -= w_born * np.log(p)
    if w_F:
        loss += w_F * energy_terms(np.array(rho), H, T, phi, outcome_F, qcfg, log="eigh")["total"]
    return loss, np.array(rho)


def liouvillian(H: np.ndarray, jumps) -> np.ndarray:
    """Column-stacking Liouvillian (d^2, d^2): vec(A X B) = (B^T (x) A) vec(X), vec stacks columns."""
    d = H.shape[0]
    eye = np.eye(d)
    Lv = -1j * (np.kron(eye, H) - np.kron(H.T, eye))
    for L in jumps:
        LdL = L.conj().T @ L
        Lv += np.kron(L.conj(), L) - 0.5 * np.kron(eye, LdL) - 0.5 * np.kron(LdL.T, eye)
    return Lv


def lindblad_exact(rho0: np.ndarray, H: np.ndarray, jumps, t: float) -> np.ndarray:
    """rho(t) = expm(L t) rho0 for one qudit (column stacking)."""
    d = H.shape[0]
    v = scipy.linalg.expm(liouvillian(H, jumps) * t) @ rho0.reshape(-1, order="F")
    return v.reshape(d, d, order="F")
