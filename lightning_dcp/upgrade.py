"""``python -m lightning_dcp.upgrade PATH``: Lightning's checkpoint upgrade, for checkpoint directories too.

Lightning's own ``python -m lightning.pytorch.utilities.upgrade_checkpoint`` knows files only (and fails on a folder
holding checkpoint directories). This command migrates lightning_dcp checkpoint directories and the ``meta.pt`` of
Lightning's sharded ones with Lightning's migrations (nothing is written when none applies), and hands every file to
Lightning's upgrade. The function is :func:`lightning_dcp.trainer.upgrade.upgrade_checkpoints`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_dcp._cli import parse_storage_options, run_cli
from lightning_dcp.trainer.upgrade import upgrade_checkpoints

__all__ = ["main", "upgrade_checkpoints"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.upgrade",
        description="Upgrade checkpoints (directories and files) to the installed Lightning version's format; files"
        " are handed to Lightning's own upgrade, which keeps a .bak copy of each.",
        epilog="examples:\n  python -m lightning_dcp.upgrade checkpoints/\n"
        "  python -m lightning_dcp.upgrade checkpoints/step=100.ckpt\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", help="a checkpoint directory or file, or a folder of them (searched recursively)")
    parser.add_argument("--extension", "-e", default=".ckpt", help="extension of checkpoint files (default: .ckpt)")
    parser.add_argument("--map-to-cpu", action="store_true", help="files: map tensors to CPU (as Lightning's tool)")
    parser.add_argument("--storage-options", default=None, metavar="JSON", help="fsspec options as a JSON object")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns 0 when every checkpoint is current or upgraded, 1 otherwise."""
    args = _parser().parse_args(argv)

    def run() -> int:
        results = upgrade_checkpoints(
            args.path,
            extension=args.extension,
            map_to_cpu=args.map_to_cpu,
            storage_options=parse_storage_options(args.storage_options),
        )
        for result in results:
            print(f"{result.action}: {result.path}{f' ({result.detail})' if result.detail else ''}")
        if not results:
            print(f"error: no checkpoint was found under {args.path!r}", file=sys.stderr)
        return 0 if results and all(r.action != "failed" for r in results) else 1

    return run_cli(run)


if __name__ == "__main__":
    raise SystemExit(main())
