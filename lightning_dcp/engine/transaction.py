"""The Checkpointer's save transaction: where a save writes, the write, the commit or the clean-up, the save counter.

:class:`SaveTransaction` owns what rank 0 knows of the directories it saved into; it is handed the parts it uses (the
save log, the async saves, the local tier, the incremental state), never the checkpointer.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_dcp._compat import package_version
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.save import saving
from lightning_dcp.engine.save.async_save import AsyncSaves
from lightning_dcp.engine.save.dcp_io import save_planner, storage_writer
from lightning_dcp.engine.save.incremental import Incremental
from lightning_dcp.engine.save_log import SaveLog, SaveRecord
from lightning_dcp.engine.storage.localfs import SNAPSHOT_PREFIX, STAGING_INFIX, is_internal_name
from lightning_dcp.engine.storage.location import Location, fsync_dir, new_token
from lightning_dcp.engine.storage.names import name_limit, too_long
from lightning_dcp.engine.storage.stores import is_unreachable
from lightning_dcp.engine.tiers import DurableCatalog, Tiers
from lightning_dcp.errors import InvalidPathError, checkpoint_failure

__all__ = [
    "SaveTransaction",
    "Saved",
    "check_name_length",
    "continue_run",
    "outage",
    "run",
    "versions",
]

log = logging.getLogger("lightning_dcp.engine.checkpointer")  # the checkpointer's log: filters name it


@dataclasses.dataclass
class Saved:
    """What :meth:`SaveTransaction.save` did: where the save went, how the caller records it.

    Attributes:
        location: The checkpoint written (the local twin of a tiered remote path).
        what: The line's verb: ``"saved"``, or ``"staged (writing in the background)"`` for an async save.
        record: Rank 0's record of the save (``None`` on other ranks).
        background: Whether the write goes on in the background (an async save).
    """

    location: Location
    what: str
    record: SaveRecord | None
    background: bool = False


class SaveTransaction:
    """Where a save writes, the write, the commit or the clean-up, the save counter of each directory.

    Owns what rank 0 knows of the directories it saved into (which hold a committed checkpoint, the last save
    counter used there). Built by the :class:`~lightning_dcp.engine.checkpointer.Checkpointer` from its parts.

    Args:
        saves: Rank 0's records of saves (the checkpointer's :class:`~lightning_dcp.engine.save_log.SaveLog`).
        thread_count: Writer threads per rank.
        sync_files: ``fsync`` local data files before the commit.
        async_saves: The background saves (``None``: saves are synchronous).
        tiers: The local tier of remote paths (``None``: none).
        catalog: What the directories hold on the durable tiers (the checkpointer's): where save counters go on from.
        incremental: The incremental state (``None``: off).
    """

    def __init__(
        self,
        *,
        saves: SaveLog,
        thread_count: int,
        sync_files: bool,
        async_saves: AsyncSaves | None,
        tiers: Tiers | None,
        catalog: DurableCatalog,
        incremental: Incremental | None,
    ) -> None:
        self.saves = saves
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.async_saves = async_saves
        self.tiers = tiers
        self.catalog = catalog
        self.incremental = incremental
        self.committed_in: set[str] = set()
        """Directories known to hold a committed checkpoint (rank 0)."""
        self.counters: dict[str, int] = {}
        """Directory URL -> the last save counter used there (rank 0)."""
        self.memory: Any = None
        """The memory tier attached (:class:`~lightning_dcp.engine.tiers.memory.MemoryTier`), if any: a directory's
        first save counts on from the highest save counter it holds (a resume from memory saves on), else from 0."""

    def save(
        self,
        parts: layout.SaveParts,
        location: Location,
        *,
        collective: bool,
        volatile: Iterable[torch.Tensor] | None,
        step: int | None,
        started: float,
    ) -> Saved:
        """The save of :meth:`~lightning_dcp.engine.checkpointer.Checkpointer.save`: write, then commit or clean up.

        Where it writes, the write (sync, or handed to the async saves), the commit or the clean-up; see there.
        ``started``: when the save began (``time.perf_counter()``), recorded on rank 0's record.

        Collective: call on all ranks when ``collective``.

        Raises:
            InvalidPathError: The name is one of this library's hidden names, or longer than its filesystem takes.
            CheckpointError: Writing or committing failed on some rank; nothing was committed.
        """
        if is_internal_name(location.name):
            raise InvalidPathError(
                f"The checkpoint name of {location.url!r} is one this library gives its own staging and upload"
                f" directories ('.<name>{STAGING_INFIX}<token>', '{SNAPSHOT_PREFIX}...'): listings pass over them and"
                " clean-ups delete them. Choose another name."
            )
        tiers, saves, async_saves = self.tiers, self.saves, self.async_saves
        remote = location if tiers is not None and tiers.covers(location) else None
        if remote is not None:  # tiered: written and committed locally, uploaded to `remote` once committed
            location = tiers.local_twin(remote)
        if location.local:
            check_name_length(location.path, url=location.url)
        rank, world_size = rank_and_world(collective)
        record = None
        if rank == 0:
            tier = "durable" if remote is None else "local_dir"
            record = saves.begin(
                location.url, step=step, tier=tier, started=started, background=async_saves is not None
            )

        def decide() -> tuple[str, bool, Any, int, str]:  # rank 0 decides where this save writes; all ranks agree
            if remote is not None:
                tiers.prepare(remote)
            previous = self.incremental and self.incremental.previous(location)
            return new_token(), self.writes_in_place(location), previous, self.next_counter(remote or location), run()

        try:
            token, direct, previous, counter, run_id = on_rank0(collective, decide)
        except Exception as err:  # storage refused even the preparation (a read-only mount): nothing was written
            raise checkpoint_failure(
                err, f"Saving the checkpoint to {location.url!r} failed", rank=0, unreachable=outage(location)
            ) from err
        target = location if direct else location.staging(token)

        def commit() -> None:  # rank 0, once every rank finished writing
            if not direct:
                location.commit_from(target)
            elif location.local:  # the marker's directory entry, and the directory's own, survive a power loss
                fsync_dir(location.path)
                fsync_dir(location.parent().path)
            self.committed_in.add(location.parent().url)
            location.remove_stale_staging(keep=None if direct else token)
            if remote is not None:
                tiers.committed(remote)
            if record is not None:
                saves.committed(record, sizes=location.sizes)
                line = saves.announce(record)  # async: here in the background thread, if the call returned
                if line is not None:
                    log.info(line)

        def abandon() -> None:  # rank 0, after a failure: nothing half-written stays visible
            if remote is not None:
                tiers.abandoned(remote)
            if not (direct and location.local and async_saves is not None):
                target.remove()
                return
            # An async save returned before it failed: Lightning may have linked `last` to this directory already.
            # Keep the (uncommitted, so never loaded) directory so that link never dangles; free its data.
            for name, _ in target.entries(follow_links=False):
                target.child(name).remove()

        def settle(record: SaveRecord) -> None:  # rank 0, on the caller's thread: the async save is over
            saves.settled(record)
            line = saves.announce(record)
            if line is not None:
                log.info(line)

        writer = storage_writer(target, thread_count=self.thread_count, sync_files=self.sync_files)
        writer.order = {
            "counter": counter,
            "step": step if isinstance(step, int) and step >= 0 else None,
            "run": run_id,
        }
        planner = save_planner(writers=world_size * self.thread_count)
        if self.incremental is not None:
            self.incremental.attach(writer, previous=previous, local=location.local)
        try:
            state = parts.state(rank, world_size=world_size, run=run_id, **versions())
            if async_saves is not None:
                async_saves.start(
                    state,
                    writer=writer,
                    planner=planner,
                    location=location,
                    rank=rank,
                    distributed=distributed(collective),
                    commit=commit,
                    abandon=abandon,
                    volatile=volatile,
                    charge=None if record is None else lambda seconds: saves.waited(record, seconds),
                    settle=None if record is None else lambda: settle(record),
                )
                return Saved(location, "staged (writing in the background)", record, background=True)
            saving.save(state, writer=writer, planner=planner, distributed=distributed(collective))
        except (Exception, dcp.CheckpointException) as err:  # DCP's exception derives from BaseException
            if rank == 0:
                abandon()
            raise checkpoint_failure(
                err, f"Saving the checkpoint to {location.url!r} failed", rank=rank, unreachable=outage(location)
            ) from err
        try:
            on_rank0(collective, commit)
        except Exception as err:  # storage refused the commit (rename, copy or marker): nothing new is visible
            raise checkpoint_failure(
                err, f"Committing the checkpoint to {location.url!r} failed", rank=0, unreachable=outage(location)
            ) from err
        return Saved(location, "saved", record)

    def writes_in_place(self, location: Location) -> bool:
        """Whether a save writes straight into ``location`` (True) or into a hidden staging directory beside it.

        An existing checkpoint (ours, Lightning's sharded layout, a single file) is only ever replaced once the new
        one is complete: such a save stages. Leftovers of an interrupted save of ours at that name (a directory
        without ``.commit`` or ``meta.pt``) are removed first. A new name on an object store is written in place
        (committed by ``.commit``; staging would cost a server-side copy). A new local name is written in place
        once a committed checkpoint exists beside it, and the directory is created before the save returns: then
        Lightning's ``save_last="link"``, made as soon as an async save returns, always points at an existing
        directory, which the loader passes over for the newest committed one if the save never finished. Before
        the first commit in a directory it stages, so a run killed during its first save has nothing named
        ``last`` and starts fresh. Rank 0 only.
        """
        if location.exists() and location.isdir() and not location.is_committed():
            if not location.is_lightning_sharded():
                location.remove()  # our own interrupted save: never a checkpoint
        if location.exists():
            return False
        if location.local:
            parent = location.parent()
            if parent.url not in self.committed_in and committed_checkpoints(parent):
                self.committed_in.add(parent.url)
            if parent.url not in self.committed_in:
                return False
            os.makedirs(location.path, exist_ok=True)
        return True

    def next_counter(self, location: Location) -> int:
        """The save counter of the next save into ``location``'s directory: one more than any this process saw.

        The first save into a directory reads the counters of its committed checkpoints; when tiered, of both tiers
        as far as the tier knows (no remote call in the training loop:
        :meth:`~lightning_dcp.engine.tiers.durable.DurableCatalog.known`), and the highest of the attached
        :attr:`memory` tier. Later saves count on from there. Rank 0 only.
        """
        directory = location.parent()
        if directory.url not in self.counters:
            found = self.catalog.known(directory)
            held = self.memory.highest if self.memory is not None else 0
            self.counters[directory.url] = max(max((key[0] for key, _ in found), default=0), held)
        self.counters[directory.url] += 1
        return self.counters[directory.url]


def run() -> str:
    """The run this process saves for (:func:`~lightning_dcp.engine.format.marker.run_of`), recorded by every save.

    The run of the checkpoint this process resumed last (:func:`continue_run`), else a new one made at its first
    save: a process that starts fresh begins a run, a process that resumes continues the run it resumed. Rank 0's is
    the one recorded.
    """
    with _RUN_LOCK:
        if _RUN[0] is None:
            _RUN[0] = new_token()
        return _RUN[0]


def continue_run(run_id: str) -> None:
    """Make the saves of this process continue ``run_id`` (the run of a checkpoint it loaded to resume)."""
    with _RUN_LOCK:
        _RUN[0] = run_id


_RUN: list[str | None] = [None]
_RUN_LOCK = threading.Lock()


def check_name_length(path: str, *, url: str) -> None:
    """Refuse a local checkpoint path with a name longer than its filesystem takes (no save could write it).

    Names up to the limit work: the hidden names beside a checkpoint stay within it (``engine.storage.names``).

    Raises:
        InvalidPathError: A component of ``path`` is longer than the filesystem's limit (255 bytes on ext4).
    """
    limit = name_limit(os.path.dirname(os.path.abspath(path)))
    part = too_long(path, limit=limit)
    if part is not None:
        shown = part if len(part) <= 60 else f"{part[:40]}...{part[-12:]}"
        raise InvalidPathError(
            f"The checkpoint path {url!r} has a name of {len(part.encode('utf-8', 'surrogateescape'))} bytes"
            f" ({shown!r}); its filesystem takes at most {limit} bytes per name, so no save (Lightning's own"
            " included) can write it. Shorten the name: `filename` of the ModelCheckpoint, or the path given."
        )


def outage(location: Location):
    """How failures of a save to ``location`` are told to be outages (remote stores only)."""
    return None if location.local else is_unreachable


def versions() -> dict[str, str]:
    """What wrote a save, recorded in it: the torch, Lightning and lightning_dcp versions, and the commit of the code.

    ``lightning_dcp_commit`` is the git commit of the lightning_dcp code that ran (with ``-dirty`` for uncommitted
    changes), where known (``lightning_dcp._compat.package_version``); absent otherwise.
    """
    try:
        lightning_version = importlib.metadata.version("lightning")
    except importlib.metadata.PackageNotFoundError:  # only pytorch-lightning installed
        lightning_version = importlib.metadata.version("pytorch-lightning")
    recorded = {
        "torch_version": str(torch.__version__),
        "lightning_version": lightning_version,
        "lightning_dcp_version": package_version.version(),
    }
    commit = package_version.commit_id()
    if commit is not None:
        recorded["lightning_dcp_commit"] = commit
    return recorded
