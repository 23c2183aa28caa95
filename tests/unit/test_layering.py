"""The package's layering (pyproject.toml, ``[tool.importlinter]``) holds: front ends over tools over the engine."""

from __future__ import annotations

import ast
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


def _modules(under: str):
    for folder, _, files in os.walk(os.path.join(ROOT, under)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, ROOT), ast.parse(f.read(), filename=path)


def _is_protocol(node: ast.ClassDef) -> bool:
    return any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)


def test_no_part_below_the_checkpointer_receives_it():
    """The engine's parts are handed what they use: no function below the Checkpointer takes the Checkpointer."""
    above = {"lightning_dcp/engine/checkpointer.py", "lightning_dcp/engine/config.py"}
    found = []
    for path, tree in _modules("lightning_dcp/engine"):
        if path in above:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [f"{path}:{node.lineno} {node.name}({a.arg})" for a in args if a.arg in ("cp", "checkpointer")]
    assert found == []


def test_a_protocol_names_a_role_and_never_shadows_a_class():
    """A ``Protocol`` in the package declares methods only (a role), under a name no class of the package has."""
    classes, protocols = set(), []
    for path, tree in _modules("lightning_dcp"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                if _is_protocol(node):
                    protocols.append((path, node))
                else:
                    classes.add(node.name)
    assert protocols, "the package names its roles with Protocols"
    shadows = [f"{path}: {node.name}" for path, node in protocols if node.name in classes]
    attributes = [
        f"{path}: {node.name}.{item.target.id}"
        for path, node in protocols
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]
    assert shadows == [] and attributes == []


def test_a_resume_calls_down_and_calls_back_only_for_rank0s_decision(tmp_path):
    """From ``fit(ckpt_path=...)`` to the bytes, each call stack enters an engine room at most twice.

    A room below calling back up (a method of the caller handed down, as ``load`` once called the checkpointer's
    ``location``) shows as a second run of the upper room in one call stack. The one allowed: ``dist.on_rank0``,
    which runs its caller's decision on rank 0 and hands every rank the result (as DCP's ``_DistWrapper`` does).
    """
    from benchmarks.resume_walk import traced_resume

    result = traced_resume(str(tmp_path))
    assert result["resumed_step"] == 3
    assert {"engine/checkpointer.py", "engine/load", "engine/catalog", "engine/storage"} <= set(result["stack_runs"])
    assert max(result["stack_runs"].values()) <= 2, result["stack_runs"]
    for line in result["stack_back"]:
        rooms = line.split(" > ")
        for i, name in enumerate(rooms):
            if name in rooms[:i]:
                assert rooms[i - 1] == "engine/dist.py", line
