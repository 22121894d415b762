"""vfesim_kernels: numeric kernels (numbers and arrays only: no configs, no xarray, no I/O).

Installed from the repository's ``kernels/`` folder under the import name ``vfesim_kernels``.

Compiled kernels (CPU ``njit`` and ``numba.cuda``, all ``cache=True``) are cached on disk in a folder
keyed by a hash of this package's sources, ``$XDG_CACHE_HOME/vfesim/kernels-<hash>`` (``~/.cache`` when
unset): numba keys its cache by each kernel's own source file, so an edit of an inlined helper module
(``pair_math``, ``agent_math``, ``update_math``) alone would otherwise load stale machine code. A
``NUMBA_CACHE_DIR`` set by the user takes precedence (and then the user owns that invalidation).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

__all__ = ["kernel_cache_dir"]


def _sources_hash() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _set_cache_dir() -> str | None:
    """Point numba's on-disk cache at the source-keyed folder, unless NUMBA_CACHE_DIR is set."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "vfesim" / f"kernels-{_sources_hash()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # not writable: numba's own default places (next to the sources, or none)
    # The environment variable survives numba's config reloads and reaches numba.cuda's own config
    # (read at its import) and child processes; modules already imported get the value directly.
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    for name in ("numba.core.config", "numba.cuda.core.config"):
        if name in sys.modules:
            sys.modules[name].CACHE_DIR = str(path)
    return str(path)


_CACHE_DIR = _set_cache_dir()


def kernel_cache_dir() -> str | None:
    """Where compiled kernels are cached (None: numba's defaults)."""
    return _CACHE_DIR
