"""Finding the checkpoint to resume a Fabric run from: the newest committed one in a directory."""

from __future__ import annotations

import os
from typing import Any

from lightning_dcp.engine import Location
from lightning_dcp.engine.tiers import DurableCatalog

__all__ = ["latest_checkpoint"]


def latest_checkpoint(directory: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest committed, intact checkpoint directly inside ``directory``, or ``None`` when there is none.

    Candidates are the subdirectories carrying a ``.commit`` marker (a save that was interrupted, e.g. by
    ``kill -9``, has none and is skipped), newest first in the order recorded at save (the directory's save
    counter, then the step; never a wall clock); the first that passes the fast checks of
    every load (marker, ``.metadata`` checksum, data file sizes) is returned. Hidden entries (staging) are ignored.

    Args:
        directory: Where the run saves its checkpoints (local path or fsspec URL).
        storage_options: fsspec options for remote storage.

    Returns:
        The checkpoint's path or URL (``str``), to pass to ``fabric.load``.

    Rank 0 only: broadcast its answer, e.g. ``fabric.broadcast(latest_checkpoint(d) if fabric.is_global_zero
    else None)``, so that every rank resumes from the same checkpoint.
    """
    found = DurableCatalog(None).newest_valid(Location(directory, storage_options=storage_options))
    return None if found is None else found[0].url
