"""``python -m lightning_dcp.verify CKPT [--fast]``: check a checkpoint against the checksums recorded at save."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_dcp.engine.integrity import verify_checkpoint
from lightning_dcp.errors import CheckpointError

__all__ = ["main", "verify_checkpoint"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns 0 when the checkpoint verifies, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.verify",
        description="Verify a lightning_dcp checkpoint against the checksums recorded when it was saved.",
        epilog="example:\n  python -m lightning_dcp.verify checkpoints/last.ckpt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument("--fast", action="store_true", help="check marker, metadata and file sizes only")
    args = parser.parse_args(argv)
    try:
        verify_checkpoint(args.checkpoint, full=not args.fast)
    except CheckpointError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    print(f"OK: {args.checkpoint}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
