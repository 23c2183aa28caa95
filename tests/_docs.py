"""Every code block of README.md and docs/*.md, run (tests/integration/test_docs.py).

A block is a fenced block with a language: ``python`` blocks run in order, each document in one namespace (a
document reads as one script); ``bash`` / ``sh`` / ``console`` blocks run line by line; ``text`` blocks (diagrams,
output) are not code. A block without a language is an error: say what it is.

What a block may use without defining it (the harness provides it, as a user's script would): ``model`` (a small
``LightningModule`` that logs ``train_loss``) and ``dm`` (its ``LightningDataModule``), which the documents call
"your model"; ``s3://bucket`` is an existing bucket on the loopback S3 server, reached through the ``AWS_*``
environment variables that the documents name (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``), and ``$AZURE_STORAGE_CONNECTION_STRING`` names the loopback Azure server (its ``container``
exists). Nothing else is configured behind a block's back. Trainers and Fabric run
reduced: a few steps, one CPU process (``devices`` above 1 becomes 1), no logger or progress bar.

Commands run in a reduced form where running them whole would take minutes (:data:`REDUCED`): ``nox -s NAME``
checks that the session exists and its arguments parse, ``examples/*.py`` Hydra scripts compose their config with the
overrides given, ``pip install`` checks that what it names is installed, benchmarks run with small sizes.

A block that truly cannot run carries ``norun`` after its language and a ``<!-- norun: why -->`` line before it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SHELLS = ("bash", "sh", "console", "shell")
_FENCE = re.compile(r"^(```+)\s*([^\n`]*)$")


@dataclasses.dataclass
class Block:
    document: str
    line: int
    language: str
    flags: list[str]
    code: str
    reason: str | None = None

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"


def blocks(document: str) -> list[Block]:
    """The fenced blocks of ``document`` (a path relative to the repository), in order."""
    with open(os.path.join(ROOT, document)) as f:
        lines = f.read().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.group(1), match.group(2).split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        previous = lines[i - 1].strip() if i else ""
        reason = re.fullmatch(r"<!--\s*norun:\s*(.+?)\s*-->", previous)
        language = info[0] if info else ""
        found.append(Block(document, i + 1, language, info[1:], "\n".join(lines[i + 1 : end]), reason and reason[1]))
        i = end + 1
    return found


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block (comments and prompts removed; ``a && b`` is two), split as a shell splits."""
    out = []
    for line in code.splitlines():
        line = line.strip().removeprefix("$ ").strip()
        for part in re.split(r"\s&&\s", line):
            argv = shlex.split(part, comments=True)
            if argv:
                out.append(argv)
    return out


REDUCED = {
    "nox": "checks that the session exists and that the arguments after `--` parse",
    "pip install": "checks that every package or extra named is installed (no download)",
    "examples/*.py (Hydra)": "composes the script's config with the overrides given (Hydra's compose API)",
    "examples/cli.py": "parses the LightningCLI arguments and config, prints the config (--print_config)",
    "benchmarks": "small sizes (2 saves of 1 MiB layers, 8 MiB or what keeps one layer trainable)",
}
"""Commands run in a reduced form, and how (see the module docstring)."""


def reduced_benchmark_args(args: list[str]) -> list[str]:
    """A benchmark's arguments at small sizes: 2 saves of 1 MiB layers, as few MiB as keep a layer trainable."""
    out = list(args)
    frozen = float(out[out.index("--frozen") + 1]) if "--frozen" in out else 0.0
    small = {"--total-mib": "64" if frozen > 0.9 else "8", "--saves": "2", "--layer-mib": "1"}
    for flag, value in small.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        elif flag == "--layer-mib" and "--total-mib" in out:
            out += [flag, value]
    return out


def python_module_command(argv: list[str]) -> tuple[str, list[str]] | None:
    """``("pkg.mod", args)`` for ``python -m pkg.mod args`` (``python3`` too); ``None`` otherwise."""
    if len(argv) >= 3 and argv[0] in ("python", "python3") and argv[1] == "-m":
        return argv[2], argv[3:]
    return None


def script_command(argv: list[str]) -> tuple[str, list[str]] | None:
    """``("examples/train.py", args)`` for ``python examples/train.py args``; ``None`` otherwise."""
    if len(argv) >= 2 and argv[0] in ("python", "python3") and argv[1].endswith(".py"):
        return argv[1], argv[2:]
    return None


def nox_session(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(session, posargs)`` for ``nox -s NAME [-- args]`` / ``python -m nox ...``; ``None`` otherwise."""
    module = python_module_command(argv)
    if module and module[0] == "nox":
        argv = ["nox", *module[1]]
    if not argv or argv[0] != "nox" or "-s" not in argv:
        return None
    posargs = argv[argv.index("--") + 1 :] if "--" in argv else []
    return argv[argv.index("-s") + 1], posargs


def config_name_of(script: str) -> str:
    """The ``config_name`` of a Hydra script's ``@hydra.main``."""
    with open(os.path.join(ROOT, script)) as f:
        match = re.search(r"config_name=\"([^\"]+)\"", f.read())
    if match is None:
        raise AssertionError(f"{script} has no @hydra.main(config_name=...)")
    return match.group(1)


def fast_trainer_defaults(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A documented ``Trainer(...)``'s arguments, reduced to a few steps on one CPU process."""
    kwargs = dict(kwargs)
    kwargs["accelerator"] = "cpu"
    if not isinstance(kwargs.get("devices"), int) or kwargs["devices"] > 1:
        kwargs["devices"] = 1
    kwargs.setdefault("max_steps", 4)
    kwargs.setdefault("limit_val_batches", 2)
    for key, value in (("logger", False), ("enable_progress_bar", False), ("enable_model_summary", False)):
        kwargs.setdefault(key, value)
    return kwargs


def extras(package_spec: str) -> list[str]:
    """``[s3,gcs]`` of ``.[s3,gcs]`` / ``-e ".[s3]"`` / ``lightning-dcp[s3]``."""
    match = re.search(r"\[([^\]]+)\]", package_spec)
    return [e.strip() for e in match.group(1).split(",")] if match else []
