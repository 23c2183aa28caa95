"""The package's layering (pyproject.toml, ``[tool.importlinter]``) holds: front ends over tools over the engine."""

from __future__ import annotations

import logging
import os

from importlinter.cli import lint_imports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_contracts_are_kept(capsys):
    loggers = dict(logging.root.manager.loggerDict)
    disabled = {name: logger.disabled for name, logger in loggers.items() if isinstance(logger, logging.Logger)}
    try:
        code = lint_imports(config_filename=os.path.join(ROOT, "pyproject.toml"), no_cache=True, no_logo=True)
    finally:  # the linter applies a logging configuration with disable_existing_loggers: later tests read our logs
        for name, was in disabled.items():
            logging.getLogger(name).disabled = was
    out = capsys.readouterr().out
    assert code == 0, out
    assert "BROKEN" not in out and out.count("KEPT") >= 2, out
