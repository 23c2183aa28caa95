"""A pytest plugin for Lightning's own checkpoint tests: ``DCPCheckpointIO`` in every Trainer that picks none itself.

``nox -s lightning_tests`` runs Lightning's tests (tag 2.6.5) with ``-p swap_plugin``. Every ``Trainer(...)`` built
without a strategy of its own (none, ``"auto"``, ``"ddp"``-style names or a stock strategy object without a
CheckpointIO) and without a CheckpointIO among its ``plugins`` gets ``plugins=[..., DCPCheckpointIO()]``: its
checkpoints become lightning_dcp directories, written and read by the plugin.

Each failure is sorted into one of two kinds, and the counts (with every behavioural failure's reason) are printed
and written to ``$LIGHTNING_SUITE_REPORT`` (JSON):

- *format-bound*: the test depends on a checkpoint being one file (``os.path.isfile``, ``torch.load(path)`` in the
  test, counting mocked ``torch.save`` calls, ...), which is what lightning_dcp changes by design
  (docs/lightning-habits.md, "What still differs");
- *deliberate*: a documented difference (:data:`DELIBERATE`, docs/lightning-habits.md, "What still differs");
- *behavioural*: anything else.
"""

from __future__ import annotations

import collections
import json
import os
import re
from typing import Any

import pytest

FORMAT_BOUND = {
    "a directory where the test opens a file": r"IsADirectoryError|Is a directory",
    "os.path.isfile / is_file / getsize on the checkpoint": r"isfile\(|\.is_file\(\)|getsize\(|os\.path\.getsize",
    "torch.load / pl_load of the checkpoint path in the test": r"torch\.load\(|pl_load\(|_load\(.*\.ckpt",
    "mocked torch.save or TorchCheckpointIO calls counted": r"torch\.save|TorchCheckpointIO\.save_checkpoint|"
    r"save_mock|io_mock|call_count|assert_called",
    "file size or file hash compared": r"st_size|md5|sha256|filecmp",
}
"""Failure signatures of a test that depends on a checkpoint being one ``torch.save`` file (searched in the
failure's traceback and message)."""

DELIBERATE = {
    "test_trainer_save_checkpoint_storage_options": "storage_options that are not a dict of fsspec options are a"
    " TypeError naming the fix (Lightning's TorchCheckpointIO raises TypeError for any storage_options); the test"
    " passes a string, and also asserts calls to a mocked TorchCheckpointIO, which the swapped plugin never makes",
    "test_local_cross_device_checkpoint": "a filesystem where every os.rename fails with EXDEV (the test patches"
    " os.rename): DCP renames .metadata.tmp within the staging directory; real cross-device commits copy",
}
"""Tests whose failure is a difference kept on purpose, by test function name, with the reason."""

_results: dict[str, list[str]] = collections.defaultdict(list)
_reasons: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    from lightning.pytorch import Trainer

    import lightning_dcp
    from lightning_dcp import DCPCheckpointIO

    original = Trainer.__init__
    if getattr(original, "_lightning_dcp_swapped", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807 - Trainer's own
        if _swappable(kwargs.get("strategy", "auto"), kwargs.get("plugins")):
            plugins = kwargs.get("plugins") or []
            kwargs["plugins"] = [*(plugins if isinstance(plugins, list) else [plugins]), DCPCheckpointIO()]
        original(self, *args, **kwargs)

    __init__._lightning_dcp_swapped = True
    Trainer.__init__ = __init__
    config._lightning_dcp_version = lightning_dcp.__version__


def _swappable(strategy: Any, plugins: Any) -> bool:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.strategies import Strategy

    items = plugins if isinstance(plugins, list) else [plugins] if plugins is not None else []
    if any(isinstance(p, CheckpointIO) for p in items):
        return False
    if isinstance(strategy, Strategy):
        return strategy._checkpoint_io is None and type(strategy).__module__.startswith("lightning.")
    return isinstance(strategy, str) and not strategy.startswith(("fsdp", "deepspeed", "dcp_", "xla"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.passed and report.when == "call":
        _results["passed"].append(report.nodeid)
    elif report.skipped and report.when in ("setup", "call"):
        _results["skipped"].append(report.nodeid)
    elif report.failed:
        kind = {"setup": "setup error", "teardown": "teardown error"}.get(report.when, "failed")
        text = report.longreprtext
        bound = next((why for why, pattern in FORMAT_BOUND.items() if re.search(pattern, text)), None)
        deliberate = DELIBERATE.get(report.nodeid.split("::")[-1].split("[")[0])
        if deliberate and report.when == "call":
            key, why = "deliberate", deliberate
        elif bound and report.when == "call":
            key, why = "format-bound", bound
        else:
            key, why = "behavioural", _last_error(text)
        _results[key].append(report.nodeid)
        _reasons[report.nodeid] = f"{kind}: {why}"


def _last_error(text: str) -> str:
    errors = [line[2:].strip() for line in text.splitlines() if line.startswith("E ")]
    return (errors[0] if errors else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    counts = {k: len(v) for k, v in _results.items()}
    write = terminalreporter.write_line
    write(f"lightning_dcp swap: {counts}")
    for key in ("behavioural", "deliberate"):
        for nodeid in _results.get(key, []):
            write(f"  {key:12} {nodeid}: {_reasons[nodeid]}")
    bound = collections.Counter(_reasons[n].split(": ", 1)[1] for n in _results.get("format-bound", []))
    for why, n in bound.most_common():
        write(f"  format-bound {n:3} x {why}")
    path = os.environ.get("LIGHTNING_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"counts": counts, "results": _results, "reasons": _reasons}, f, indent=1, sort_keys=True)
