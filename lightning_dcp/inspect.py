"""``python -m lightning_dcp.inspect CKPT_DIR``: what a checkpoint holds, without reading any tensor data.

The function is :func:`lightning_dcp.inspect_checkpoint`. Only DCP's ``.metadata`` and the small non-tensor state
(our ``lightning`` blob, or Lightning's ``meta.pt``) are read.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from lightning_dcp._cli import parse_storage_options, run_cli
from lightning_dcp.tools.inspect import inspect_checkpoint

__all__ = ["inspect_checkpoint", "main"]


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _render(report: dict[str, Any], *, all_tensors: bool) -> str:
    lines = [
        f"checkpoint   {report['path']}",
        f"format       {report['format']}",
        f"strategy     {report['strategy']}  (world size {report['world_size']})",
        f"progress     epoch {report['epoch']}, global step {report['global_step']}"
        if report.get("front_end") != "fabric"
        else f"state        modules {report['modules']}, optimizers {report['optimizers']}, other {report['objects']}",
        f"written by   {_writer(report['versions'])}",
        f"tensors      {report['num_tensors']} ({_human(report['total_bytes'])}; weights"
        f" {_human(report['weight_bytes'])}) in {len(report['files'])} data files",
        "",
    ]
    shown = [t for t in report["tensors"] if all_tensors or t["weight"]]
    width = max((len(t["name"]) for t in shown), default=4)
    lines.append(f"{'name':<{width}}  {'dtype':<9} {'shape':<20} {'size':>10}")
    for t in shown:
        shape = "(" + ", ".join(map(str, t["shape"])) + ")"
        lines.append(f"{t['name']:<{width}}  {t['dtype']:<9} {shape:<20} {_human(t['bytes']):>10}")
    if not all_tensors and len(shown) < len(report["tensors"]):
        lines.append(f"... and {len(report['tensors']) - len(shown)} optimizer/other tensors (--all to list them)")
    return "\n".join(lines)


def _writer(versions: dict[str, Any]) -> str:
    """``lightning_dcp 0.2.0 (commit 1a2b...), torch 2.13.0, lightning 2.6.6``; what was not recorded is left out."""
    if versions.get("lightning_dcp") is None and versions.get("torch") is None:
        return "not recorded"
    parts = []
    if versions.get("lightning_dcp") is not None:
        commit = versions.get("lightning_dcp_commit")
        parts.append(f"lightning_dcp {versions['lightning_dcp']}" + (f" (commit {commit})" if commit else ""))
    parts += [f"{name} {versions[name]}" for name in ("torch", "lightning") if versions.get(name) is not None]
    return ", ".join(parts)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.inspect",
        description="Show what a DCP checkpoint holds (FQNs, shapes, dtypes, bytes, world size, step) from its"
        " metadata, without reading tensor data.",
        epilog="examples:\n  python -m lightning_dcp.inspect checkpoints/last.ckpt\n"
        "  python -m lightning_dcp.inspect s3://bucket/run/step=100.ckpt --json > report.json\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--all", action="store_true", help="list optimizer and other tensors too")
    parser.add_argument("--storage-options", default=None, metavar="JSON", help="fsspec options as a JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns the exit code: 0 on success, 1 when the path is no readable checkpoint."""
    args = _parser().parse_args(argv)

    def run() -> int:
        report = inspect_checkpoint(args.checkpoint, storage_options=parse_storage_options(args.storage_options))
        print(json.dumps(report, indent=2) if args.json else _render(report, all_tensors=args.all))
        return 0

    return run_cli(run)


if __name__ == "__main__":
    raise SystemExit(main())
