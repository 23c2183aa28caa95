"""``CheckpointerConfig``: every option of the engine in one keyword-only dataclass, checked when it is made.

The front ends (the Trainer's ``DCPCheckpointIO``, Fabric's ``DCPStrategyMixin``) build one from their keyword
arguments and hand it to ``Checkpointer(config)``, which makes its parts from it (the local tier, when ``local_dir``
is given).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from lightning_dcp.engine.save.when_busy import WHEN_BUSY
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier

__all__ = ["CheckpointerConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointerConfig:
    """The options of a ``Checkpointer``, checked in ``__post_init__``.

    The one description of each option: the Trainer's ``DCPCheckpointIO`` and Fabric's ``DCPStrategyMixin`` take the
    same keywords, build one of these from them, and document only what their front end adds.

    Raises:
        ValueError: ``local_keep`` is not a positive integer or ``local_dir`` is not local (with ``local_dir``),
            ``thread_count`` is not a positive integer, or ``when_busy`` is neither ``"wait"`` nor ``"skip"``.
    """

    storage_options: dict[str, Any] | None = None
    """fsspec filesystem options (credentials, endpoint, region) of every read, write, list and delete; the
    ``storage_options`` a Trainer's ``save_checkpoint`` call passes are merged on top."""
    thread_count: int = 1
    """Writer threads per rank; each writes its own ``__{rank}_{n}.distcp`` file (DCP behaviour)."""
    sync_files: bool = True
    """``fsync`` each local data file before the checkpoint is committed (never on remote stores)."""
    async_save: bool = False
    """Write in the background over a dedicated gloo group (``lightning_dcp.engine.save.async_save``): a save
    returns once this rank's state is staged into reused CPU buffers (pinned on CUDA). At most one save is in flight;
    the next save, a load, a removal of that checkpoint and the end of the run (the Trainer's ``teardown``; with Fabric
    ``wait_for_save``, ``teardown`` or the interpreter's exit, which logs how long it waited) wait for it, and its
    error is raised there. Removals requested while it is in flight run after it commits."""
    defer_staging: bool = True
    """With ``async_save``: the parameters an optimizer holds and its state are copied into the staging buffers in the
    background after the save returned, during the next step's forward and backward passes (or, on a local disk,
    written from where they are without a copy when the last saves show the write is done by then), and its optimizer
    update waits for them; buffers a forward pass updates (BatchNorm statistics), parameters no optimizer holds (an
    EMA copy), GPU tensors and the rest of the state are copied before it returns. A tensor that changes outside
    optimizer steps (weight clipping after the step) is detected and copied at the call from then on; a save it would
    have torn is dropped with a warning naming it instead. Changes through ``param.data`` are not seen: code that
    writes parameters that way between a save and the next update (a callback, ``training_step``, a forward pass)
    needs ``False``, which copies everything before returning (``lightning_dcp.engine.save.live_write``)."""
    when_busy: str = "wait"
    """With ``async_save``: what a save does when called while the previous one is still being written (saves
    requested faster than the disk takes them). ``"wait"``: block until it is committed, then save; every requested
    checkpoint is written (the wait counts in the previous save's ``checkpoint/save_blocked_s``). ``"skip"``: return at
    once without saving, warning with the step and path skipped (``Checkpointer.skipped`` lists them);
    ``ModelCheckpoint``'s removals requested after a skip are held until a newer save commits, so nothing is removed
    before a newer checkpoint exists. A second save of the step in flight (``last.ckpt`` after the top-k file) always
    waits; ``save_last="link"`` avoids that second write. Under ``"skip"`` optimizer steps wait for a save's memory
    copies only (never for a live write to reach the disk): the loop never waits for a write still running when the
    next save is called, only, at the end of training, for the last one. Every wait of the loop for a save is in its
    ``checkpoint/save_blocked_s`` (``lightning_dcp.engine.save.when_busy``)."""
    incremental: bool = False
    """Write a tensor (or chunk) of 1 MiB and more only when its bytes differ from the newest committed checkpoint in
    the same directory; an unchanged one is hard-linked from it (local disks), so frozen parameters cost no writes.
    Every checkpoint stays complete and loads alone (``lightning_dcp.engine.save.incremental``)."""
    local_dir: str | os.PathLike | None = None
    """A directory on a local disk as the fast tier of remote checkpoint paths (``s3://``, ``gs://``, ``az://``, ...;
    ``Tiers``). A save to a remote path is written and committed in ``local_dir``
    under the same name at disk speed (synchronously or with ``async_save``); a background thread on rank 0 then
    uploads it, one checkpoint at a time, checks that every file arrived with its size and that ``.metadata`` reads
    back intact, and commits it remotely (``.commit`` written last). Nothing remote runs in the training loop:
    existence checks, pruning and ``last`` pointers go through the local tier and the uploader, which retries through
    store outages with a logged backoff (0.5 s doubling to 30 s); training goes on, with one warning per save while
    the store is down. ``ckpt_path="last"`` and remote paths load the newest checkpoint committed on either tier, the
    local copy first; on a machine with an empty ``local_dir`` they load from the remote. Pruning removes the local
    copy at once and the remote copy behind the uploads queued before it. Uploads, removals and pointer writes are
    journaled in ``local_dir``: a killed run's are replayed by the next run with the same ``local_dir``, so the remote
    ends with exactly what top-k and ``save_last`` ask for. The end of the run waits for the uploads while the store
    answers; once it has answered nothing for 60 s (since the wait began or since its last answer: a file or a part of
    one taken, a task done), whether its requests fail or hang, it raises ``StorageUnavailableError`` naming what is
    left (committed locally; the next run uploads it). One ``local_dir`` mirrors one remote directory, and every rank
    must reach it (one machine, or a shared filesystem). Named ``local_dir`` rather than ``cache_dir`` or
    ``staging_dir``: it holds real, committed checkpoints (for a while the only copy), not a disposable cache or a
    temporary area. ``None``: no local tier."""
    local_keep: int = 2
    """With ``local_dir``: the committed checkpoints ``local_dir`` keeps (the newest); older ones leave it once they
    are committed remotely (never before, so it holds more while uploads fall behind)."""
    memory: MemoryTier | None = None
    """A memory tier ([`MemoryTier`][lightning_dcp.MemoryTier]): saves inside ``Checkpointer.into_memory`` go to host
    shared memory (what Fabric's strategies and the Trainer's ``MemoryCheckpoint`` make of it is in their own
    documentation)."""

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> CheckpointerConfig:
        """The config of the options among ``arguments`` (by field name; other names are ignored).

        What a front end's ``__init__`` hands over: ``CheckpointerConfig.of(locals())``. Each front end names the
        options it offers in its own signature (for its users, its docs and LightningCLI); their values reach the
        engine by name here, in one place, so an option added to a signature cannot be left out of the config.

        Raises:
            ValueError: As the constructor (a bad ``thread_count``, ``when_busy``, ``local_dir`` or ``local_keep``).
        """
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in arguments.items() if name in names})

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
