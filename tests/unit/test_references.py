"""Every ``:mod:`` / ``:func:`` / ``:class:`` / ``:meth:`` / ``:exc:`` reference in lightning_dcp's docstrings and in
the docs names a real object: a module moved or a function renamed cannot leave a reference pointing nowhere.

A reference resolves as Sphinx's Python domain does: a dotted name is tried absolutely, then from the enclosing class
and module of the docstring (``:meth:`save``` inside ``Checkpointer``, ``:class:`Location``` imported by the module).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from collections.abc import Iterator

import pytest

import lightning_dcp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.dirname(os.path.abspath(lightning_dcp.__file__))
ROLE = re.compile(r":(mod|func|class|meth|exc):`(?:[^`<]*<)?~?([\w.]+)>?`")


def _import_attr(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute (chain) of the longest importable module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def resolves(target: str, module: str | None, scope: list[str]) -> bool:
    """Whether ``target`` names an object: absolutely, or from ``module`` and the classes in ``scope``."""
    if target.startswith("."):
        return False  # relative references are not used here: write the full dotted name
    if _import_attr(target):
        return True
    if module is None:
        return False
    for depth in range(len(scope), -1, -1):
        if _import_attr(".".join([module, *scope[:depth], target])):
            return True
    return False


def _docstrings(tree: ast.AST) -> Iterator[tuple[str, list[str]]]:
    """``(docstring, enclosing classes)`` of the module, its classes, functions and attribute docstrings."""

    def walk(node: ast.AST, scope: list[str]) -> Iterator[tuple[str, list[str]]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                if isinstance(child.value.value, str):
                    yield child.value.value, scope
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, [*scope, child.name])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, scope)

    yield from walk(tree, [])


def references(text: str) -> list[tuple[str, str]]:
    """The ``(role, target)`` pairs of ``text``."""
    return [(m.group(1), m.group(2)) for m in ROLE.finditer(text)]


def _package_references() -> list[tuple[str, str, str, list[str]]]:
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            with open(path) as f:
                tree = ast.parse(f.read())
            for doc, scope in _docstrings(tree):
                found.extend((module, role, target, scope) for role, target in references(doc))
    return found


def _doc_references() -> list[tuple[str, str, str]]:
    found = []
    paths = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        paths += [os.path.join(folder, n) for n in sorted(files) if n.endswith(".md")]
    for path in paths:
        with open(path) as f:
            found.extend((os.path.relpath(path, ROOT), role, target) for role, target in references(f.read()))
    return found


def test_every_docstring_reference_names_a_real_object():
    refs = _package_references()
    assert len(refs) > 300  # the scan sees the package's docstrings
    broken = sorted({f"{m}: :{r}:`{t}`" for m, r, t, scope in refs if not resolves(t, m, scope)})
    assert not broken, "references to nothing:\n" + "\n".join(broken)


def test_every_docs_reference_names_a_real_object():
    broken = sorted({f"{p}: :{r}:`{t}`" for p, r, t in _doc_references() if not resolves(t, None, [])})
    assert not broken, "references to nothing:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        (":mod:`lightning_dcp.engine.save.saving`", True),
        (":func:`~lightning_dcp.engine.catalog.lookup.designated`", True),
        (":meth:`Checkpointer.save <lightning_dcp.engine.checkpointer.Checkpointer.save>`", True),
        (":mod:`lightning_dcp.engine.saving`", False),  # the module before it moved into save/
        (":func:`lightning_dcp.engine.load.loading.no_such_function`", False),
        (":class:`~.local.Tiers`", False),
    ],
)
def test_a_broken_reference_is_found(text, ok):
    [(_, target)] = references(text)
    assert resolves(target, "lightning_dcp.engine.checkpointer", []) is ok
