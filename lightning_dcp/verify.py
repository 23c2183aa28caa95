"""``python -m lightning_dcp.verify CKPT [--fast]``: check a checkpoint against the checksums recorded at save."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_dcp._integrity import check_checkpoint
from lightning_dcp._storage import Location
from lightning_dcp.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["main", "verify_checkpoint"]


def verify_checkpoint(
    path: str | os.PathLike, *, full: bool = True, storage_options: dict[str, Any] | None = None
) -> None:
    """Check that the checkpoint at ``path`` is committed and every byte matches what was saved.

    Args:
        path: Checkpoint directory (local path or fsspec URL).
        full: Read every record of every data file and check its CRC32 (default). ``False``: the fast checks that
            also run before every load (commit marker, ``.metadata`` CRC32, data file sizes).
        storage_options: fsspec options for remote storage.

    Rank 0 only (or any single process).

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        NotACheckpointError: No commit marker (an incomplete save).
        CorruptCheckpointError: A file is missing, truncated or altered; ``err.file`` names it.
    """
    location = Location(path, storage_options=storage_options).resolve()
    if not location.exists():
        raise CheckpointNotFoundError(f"No checkpoint exists at {location.url!r}.")
    check_checkpoint(location, full=full)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns 0 when the checkpoint verifies, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.verify",
        description="Verify a lightning_dcp checkpoint against the CRC32 checksums recorded when it was saved.",
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
