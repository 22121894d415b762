"""Names and CF attributes of output variables: the one table behind ``docs/outputs.md``.

Naming: an energy term ``k`` of ``energy_and_gradient``'s dict (``"total"`` included) and of an
integrator (``"kinetic"``, ``"hamiltonian"``) is the variable ``energy_<k>`` (:func:`term_var`), in
``run_dynamics`` histories and in run stores alike; both are indexed by the dim ``time`` with the
coordinates ``time`` (step * dt) and ``step``. State variables keep their names (their attributes live in
their family's record, :attr:`vfesim.family.AgentFamily.attributes`); everything else is listed here.

Every variable and coordinate carries ``long_name`` and ``units`` (CF): energies ``nats``, time
``model time units``, angles ``rad``, dimensionless ``1``; so ``ds.x.plot()`` labels itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import xarray as xr

__all__ = [
    "ENERGY_PREFIX",
    "ENERGIES",
    "DIMS",
    "GRID",
    "OUTPUTS",
    "RESERVED",
    "term_var",
    "var_term",
    "attrs_of",
    "gradient_attrs",
    "dim_coords",
    "history",
]

ENERGY_PREFIX = "energy_"

# Energy terms (dict key -> long_name); the variable is energy_<key>, in nats.
ENERGIES = {
    "total": "free energy F (sum of its terms)",
    "self": "self term of F (belief vs own prior)",
    "belief_align": "belief-alignment term of F (attention-weighted)",
    "prior_align": "prior-alignment term of F (attention-weighted)",
    "observation": "observation term of F",
    "gauge_smoothness": "gauge-smoothness term of F (field agents, lambda_phi)",
    "kinetic": "kinetic energy 1/2 p^T M^-1 p",
    "hamiltonian": "Hamiltonian H = F + kinetic energy",
}
# Terms of density-matrix ``fit`` runs (vfesim.quantum.runs): stored as terms, not all of them in nats.
FIT_TERMS = {
    "born_loss": {
        "long_name": "Born cross-entropy of the observed outcomes over the rollout",
        "units": "nats",
    },
    "grad_norm": {"long_name": "|dL/dtheta|_inf of the fitted parameters", "units": "1"},
    "hamiltonian_error": {"long_name": "RMS over agents of |traceless(H - H_true)|_F", "units": "1"},
}

# Dims other than ``agent``, and the run coordinates: the attributes of their coordinates.
DIMS = {
    "time": {"long_name": "model time (step * dt)", "units": "model time units"},
    "step": {"long_name": "integrator step", "units": "1"},
    "latent": {"long_name": "latent axis (real tesseral basis of the SO(3) irreps)", "units": "1"},
    "latent_b": {"long_name": "latent axis, second index of a covariance", "units": "1"},
    "gauge": {"long_name": "so(3) generator axis (0, 1, 2: x, y, z)", "units": "1"},
    "obs_dim": {"long_name": "observation axis", "units": "1"},
    "bra": {"long_name": "density-matrix row (basis index)", "units": "1"},
    "ket": {"long_name": "density-matrix column (basis index)", "units": "1"},
    "agent_j": {"long_name": "sender agent j", "units": "1"},
    "neighbour": {"long_name": "neighbour slot of the receiver's list", "units": "1"},
}

# Grid coordinates of field agents (spacing * index; not integer dims: names observables may take).
GRID = {
    "x": {"long_name": "grid coordinate x (spacing * index; field agents)", "units": "1"},
    "y": {"long_name": "grid coordinate y (spacing * index; field agents)", "units": "1"},
}

# Every other output variable (long_name, units). Built-in observables: vfesim.observables.BUILTINS.
OUTPUTS = {
    "attention_entropy": {
        "long_name": "entropy of the belief attention of agent i, -sum_j beta_ij log beta_ij",
        "units": "nats",
    },
    "attention": {"long_name": "belief attention beta_ij (receiver agent, sender agent_j)", "units": "1"},
    "prior_attention": {
        "long_name": "prior attention gamma_ij (receiver agent, sender agent_j)",
        "units": "1",
    },
    "belief_spread": {"long_name": "spread of beliefs (RMS distance from their mean)", "units": "1"},
    "mean_frame_angle": {"long_name": "mean frame rotation angle (|phi| reduced to [0, pi])", "units": "rad"},
    "saved": {"long_name": "frame written (open_run keeps only these)", "units": "1"},
    "camp": {"long_name": "population label: prior camp of the agent", "units": "1"},
    "sender": {"long_name": "sender agent of the neighbour slot (-1: unused slot)", "units": "1"},
    # Density-matrix runs (vfesim.quantum.evolve).
    "agent_purity": {"long_name": "purity tr rho_i^2", "units": "1"},
    "agent_entropy": {"long_name": "von Neumann entropy S(rho_i)", "units": "nats"},
    "system_trace_residual": {"long_name": "max_i |tr rho_i - 1|", "units": "1"},
    "system_hermiticity_residual": {"long_name": "max |rho_i - rho_i^dagger|", "units": "1"},
    "system_min_eigenvalue": {"long_name": "min_i of the smallest eigenvalue of rho_i", "units": "1"},
    "system_mirror_eta": {"long_name": "last accepted mirror-descent step size", "units": "1"},
}


# Output names that observables may not take (the built-in observables' own names are theirs to take).
RESERVED = frozenset(OUTPUTS) - {"attention_entropy", "attention", "belief_spread", "mean_frame_angle"}


def term_var(term: str) -> str:
    """The variable of an energy term: ``energy_<term>`` (``"total"``: ``energy_total``, F)."""
    return ENERGY_PREFIX + term


def var_term(name: str) -> str | None:
    """The energy term of a variable name, or None when it is not an energy."""
    return name.removeprefix(ENERGY_PREFIX) if name.startswith(ENERGY_PREFIX) else None


def attrs_of(name: str) -> dict[str, str]:
    """``long_name`` and ``units`` of an output variable or coordinate listed here (KeyError if not)."""
    term = var_term(name)
    if term in FIT_TERMS:
        return dict(FIT_TERMS[term])
    if term is not None:
        return {"long_name": ENERGIES.get(term, f"energy term {term!r}"), "units": "nats"}
    if name in OUTPUTS:
        return dict(OUTPUTS[name])
    if name in GRID:
        return dict(GRID[name])
    return dict(DIMS[name])


def gradient_attrs(attrs: Mapping[str, Any]) -> dict[str, str]:
    """Attributes of dF/dx for a variable x with ``attrs``: nats per unit of x."""
    units = attrs.get("units", "1")
    return {
        "long_name": f"gradient of F with respect to the {attrs.get('long_name', 'variable')}",
        "units": "nats" if units == "1" else f"nats {units}-1",
    }


def dim_coords(sizes: Mapping[str, int], skip: Iterable[str] = ("agent",)) -> dict[str, tuple]:
    """Integer coordinates ``0..n-1`` with attributes for the dims in ``sizes`` (except ``skip``)."""
    return {
        d: (d, np.arange(n, dtype=np.int64), dict(DIMS[d]))
        for d, n in sizes.items()
        if d not in skip and d in DIMS
    }


def history(
    steps: list[int] | np.ndarray,
    dt: float,
    data: Mapping[str, tuple[tuple[str, ...], np.ndarray]],
    attrs: Mapping[str, Any],
    var_attrs: Mapping[str, Mapping[str, str]] | None = None,
) -> xr.Dataset:
    """An in-memory history: ``data`` (name -> (dims after ``time``, values)) over dim ``time`` with the
    coordinates ``time`` = step * dt and ``step``; each variable's attributes from ``var_attrs`` or this
    table."""
    steps = np.asarray(steps, np.int64)
    var_attrs = var_attrs or {}
    out = {k: (("time", *dims), v, dict(var_attrs.get(k) or attrs_of(k))) for k, (dims, v) in data.items()}
    sizes = {d: np.shape(v)[i + 1] for dims, v in data.values() for i, d in enumerate(dims)}
    coords = {
        "time": ("time", steps * float(dt), attrs_of("time")),
        "step": ("time", steps, attrs_of("step")),
        **dim_coords(sizes),
    }
    return xr.Dataset(out, coords=coords, attrs=dict(attrs))
