"""The reference docs cannot rot: every scenario key and integrator option the code accepts has a
description (docs/scenario-keys.md is generated from them by docs/conf.py), and the API page lists the
public API. CI also builds the docs with ``sphinx -W`` (.ci/run)."""

import ast
import re
from pathlib import Path

import pytest

import vfesim
from vfesim import scenario as sc
from vfesim.family import families
from vfesim.integrators import OPTION_DOCS, available, make_integrator, option_reference
from vfesim.scenario import Scenario, ScenarioError, key_reference

DOCS = Path(__file__).resolve().parents[1] / "docs"
PROBE = "zz_no_such_key"


def _accepted_keys(model_section: str) -> dict[str, set[str]]:
    """section -> the keys the validation accepts, as its unknown-key message lists them (the code's own
    answer, independent of the documentation)."""
    sections = (model_section, "population", "integrator", "run", "output")
    with pytest.raises(ScenarioError) as info:
        Scenario.from_dict({s: {PROBE: 1} for s in sections})
    known = {}
    for key, message in info.value.errors:
        if key.endswith(f".{PROBE}"):
            known[key.split(".")[0]] = set(ast.literal_eval(re.search(r"\(known: (\[.*\])\)", message)[1]))
    assert set(known) == set(sections), info.value.errors
    return known


MODEL_SECTIONS = ["model", *(f.runs.section for f in families() if f.runs is not None)]


@pytest.mark.parametrize("model_section", MODEL_SECTIONS)
def test_every_scenario_key_has_a_description(model_section):
    ref = key_reference()
    documented = {s: [row[0] for row in rows] for s, rows in {**ref["*"], **ref[model_section]}.items()}
    for section, keys in _accepted_keys(model_section).items():
        assert sorted(documented[section]) == sorted(keys), section
        for key, typ, _, doc in (*ref["*"].get(section, ()), *ref[model_section].get(section, ())):
            assert typ.strip() and len(doc) > 10, f"{section}.{key}: type {typ!r}, description {doc!r}"


def test_a_key_without_a_description_is_refused(monkeypatch):
    monkeypatch.setitem(sc.POPULATION, "new_key", 1.0)
    with pytest.raises(ValueError, match=r"\[population\] scenario keys without a description .*'new_key'"):
        key_reference()
    monkeypatch.delitem(sc.POPULATION, "new_key")
    monkeypatch.setitem(sc.KEY_DOCS["output"], "gone", ("int", "a key the section no longer takes"))
    with pytest.raises(ValueError, match=r"does not take: \['gone'\]"):
        key_reference()


@pytest.mark.parametrize("method", available())
def test_every_integrator_option_has_a_description(method):
    with pytest.raises(ValueError, match="known options") as info:
        make_integrator(method, vfesim.ModelConfig(K=3), 0.1, **{PROBE: 1})
    accepted = set(ast.literal_eval(re.search(r"known options: (\[.*\])", str(info.value))[1]))
    documented = {option for option, _, defaults, _ in option_reference() if method in defaults}
    assert documented == accepted
    assert {"momenta", "mass", "update_frames"} <= set(OPTION_DOCS)  # named by the issue
    assert all(len(doc) > 10 for _, doc in OPTION_DOCS.values())


def test_an_option_without_a_description_is_refused(monkeypatch):
    monkeypatch.delitem(OPTION_DOCS, "momenta")
    with pytest.raises(ValueError, match=r"options without a description \['momenta'\]"):
        option_reference()


def test_api_page_lists_the_public_api():
    text = (DOCS / "api.rst").read_text()
    modules = {"integrators", "quantum", "fields"}
    for name in vfesim.__all__:
        if name in modules:
            continue
        assert re.search(rf"^\.\. auto\w+:: vfesim\.{re.escape(name)}$", text, re.M), name
    for module in modules:
        assert f".. automodule:: vfesim.{module}\n   :members:" in text, module


def test_every_page_is_in_the_toctree():
    index = (DOCS / "index.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", index, re.S)[1].split()
    pages = {p.stem for p in DOCS.glob("*.md")} | {p.stem for p in DOCS.glob("*.rst")}
    assert pages - {"index"} <= set(toctree), sorted(pages - {"index"} - set(toctree))
    generated = (DOCS / "scenario-keys.md").read_text()
    assert "{vfesim-scenario-keys}" in generated and "{vfesim-integrator-options}" in generated
