"""The array module of an array (NumPy or CuPy): the one place vfesim asks."""

from __future__ import annotations

import numpy as np

__all__ = ["array_module", "is_host"]


def array_module(a):
    """``numpy`` for NumPy arrays (and scalars), ``cupy`` for CuPy arrays (imported only then)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def is_host(a) -> bool:
    """True for NumPy arrays."""
    return isinstance(a, np.ndarray)
