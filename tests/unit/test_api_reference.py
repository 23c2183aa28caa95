"""The API reference (mkdocs.yml, docs/api/*.md) covers the public API; ``nox -s docs`` builds it with ``--strict``."""

from __future__ import annotations

import glob
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
