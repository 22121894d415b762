"""Slow, obviously-correct per-pair loop oracle for the Gaussian free energy (SPEC §2.1, §2.2).

Float64 only, and independent of vfesim's maths: it builds its own tesseral so(3) generators from the
complex spin matrices, takes ``R_i = scipy.linalg.expm(phi_i . G)``, forms every transport
``Omega_ij = R_i R_j^T`` explicitly and evaluates every KL with ``inv``/``slogdet``. Only the config
object and the state Dataset are taken from vfesim.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import xarray as xr

__all__ = [
    "spin_matrices",
    "tesseral_unitary",
    "so3_generators",
    "frame",
    "kl_gauss",
    "aggregate",
    "neighbour_lists",
    "reference_attention",
    "reference_energy",
]


def spin_matrices(l: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Complex spin-l matrices (J_x, J_y, J_z), each (2l+1, 2l+1), rows/cols m = -l..l."""
    d = 2 * l + 1
    Jz = np.zeros((d, d), complex)
    Jp = np.zeros((d, d), complex)
    for row in range(d):
        m = row - l
        Jz[row, row] = m
    for col in range(d - 1):
        m = col - l  # J_+ |m> = sqrt(l(l+1) - m(m+1)) |m+1>
        Jp[col + 1, col] = math.sqrt(l * (l + 1) - m * (m + 1))
    Jm = Jp.conj().T
    Jx = (Jp + Jm) / 2
    Jy = (Jp - Jm) / (2j)
    return Jx, Jy, Jz


def tesseral_unitary(l: int) -> np.ndarray:
    """Unitary S (2l+1, 2l+1) from the m-basis to the order (m=0, cos 1, sin 1, cos 2, sin 2, ...)."""
    d = 2 * l + 1
    S = np.zeros((d, d), complex)

    def e(m: int) -> np.ndarray:
        v = np.zeros(d, complex)
        v[m + l] = 1.0
        return v

    S[0] = e(0)
    for m in range(1, l + 1):
        sign = (-1) ** m
        S[2 * m - 1] = (e(m) + sign * e(-m)) / math.sqrt(2)
        S[2 * m] = (-1j * e(m) + 1j * sign * e(-m)) / math.sqrt(2)
    return S


def so3_generators(irreps) -> np.ndarray:
    """Block-diagonal real generators (3, K, K), K = sum(2l+1), float64.

    G_a = skew(Re(S (-i J_a) S^dagger)). SPEC §2.1 writes ``S (i J_a) S^dagger``, but conjugation
    preserves commutators and [iJ_x, iJ_y] = -iJ_z, so only -iJ_a gives [G_x, G_y] = G_z.
    """
    blocks = []
    for l in irreps:
        S = tesseral_unitary(int(l))
        gens = []
        for J in spin_matrices(int(l)):
            M = S @ (-1j * J) @ S.conj().T
            assert np.max(np.abs(M.imag)) < 1e-12
            gens.append(0.5 * (M.real - M.real.T))
        blocks.append(gens)
    K = sum(2 * int(l) + 1 for l in irreps)
    G = np.zeros((3, K, K))
    o = 0
    for gens in blocks:
        d = gens[0].shape[0]
        for a in range(3):
            G[a, o : o + d, o : o + d] = gens[a]
        o += d
    return G


def frame(phi: np.ndarray, G: np.ndarray) -> np.ndarray:
    """R = expm(phi_x G_x + phi_y G_y + phi_z G_z): phi (3,), G (3, K, K) -> (K, K)."""
    X = phi[0] * G[0] + phi[1] * G[1] + phi[2] * G[2]
    return scipy.linalg.expm(X)


def kl_gauss(mu_a: np.ndarray, S_a: np.ndarray, mu_b: np.ndarray, S_b: np.ndarray) -> float:
    """KL(N(mu_a, S_a) || N(mu_b, S_b)) = 1/2[tr(S_b^-1 S_a) + d^T S_b^-1 d - K + ln|S_b| - ln|S_a|]."""
    K = mu_a.shape[0]
    Sb_inv = np.linalg.inv(S_b)
    d = mu_b - mu_a
    sign_a, logdet_a = np.linalg.slogdet(S_a)
    sign_b, logdet_b = np.linalg.slogdet(S_b)
    assert sign_a > 0 and sign_b > 0
    return 0.5 * (np.trace(Sb_inv @ S_a) + d @ Sb_inv @ d - K + logdet_b - logdet_a)


def _softmax_neg(kls: np.ndarray, kappa: float) -> np.ndarray:
    """beta_j = exp(-kl_j/kappa) / sum_k exp(-kl_k/kappa) (shifted by the min for stability)."""
    z = -(kls - kls.min()) / kappa
    w = np.exp(z)
    return w / w.sum()


def aggregate(kls: np.ndarray, kappa: float, aggregator: str) -> float:
    """A_kappa of one receiver's KLs (n_neighbours,); 0 when there are none."""
    if kls.size == 0:
        return 0.0
    if aggregator == "expected":
        beta = _softmax_neg(kls, kappa)
        return float(np.sum(beta * kls))
    if aggregator == "softmin":
        m = kls.min()
        return float(m - kappa * np.log(np.sum(np.exp(-(kls - m) / kappa))))
    raise ValueError(f"unknown aggregator {aggregator!r}")


def neighbour_lists(cfg, n_agents: int) -> list[list[int]]:
    """N(i) for every receiver: all j != i (dense) or the masked entries of cfg.neighbours."""
    if isinstance(cfg.neighbours, str):
        return [[j for j in range(n_agents) if j != i] for i in range(n_agents)]
    index = np.asarray(cfg.neighbours.index)
    mask = np.asarray(cfg.neighbours.mask)
    assert index.shape[0] == n_agents
    return [[int(index[i, k]) for k in range(index.shape[1]) if mask[i, k]] for i in range(n_agents)]


def _host64(state: xr.Dataset, name: str) -> np.ndarray:
    a = state[name].data
    if type(a).__module__.split(".")[0] == "cupy":
        a = a.get()
    return np.array(a, dtype=np.float64)


def _unpack(state: xr.Dataset, cfg) -> dict:
    """Float64 arrays, jitter added to both covariances, and frames R (N, K, K)."""
    out = {k: _host64(state, k) for k in ("mu_q", "sigma_q", "mu_p", "sigma_p", "phi")}
    K = cfg.K
    for k in ("sigma_q", "sigma_p"):
        out[k] = out[k] + cfg.jitter * np.eye(K)
    G = so3_generators(cfg.irreps)
    out["R"] = np.stack([frame(p, G) for p in out["phi"]])
    return out


def _pair_kls(mus, sigmas, R, nbrs) -> list[np.ndarray]:
    """KL(q_i || Omega_ij q_j) for j in N(i), with Omega_ij = R_i R_j^T, one array per receiver."""
    out = []
    for i, row in enumerate(nbrs):
        kls = []
        for j in row:
            Omega = R[i] @ R[j].T
            kls.append(kl_gauss(mus[i], sigmas[i], Omega @ mus[j], Omega @ sigmas[j] @ Omega.T))
        out.append(np.array(kls, dtype=np.float64))
    return out


def reference_attention(state: xr.Dataset, cfg, which: str = "belief") -> np.ndarray:
    """Attention (N, N): beta_ij (which="belief") or gamma_ij (which="prior"); 0 off N(i) and on i=j."""
    if which not in ("belief", "prior"):
        raise ValueError(f"which must be 'belief' or 'prior', got {which!r}")
    a = _unpack(state, cfg)
    n = a["mu_q"].shape[0]
    nbrs = neighbour_lists(cfg, n)
    if which == "belief":
        kls = _pair_kls(a["mu_q"], a["sigma_q"], a["R"], nbrs)
        kappa = cfg.kappa_beta
    else:
        kls = _pair_kls(a["mu_p"], a["sigma_p"], a["R"], nbrs)
        kappa = cfg.kappa_gamma
    att = np.zeros((n, n))
    for i, row in enumerate(nbrs):
        if row:
            att[i, row] = _softmax_neg(kls[i], kappa)
    return att


def reference_energy(state: xr.Dataset, cfg) -> dict:
    """Every term of F (SPEC §2.2), already multiplied by its lambda, and their sum "total".

    Keys: "self", "belief_align", "prior_align", "observation", "total" (Python floats).
    """
    a = _unpack(state, cfg)
    n = a["mu_q"].shape[0]
    nbrs = neighbour_lists(cfg, n)

    self_kl = sum(kl_gauss(a["mu_q"][i], a["sigma_q"][i], a["mu_p"][i], a["sigma_p"][i]) for i in range(n))
    belief_kls = _pair_kls(a["mu_q"], a["sigma_q"], a["R"], nbrs)
    belief = sum(aggregate(k, cfg.kappa_beta, cfg.aggregator) for k in belief_kls)
    prior_kls = _pair_kls(a["mu_p"], a["sigma_p"], a["R"], nbrs)
    prior = sum(aggregate(k, cfg.kappa_gamma, cfg.aggregator) for k in prior_kls)

    obs_term = 0.0
    if cfg.W is not None:
        W = np.array(cfg.W, dtype=np.float64)
        Rn = np.array(cfg.R, dtype=np.float64)
        o = _host64(state, "obs")
        D = W.shape[0]
        R_inv = np.linalg.inv(Rn)
        sign, logdet_R = np.linalg.slogdet(Rn)
        assert sign > 0
        for i in range(n):
            r = o[i] - W @ a["mu_q"][i]
            obs_term += 0.5 * (
                D * math.log(2 * math.pi)
                + logdet_R
                + np.trace(R_inv @ W @ a["sigma_q"][i] @ W.T)
                + r @ R_inv @ r
            )

    terms = {
        "self": cfg.lambda_self * float(self_kl),
        "belief_align": cfg.lambda_belief * float(belief),
        "prior_align": cfg.lambda_prior * float(prior),
        "observation": cfg.lambda_obs * float(obs_term),
    }
    terms["total"] = sum(terms.values())
    return terms
