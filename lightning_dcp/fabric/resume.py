"""Finding the checkpoint to resume a Fabric run from: the newest committed one in a directory."""

from __future__ import annotations

import os
from typing import Any

from lightning_dcp.engine.integrity import check_checkpoint
from lightning_dcp.engine.storage import Location, read_commit
from lightning_dcp.errors import CorruptCheckpointError, NotACheckpointError

__all__ = ["latest_checkpoint"]


def latest_checkpoint(directory: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest committed, intact checkpoint directly inside ``directory``, or ``None`` when there is none.

    Candidates are the subdirectories carrying a ``.commit`` marker (a save that was interrupted, e.g. by
    ``kill -9``, has none and is skipped), newest commit time first; the first that passes the fast checks of
    every load (marker, ``.metadata`` checksum, data file sizes) is returned. Hidden entries (staging) are ignored.

    Args:
        directory: Where the run saves its checkpoints (local path or fsspec URL).
        storage_options: fsspec options for remote storage.

    Returns:
        The checkpoint's path or URL (``str``), to pass to ``fabric.load``.

    Rank 0 only: broadcast its answer, e.g. ``fabric.broadcast(latest_checkpoint(d) if fabric.is_global_zero
    else None)``, so that every rank resumes from the same checkpoint.
    """
    parent = Location(directory, storage_options=storage_options)
    candidates = []
    for name, kind in parent.entries():
        if kind != "directory" or name.startswith("."):
            continue
        child = parent.child(name)
        try:
            marker = read_commit(child)
        except CorruptCheckpointError:
            continue
        if marker is not None:
            candidates.append((marker.get("committed_at", 0.0), name, child))
    for _, _, child in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True):
        try:
            check_checkpoint(child)
        except NotACheckpointError:
            continue
        return child.url
    return None
