"""The API reference (mkdocs.yml, docs/api/*.md) covers the public API; ``nox -s docs`` builds it with ``--strict``."""

from __future__ import annotations

import glob
import importlib
import inspect
import os
import re

import lightning_dcp
import lightning_dcp.fabric

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _documented() -> set[str]:
    names = set()
    for page in glob.glob(os.path.join(ROOT, "docs", "api", "*.md")):
        with open(page) as f:
            names.update(re.findall(r"^::: (lightning_dcp[\w.]*)$", f.read(), re.MULTILINE))
    return names


def test_every_public_name_has_a_reference_entry():
    documented = _documented()
    # The module `lightning_dcp.consolidate` (the command line) shadows the function of that name for mkdocstrings:
    # the function is documented by the path under which that module re-exports it.
    documented = {
        "lightning_dcp.consolidate" if n == "lightning_dcp.consolidate.consolidate" else n for n in documented
    }
    missing = [f"lightning_dcp.{n}" for n in lightning_dcp.__all__ if f"lightning_dcp.{n}" not in documented]
    missing += [
        f"lightning_dcp.fabric.{n}"
        for n in lightning_dcp.fabric.__all__
        if f"lightning_dcp.fabric.{n}" not in documented
    ]
    assert not missing, f"add these to docs/api/*.md: {missing}"


def test_every_page_is_in_the_nav_and_the_build_is_strict():
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        config = f.read()
    assert re.search(r"^strict: true$", config, re.MULTILINE)
    pages = [
        os.path.relpath(p, os.path.join(ROOT, "docs")) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"))
    ]
    assert pages and not [p for p in pages if p not in config], "pages missing from mkdocs.yml's nav"
    with open(os.path.join(ROOT, "noxfile.py")) as f:
        assert '"mkdocs", "build", "--strict"' in f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "nox -s docs" in f.read()


_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`[^`]*`")
_CROSS_REF = re.compile(r"\[`[^`\]]+`\]\[([\w.]+)\]")


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise AssertionError(name)


def _rendered_sources() -> dict[str, list[str]]:
    """The source lines each API page renders: a module's docstring, a class's or a function's whole source."""
    sources = {}
    for name in sorted(_documented()):
        obj = _resolve(name)
        sources[name] = (obj.__doc__ or "").splitlines() if inspect.ismodule(obj) else inspect.getsourcelines(obj)[0]
    return sources


def _identifiers() -> set[str]:
    """What a cross-reference may name: each documented object and the public members of documented classes."""
    names = set()
    for name in _documented():
        names.add(name)
        obj = _resolve(name)
        if inspect.isclass(obj):
            names.update(f"{name}.{member}" for member in vars(obj) if not member.startswith("_"))
    return names


def test_the_api_pages_show_no_sphinx_roles_and_link_only_to_documented_names():
    """Issue 51: 55 raw ``:func:``/``:class:``/``:mod:`` roles showed on the built pages (mkdocstrings renders
    Markdown), some naming private modules that have no page. The sources the pages render hold cross-references
    (``[`name`][lightning_dcp.name]``) to documented names, or plain names."""
    roles, links, known = [], [], _identifiers()
    for name, lines in _rendered_sources().items():
        roles += [f"{name}: {m.group(0)}" for line in lines for m in _ROLE.finditer(line)]
        links += [f"{name}: {target}" for line in lines for target in _CROSS_REF.findall(line) if target not in known]
    assert not roles, f"Sphinx roles render as raw text on the API pages; write a cross-reference or a name: {roles}"
    assert not links, f"cross-references to names no API page documents: {links}"
