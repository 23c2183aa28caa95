"""The package's layering (pyproject.toml, ``[tool.importlinter]``) holds: front ends over tools over the engine."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys

import pytest
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


WRITER_ROLE = {
    "set_up_storage_writer",
    "storage_meta",
    "reset",
    "validate_checkpoint_id",
    "prepare_local_plan",
    "prepare_global_plan",
    "write_data",
    "finish",
    "finish_compact",
}
"""DCP's ``StorageWriter`` methods (and our writers' ``finish_compact``): the save pipeline calls the writer a tier
hands it, as ``dcp.save`` calls a storage writer. That call, and what the writer calls below it, is the writer's."""


@pytest.mark.parametrize(
    "flags",
    [[], ["--memory"], ["--saves"], ["--saves", "--memory"]],
    ids=["resume-path", "resume-memory-tier-last", "saves", "saves-memory-tier"],
)
def test_calls_go_down_and_come_back_only_for_rank0s_decision(flags):
    """A resume from ``fit(ckpt_path=...)`` to the bytes, and a fit that saves every step, each call stack entering
    an engine room at most twice.

    A room below calling back up (a method of the caller handed down, as ``load`` once called the checkpointer's
    ``location``, the memory tier its ``load_candidates`` and the save transaction's ``next_counter``) shows as a
    second run of the upper room in one call stack, on any thread. Allowed: a room's own decision run through
    ``dist.on_rank0`` (rank 0 decides, every rank gets the result, as DCP's ``_DistWrapper`` does), so the repeat
    sits right below ``dist`` and the room that called it; and a tier's storage writer called by the save pipeline
    (:data:`WRITER_ROLE`), whose own calls are checked from there on. Traced (in its own process: a Trainer's
    process group stays there): a path and ``"last"`` across a memory tier; saves with and without a memory tier.
    """
    command = [sys.executable, "-m", "benchmarks.resume_walk", *flags]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["resumed_step"] == (2 if flags == ["--memory"] else 3)
    rooms_seen = {"engine/checkpointer.py", "engine/catalog", "engine/storage"}
    assert rooms_seen | ({"engine/tiers"} if "--memory" in flags else set()) <= set(result["stack_runs"])
    for line in result["stack_back"]:
        stack = [tuple(part[:-1].split("(", 1)) for part in line.split(" > ")]
        segments, start = [], 0
        for i, (_, function) in enumerate(stack):
            if i and function in WRITER_ROLE:
                segments.append(stack[start:i])
                start = i
        segments.append(stack[start:])
        for segment in segments:
            rooms = [name for name, _ in segment]
            for i, name in enumerate(rooms):
                if name in rooms[:i]:
                    assert i >= 2 and rooms[i - 1] == "engine/dist.py" and rooms[i - 2] == name, line
