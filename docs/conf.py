"""Sphinx configuration of the vfesim documentation (``pip install -e ".[docs]"``, then
``python -m sphinx -E -W -b html docs docs/_build/html``; CI builds it with ``-W``: a warning fails).

The API reference (``api.rst``) is autodoc of the public API. The scenario-key and integrator-option
reference (``scenario-keys.md``) is generated here from the code: :func:`vfesim.scenario.key_reference`
and :func:`vfesim.integrators.option_reference` list every key and option the validation accepts, with
the descriptions written next to their defaults; an undocumented key raises there and fails the build.
"""

from __future__ import annotations

import json
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

import vfesim

project = "vfesim"
author = "the vfesim authors"
copyright = "the vfesim authors, BSD-3-Clause"
release = version = vfesim.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
html_theme = "alabaster"
smartquotes = False  # keys, values and options are shown as typed
myst_heading_anchors = 3

autodoc_member_order = "bysource"
# Optional GPU and cluster packages: the API imports without them (they load on first use), but mock them
# so that autodoc never needs them installed.
autodoc_mock_imports = ["cupy", "cupyx", "dask_cuda"]
# Docstrings use plain-text math and `code`; the default role renders single backticks as code.
default_role = "code"


# --- generated reference tables --------------------------------------------------------------------
FAMILY_TITLES = {
    "*": "Every agent family",
    "model": "Gaussian point agents",
    "quantum": "Density-matrix agents",
    "field": "Field agents",
}
FAMILY_INTROS = {
    "*": "[run] and [output] are the same for every agent family (family differences below).",
    "model": "A scenario with a [model] section (the default family).",
}


def _default(v: Any) -> str:
    """A default as written in TOML ('' where there is none: required or derived)."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_default(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_default(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _table(header: list[str], rows: list[list[str]], code_columns: tuple[int, ...]) -> nodes.table:
    """A docutils table of plain-text cells (no markup is parsed: descriptions are shown as written)."""
    widths = [1 if i in code_columns else 3 for i in range(len(header))]
    widths[-1] = 6
    table = nodes.table(classes=["longtable"])
    group = nodes.tgroup(cols=len(header))
    table += group
    group += [nodes.colspec(colwidth=w) for w in widths]

    def row(cells: list[str], head: bool = False) -> nodes.row:
        r = nodes.row()
        for i, text in enumerate(cells):
            para = nodes.paragraph()
            para += (
                nodes.literal(text, text) if (i in code_columns and text and not head) else nodes.Text(text)
            )
            r += nodes.entry("", para)
        return r

    thead = nodes.thead()
    thead += row(header, head=True)
    tbody = nodes.tbody()
    tbody += [row(r) for r in rows]
    group += [thead, tbody]
    return table


def _section(title: str, ident: str, *children: nodes.Node) -> nodes.section:
    sec = nodes.section(ids=[nodes.make_id(ident)])
    sec += nodes.title(title, title)
    sec += list(children)
    return sec


class ScenarioKeys(SphinxDirective):
    """Every scenario section and key of every agent family: type, default and description."""

    def run(self) -> list[nodes.Node]:
        from vfesim.family import families
        from vfesim.scenario import key_reference

        specs = {f.runs.section: f.runs for f in families() if f.runs is not None}
        out = []
        for fam, sections in key_reference().items():
            ident = "all" if fam == "*" else fam
            intro = FAMILY_INTROS.get(fam)
            if fam in specs:
                spec = specs[fam]
                intro = (
                    f"A scenario with a [{fam}] section. run.dtype: {', '.join(spec.dtypes)} (the first is "
                    f"the default); run.backend: {', '.join(spec.backends)}."
                )
            children: list[nodes.Node] = [nodes.paragraph(text=intro)] if intro else []
            for section, rows in sections.items():
                cells = [[k, typ, _default(d), doc] for k, typ, d, doc in rows]
                table = _table(["key", "type", "default", "description"], cells, (0, 2))
                children.append(_section(f"[{section}]", f"keys-{ident}-{section}", table))
            out.append(_section(FAMILY_TITLES.get(fam, f"[{fam}] agents"), f"keys-{ident}", *children))
        return out


class IntegratorOptions(SphinxDirective):
    """Every integrator option (``integrator.options`` in a scenario; ``make_integrator(**options)``)."""

    def run(self) -> list[nodes.Node]:
        from vfesim.integrators import available, option_reference

        methods = available()
        hamiltonian = [m for m in methods if m != "gradient_flow"]

        def who(ms: list[str]) -> str:
            if ms == methods:
                return "all"
            return "Hamiltonian" if ms == hamiltonian else ", ".join(ms)

        rows = []
        for option, typ, defaults, doc in option_reference():
            groups: dict[str, list[str]] = {}
            for m in methods:
                if m in defaults:
                    groups.setdefault(_default(defaults[m]), []).append(m)
            if len(groups) == 1:
                ((value, ms),) = groups.items()
                default = value
            else:
                default = "; ".join(f"{who(ms)}: {value or '-'}" for value, ms in groups.items())
            rows.append([option, who([m for m in methods if m in defaults]), typ, default, doc])
        return [_table(["option", "methods", "type", "default", "description"], rows, (0, 3))]


def setup(app):
    app.add_directive("vfesim-scenario-keys", ScenarioKeys)
    app.add_directive("vfesim-integrator-options", IntegratorOptions)
    return {"parallel_read_safe": True}
