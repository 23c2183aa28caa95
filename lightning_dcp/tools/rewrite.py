"""Rewrite the non-tensor Trainer state of a lightning_dcp checkpoint directory (the upgrade path for migrations).

The Trainer state is one blob inside the DCP files, covered by ``.metadata`` and the ``.commit`` checksums, so it
cannot be patched in place: a changed blob means a new checkpoint. :func:`rewrite_trainer_state` reads the blob alone
first and stops there when nothing changes; otherwise it reads the whole checkpoint into CPU memory (as Lightning's
own upgrade does for a file), writes it again with the new blob from this process, keeping every tensor and every
rank's own state (RNG) as they were, and commits it over the old one with the usual staging and commit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed.checkpoint as dcp

from lightning_dcp.engine import (
    Checkpointer,
    CheckpointerConfig,
    Location,
    Source,
    layout,
    probe,
    single_process_ok,
    storage_writer,
)
from lightning_dcp.errors import NotACheckpointError, checkpoint_failure

__all__ = ["BACKUP_SUFFIX", "rewrite_trainer_state"]

BACKUP_SUFFIX = ".bak"
"""A rewritten checkpoint ``run/x.ckpt`` is first copied to the hidden ``run/.x.ckpt.bak`` (never overwritten)."""


def rewrite_trainer_state(
    path: str | os.PathLike,
    transform: Callable[[dict[str, Any]], dict[str, Any] | None],
    *,
    storage_options: dict[str, Any] | None = None,
    backup: bool = True,
) -> bool:
    """Apply ``transform`` to the Trainer state of the checkpoint directory at ``path``; rewrite it if it changed.

    Args:
        path: A lightning_dcp checkpoint directory (local path or fsspec URL; links and pointers are followed).
        transform: Gets the decoded Trainer state (everything but tensors; it may change it in place) and returns
            the new state, or ``None`` when nothing changes (then nothing is written and no tensor is read).
        storage_options: fsspec options for remote storage.
        backup: Copy the checkpoint to the hidden sibling ``.{name}.bak`` before rewriting it (an existing backup is
            kept: it is the original).

    Returns:
        Whether the checkpoint was rewritten.

    Rank 0 only (or any single process). Memory: the whole checkpoint, once, when it is rewritten.

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        NotACheckpointError: Not a lightning_dcp checkpoint directory (or an incomplete save).
        CheckpointError: Writing failed; the checkpoint at ``path`` is unchanged.
    """
    found = probe(Location(path, storage_options=storage_options))
    if found.kind != "dcp":
        raise NotACheckpointError(f"{found.url!r} is not a lightning_dcp checkpoint directory; nothing to rewrite.")
    location = Location(found.url, storage_options=storage_options)
    state = transform(Source(location).read_extra())
    if state is None:
        return False
    loaded = Checkpointer(CheckpointerConfig(storage_options=storage_options)).load(location.url)
    tree = dict(loaded.tree)
    rank_blobs = tree.pop(layout.RANK_KEY, None)
    state = dict(state)
    info = state.pop(layout.INFO_KEY, {})
    dcp_state = layout.build_state(tree, objects=state, info={k: v for k, v in info.items() if k != "format_version"})
    if rank_blobs:
        dcp_state[layout.RANK_KEY] = rank_blobs  # each rank's own state, bytes as they were written
    if backup:
        _backup(location)
    staging = location.staging()
    writer = storage_writer(staging, thread_count=1, sync_files=location.local)
    try:
        with single_process_ok():
            dcp.save(dcp_state, storage_writer=writer, no_dist=True)
        location.commit_from(staging)
    except (Exception, dcp.CheckpointException) as err:  # DCP's exception derives from BaseException
        staging.remove()
        raise checkpoint_failure(err, f"Rewriting the checkpoint at {location.url!r} failed") from err
    return True


def _backup(location: Location) -> None:
    backup = location.sibling(f".{location.name}{BACKUP_SUFFIX}")
    if backup.exists():
        return
    location.fs.copy(location.path.rstrip("/") + "/", backup.path, recursive=True)
