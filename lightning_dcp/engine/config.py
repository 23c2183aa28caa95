"""``CheckpointerConfig``: every option of the engine in one keyword-only dataclass, checked when it is made.

The front ends (the Trainer's ``DCPCheckpointIO``, Fabric's ``DCPStrategyMixin``) build one from their keyword
arguments and :meth:`CheckpointerConfig.build` makes the
:class:`~lightning_dcp.engine.checkpointer.Checkpointer` (and the local tier, when ``local_dir`` is given).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.save.when_busy import WHEN_BUSY
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import Tiers
from lightning_dcp.engine.tiers.memory import MemoryTier

__all__ = ["CheckpointerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """The options of a :class:`~lightning_dcp.engine.checkpointer.Checkpointer`, checked in ``__post_init__``.

    Raises:
        ValueError: ``local_keep`` is not a positive integer or ``local_dir`` is not local (with ``local_dir``),
            ``thread_count`` is not a positive integer, or ``when_busy`` is neither ``"wait"`` nor ``"skip"``.
    """

    storage_options: dict[str, Any] | None = None
    """fsspec filesystem options (credentials, endpoint, region) of every read, write, list and delete; per-call
    ``storage_options`` are merged on top."""
    thread_count: int = 1
    """Writer threads per rank; each writes its own ``__{rank}_{n}.distcp`` file (DCP behaviour)."""
    sync_files: bool = True
    """``fsync`` each local data file before the checkpoint is committed (never on remote stores)."""
    async_save: bool = False
    """Write in the background over a dedicated gloo group (:mod:`lightning_dcp.engine.save.async_save`): a save
    returns once this rank's part is staged into reused CPU buffers (pinned on CUDA); at most one is in flight."""
    defer_staging: bool = True
    """With ``async_save``: the tensors only optimizer steps change are copied in the background after the save
    returned, while the next optimizer step waits for the copies (or written in place: live writes); ``False``
    copies everything before returning (:mod:`lightning_dcp.engine.save.live_write`)."""
    when_busy: str = "wait"
    """With ``async_save``: a save called while the previous one is being written waits (``"wait"``) or is skipped
    with a warning (``"skip"``, under which optimizer steps never wait for a live writer either;
    :mod:`lightning_dcp.engine.save.when_busy`)."""
    incremental: bool = False
    """Give each tensor record of 1 MiB and more its own data file, hard-linked from the newest committed checkpoint
    of the same directory when its bytes are unchanged (local disks; :mod:`lightning_dcp.engine.save.incremental`)."""
    local_dir: str | os.PathLike | None = None
    """A local directory as the fast tier of remote checkpoint paths (:class:`~lightning_dcp.engine.tiers.Tiers`):
    a save is committed there, then uploaded in the background; ``None``: no local tier."""
    local_keep: int = 2
    """With ``local_dir``: committed checkpoints the local tier keeps (older ones leave once uploaded)."""
    memory: MemoryTier | None = None
    """A memory tier (:class:`~lightning_dcp.engine.tiers.memory.MemoryTier`): saves inside
    :meth:`~lightning_dcp.engine.checkpointer.Checkpointer.into_memory` go to host shared memory."""

    def __post_init__(self) -> None:
        if self.local_dir is not None:
            keep = self.local_keep
            if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
                raise ValueError(f"`local_keep` must be a positive integer, got {keep!r}.")
            if not Location(os.fspath(self.local_dir)).local:
                raise ValueError(f"`local_dir` must be a directory on a local disk, got {os.fspath(self.local_dir)!r}.")
        if not isinstance(self.thread_count, int) or self.thread_count < 1:
            raise ValueError(f"`thread_count` must be a positive integer, got {self.thread_count!r}.")
        if self.when_busy not in WHEN_BUSY:
            raise ValueError(f"`when_busy` must be one of {WHEN_BUSY}, got {self.when_busy!r}.")

    def build(self) -> Checkpointer:
        """The :class:`~lightning_dcp.engine.checkpointer.Checkpointer` of these options (and its local tier)."""
        tiers = None
        if self.local_dir is not None:
            tiers = Tiers(self.local_dir, keep=self.local_keep, storage_options=self.storage_options)
        return Checkpointer(
            storage_options=self.storage_options,
            thread_count=self.thread_count,
            sync_files=self.sync_files,
            async_save=self.async_save,
            defer_staging=self.defer_staging,
            when_busy=self.when_busy,
            tiers=tiers,
            incremental=self.incremental,
            memory=self.memory,
        )
