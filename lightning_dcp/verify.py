"""``python -m lightning_dcp.verify CKPT [--fast]``: check a checkpoint against the checksums recorded at save."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_dcp._cli import parse_storage_options, run_cli
from lightning_dcp.engine import Location, designated, verify_checkpoint
from lightning_dcp.tools.progress import BarCallback

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
        bar = BarCallback(args.progress, desc=location.name)
        try:  # the fast checks first (they run before every load), then every record against its checksum
            verify_checkpoint(location.url, full=not args.fast, storage_options=options, progress=bar)
        finally:
            bar.close()
        shown = (
            args.checkpoint if location.url == args.checkpoint else f"{location.url} (designated by {args.checkpoint})"
        )
        print(f"OK: {shown}")
        return 0

    return run_cli(run)


if __name__ == "__main__":
    raise SystemExit(main())
