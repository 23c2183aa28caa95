"""The package's layering (pyproject.toml, ``[tool.importlinter]``) holds: front ends over tools over the engine."""

from __future__ import annotations

import os

from importlinter.cli import lint_imports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_contracts_are_kept(capsys):
    code = lint_imports(config_filename=os.path.join(ROOT, "pyproject.toml"), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "BROKEN" not in out and out.count("KEPT") >= 2, out
