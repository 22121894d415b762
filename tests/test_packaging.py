"""Packaging promises of setup.cfg, tox.ini and .ci/run: the `test` extra pulls no NVIDIA wheels (the CUDA
simulator is the `cudasim` extra), CI and tox refuse to skip the simulator tests, and tox's numpy-oldest
env pins exactly the declared floors."""

import configparser
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cfg(name: str) -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / name)
    return cfg


def _lines(value: str) -> list[str]:
    return [x.strip() for x in value.splitlines() if x.strip() and not x.strip().startswith("#")]


def _name(req: str) -> str:
    return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower()


def test_test_extra_has_no_cuda_wheels_and_cudasim_has_them():
    extras = _cfg("setup.cfg")["options.extras_require"]
    assert not any(_name(r).startswith(("numba-cuda", "cupy", "nvidia")) for r in _lines(extras["test"]))
    for extra in ("cudasim", "gpu", "multigpu"):
        assert "numba-cuda" in {_name(r) for r in _lines(extras[extra])}, extra
    assert {"sphinx", "myst-parser"} <= {_name(r) for r in _lines(extras["docs"])}


def test_ci_and_tox_require_the_simulator_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export VFESIM_REQUIRE_CUDASIM=1" in ci
    assert '-e ".[test,cudasim,docs]"' in ci and "sphinx -E -W" in ci
    tox = _cfg("tox.ini")
    assert "VFESIM_REQUIRE_CUDASIM = 1" in tox["testenv"]["set_env"]
    assert {"test", "cudasim"} <= set(_lines(tox["testenv"]["extras"]))


def test_numpy_oldest_pins_every_declared_floor():
    tox = _cfg("tox.ini")
    assert "numpy-oldest" in tox["tox"]["env_list"]
    assert "-c {tox_root}/tests/constraints-oldest.txt" in tox["testenv:numpy-oldest"]["install_command"]
    floors = {}
    for req in _lines(_cfg("setup.cfg")["options"]["install_requires"]):
        floor = re.search(r">=\s*([\w.]+)", req)
        assert floor, f"install_requires {req!r} has no floor"
        floors[_name(req)] = floor[1]
    pins = dict(line.split("==") for line in _lines((ROOT / "tests" / "constraints-oldest.txt").read_text()))
    assert pins == floors
