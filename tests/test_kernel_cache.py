"""The on-disk kernel cache: keyed by the kernel sources (an edit of an inlined helper module alone gives a
new cache folder), NUMBA_CACHE_DIR takes precedence, first uses of CUDA kernels are announced, and the
package's import stays light (the rest of a process's start)."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import vfesim_kernels
from conftest import needs_numba_cuda

SHOW = (
    "import vfesim_kernels, numba.core.config as c; print(vfesim_kernels.kernel_cache_dir()); "
    "print(c.CACHE_DIR)"
)


def _cache_dir(pythonpath: Path, env_extra: dict) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"} | env_extra
    env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_cache_folder_follows_the_kernel_sources(tmp_path):
    pkg = tmp_path / "src" / "vfesim_kernels"
    shutil.copytree(Path(vfesim_kernels.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first, numba_dir = _cache_dir(pkg.parent, env)
    assert first == numba_dir  # numba compiles into it
    assert Path(first).parent == tmp_path / "cache" / "vfesim" and Path(first).is_dir()
    assert _cache_dir(pkg.parent, env)[0] == first  # stable between processes
    with open(pkg / "pair_math.py", "a") as fh:
        fh.write("\n# an edit of an inlined helper module\n")
    second = _cache_dir(pkg.parent, env)[0]
    assert second != first and Path(second).parent == Path(first).parent


def test_user_cache_dir_takes_precedence(tmp_path):
    root = Path(vfesim_kernels.__file__).parent.parent
    mine = str(tmp_path / "mine")
    assert _cache_dir(root, {"NUMBA_CACHE_DIR": mine}) == [mine, mine]


def test_first_use_of_cuda_kernels_is_announced(caplog, monkeypatch):
    needs_numba_cuda()
    from vfesim_kernels import cuda as kc

    from vfesim.backends import cuda_backend as cb

    monkeypatch.setattr(cb, "SIMULATOR", False)
    fu = cb.FirstUse()
    with caplog.at_level(logging.INFO, logger="vfesim"):
        token = fu.begin(("gaussian", 3), "gaussian agents, K=3")
        assert fu.begin(("gaussian", 3), "gaussian agents, K=3") is None  # once per process
        fu.end(token, kc.make_agent_kernels(3, "float64"))
    text = caplog.text
    assert "preparing CUDA kernels: gaussian agents, K=3" in text
    assert "CUDA kernels ready in" in text and "0 compiled, 0 loaded from the cache" in text


def test_first_compile_of_cpu_kernels_is_announced_only_with_an_empty_cache(caplog, monkeypatch, tmp_path):
    import vfesim
    from vfesim.backends import numba_backend as nb

    empty, warm = tmp_path / "empty", tmp_path / "warm" / "kernels_abc"
    empty.mkdir()
    warm.mkdir(parents=True)
    (warm / "pairwise_cpu.pairwise_dense-10.py311.nbi").write_bytes(b"")
    monkeypatch.setattr(nb, "kernel_cache_dir", lambda: str(warm.parent))
    with caplog.at_level(logging.INFO, logger="vfesim"):
        assert nb.FirstCompile().begin() is None  # CPU kernels in the cache: nothing to say
    assert "compiling the CPU kernels" not in caplog.text

    monkeypatch.setattr(nb, "kernel_cache_dir", lambda: str(empty))
    monkeypatch.setattr(nb, "FIRST_COMPILE", nb.FirstCompile())
    cfg = vfesim.ModelConfig(K=3)
    state = vfesim.random_state(cfg, 4, seed=0)
    with caplog.at_level(logging.INFO, logger="vfesim"):
        vfesim.energy_and_gradient(state, cfg, backend="numba")
        vfesim.energy_and_gradient(state, cfg, backend="numba")
    text = caplog.text
    assert (
        f"compiling the CPU kernels for their first use (about 30 s on a fresh machine; cached in {empty}"
        in text
    )
    assert text.count("compiling the CPU kernels") == 1 and text.count("CPU kernels ready in") == 1


def test_import_loads_no_storage_or_scale_out_library():
    """`import vfesim` (energies, dynamics) does not load zarr, scipy or dask: runs and the dask backend
    import them on first use, so every process's start stays short (issue 9, cold start)."""
    code = "import sys, vfesim; print(sorted(m for m in ('zarr', 'scipy', 'dask') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
