"""``python -m lightning_dcp.verify CKPT [--fast]``: check a checkpoint against the checksums recorded at save."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from lightning_dcp._cli import parse_storage_options, run_cli
from lightning_dcp.engine import Location, check_checkpoint, designated, read_commit, verify_checkpoint
from lightning_dcp.tools.progress import ReadCounter, progress_bar

__all__ = ["main", "verify_checkpoint"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns 0 when the checkpoint verifies, 1 otherwise (``error: ...`` on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.verify",
        description="Verify a lightning_dcp checkpoint against the checksums recorded when it was saved.",
        epilog="examples:\n  python -m lightning_dcp.verify checkpoints/last.ckpt\n"
        "  python -m lightning_dcp.verify s3://bucket/run/step=100.ckpt --storage-options '{\"anon\": false}'\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument("--fast", action="store_true", help="check marker, metadata and file sizes only")
    parser.add_argument("--storage-options", default=None, metavar="JSON", help="fsspec options as a JSON object")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    parser.add_argument(
        "--progress", dest="progress", action="store_true", help="a progress bar also when stderr is no terminal"
    )
    args = parser.parse_args(argv)

    def run() -> int:
        options = parse_storage_options(args.storage_options)
        location = designated(Location(args.checkpoint, storage_options=options))  # "last": the newest valid one
        verify_checkpoint(location.url, full=False, storage_options=options)  # the checks that need no data read
        if not args.fast:
            _read_every_record(location, progress=args.progress)
        shown = (
            args.checkpoint if location.url == args.checkpoint else f"{location.url} (designated by {args.checkpoint})"
        )
        print(f"OK: {shown}")
        return 0

    return run_cli(run)


def _read_every_record(location: Location, *, progress: bool | None) -> None:
    """``verify_checkpoint(path, full=True)``'s pass over every record, with a progress bar over their bytes."""
    marker = read_commit(location) or {"files": {}}
    total = sum(record[1] for entry in marker["files"].values() for record in entry["records"])
    bar = progress_bar(total, progress, desc=location.name)
    try:
        check_checkpoint(_Counted(location, bar, names=set(marker["files"])), full=True)
    finally:
        bar.close()


class _Counted:
    """``location`` whose opened data files (``names``) count what is read from them on ``bar``."""

    def __init__(self, location: Location, bar: Any, *, names: set[str]) -> None:
        self._location, self._bar, self._names = location, bar, names

    def __getattr__(self, name: str) -> Any:
        return getattr(self._location, name)

    def open(self, name: str | None = None, mode: str = "rb") -> Any:
        file = self._location.open(name, mode)
        return ReadCounter(file, self._bar) if name in self._names else file


if __name__ == "__main__":
    raise SystemExit(main())
