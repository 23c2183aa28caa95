"""The Checkpointer's save transaction: where a save writes, the write, the commit or the clean-up, the save counter.

Every function takes the checkpointer whose state it uses and updates (its options, tiers, async saves, records).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_dcp._compat import package_version
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.lookup import LIGHTNING_META_FILE
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.save import saving
from lightning_dcp.engine.save.dcp_io import save_planner, storage_writer
from lightning_dcp.engine.save_log import SaveRecord
from lightning_dcp.engine.storage.localfs import SNAPSHOT_PREFIX, STAGING_INFIX, is_internal_name
from lightning_dcp.engine.storage.location import Location, fsync_dir, new_token
from lightning_dcp.engine.storage.names import name_limit, too_long
from lightning_dcp.engine.storage.stores import is_unreachable
from lightning_dcp.engine.tiers import memory_io
from lightning_dcp.errors import InvalidPathError, checkpoint_failure

__all__ = [
    "check_name_length",
    "continue_run",
    "next_counter",
    "outage",
    "run",
    "save",
    "versions",
    "writes_in_place",
]

log = logging.getLogger("lightning_dcp.engine.checkpointer")  # the checkpointer's log: filters name it


def save(
    cp: Any,
    tree: dict[str, Any],
    path: str | os.PathLike,
    objects: dict[str, Any] | None,
    rank_objects: dict[str, Any] | None,
    info: dict[str, Any] | None,
    storage_options: dict[str, Any] | None,
    collective: bool,
    volatile: Iterable[torch.Tensor] | None,
    step: int | None,
    from_rank0: Iterable[tuple[str, ...]] = (),
) -> None:
    """The save of :meth:`~lightning_dcp.engine.checkpointer.Checkpointer.save`: write, then commit or clean up.

    Where it writes, the write (sync, or handed to the async saves), the commit or the clean-up; see there.
    """
    started = time.perf_counter()
    location = cp.location(path, storage_options)
    cp._record_of = None
    if cp._into_memory:
        if rank_and_world(collective)[0] == 0:
            cp._record_of = cp.saves.begin(location.url, step=step, tier="memory", started=started)
        memory_io.save_to_memory(
            cp,
            tree,
            location,
            objects=objects,
            rank_objects=rank_objects,
            info={**(info or {}), **versions()},
            collective=collective,
            step=step,
            from_rank0=from_rank0,
        )
        return
    if is_internal_name(location.name):
        raise InvalidPathError(
            f"The checkpoint name of {location.url!r} is one this library gives its own staging and upload"
            f" directories ('.<name>{STAGING_INFIX}<token>', '{SNAPSHOT_PREFIX}...'): listings pass over them and"
            " clean-ups delete them. Choose another name."
        )
    remote = location if cp.tiers is not None and cp.tiers.covers(location) else None
    if remote is not None:  # tiered: written and committed locally, uploaded to `remote` once committed
        location = cp.tiers.local_twin(remote)
    if location.local:
        check_name_length(location.path, url=location.url)
    rank, world_size = rank_and_world(collective)
    if rank == 0:
        tier = "durable" if remote is None else "local_dir"
        cp._record_of = cp.saves.begin(
            location.url, step=step, tier=tier, started=started, background=cp._async is not None
        )
    record = cp._record_of

    def decide() -> tuple[str, bool, Any, int, str]:  # rank 0 decides where this save writes; all ranks must agree
        if remote is not None:
            cp.tiers.prepare(remote)
        previous = cp.incremental and cp.incremental.previous(location)
        return new_token(), writes_in_place(cp, location), previous, next_counter(cp, remote or location), run()

    try:
        token, direct, previous, counter, run_id = on_rank0(collective, decide)
    except Exception as err:  # storage refused even the preparation (a read-only mount): nothing was written
        raise checkpoint_failure(
            err, f"Saving the checkpoint to {location.url!r} failed", rank=0, unreachable=outage(location)
        ) from err
    target = location if direct else location.staging(token)
    info = {**(info or {}), "world_size": world_size, "run": run_id, **versions()}

    def commit() -> None:  # rank 0, once every rank finished writing
        if not direct:
            location.commit_from(target)
        elif location.local:  # the marker's directory entry, and the directory's own, survive a power loss
            fsync_dir(location.path)
            fsync_dir(location.parent().path)
        cp._committed_in.add(location.parent().url)
        location.remove_stale_staging(keep=None if direct else token)
        if remote is not None:
            cp.tiers.committed(remote)
        if record is not None:
            cp.saves.committed(record, sizes=location.sizes)
            line = cp.saves.announce(record)  # async: here in the background thread, if the call returned
            if line is not None:
                log.info(line)

    def abandon() -> None:  # rank 0, after a failure: nothing half-written stays visible
        if remote is not None:
            cp.tiers.abandoned(remote)
        if not (direct and location.local and cp._async is not None):
            target.remove()
            return
        # An async save returned before it failed: Lightning may have linked `last` to this directory already.
        # Keep the (uncommitted, so never loaded) directory so that link never dangles; free its data.
        for name, _ in target.entries(follow_links=False):
            target.child(name).remove()

    def settle(record: SaveRecord) -> None:  # rank 0, on the caller's thread: the async save is over
        cp.saves.settled(record)
        line = cp.saves.announce(record)
        if line is not None:
            log.info(line)

    writer = storage_writer(target, thread_count=cp.thread_count, sync_files=cp.sync_files)
    writer.order = {
        "counter": counter,
        "step": step if isinstance(step, int) and step >= 0 else None,
        "run": run_id,
    }
    planner = save_planner(writers=world_size * cp.thread_count)
    if cp.incremental is not None:
        cp.incremental.attach(writer, previous=previous, local=location.local)
    try:
        state = layout.build_state(
            tree,
            objects=objects if rank == 0 else None,
            info=info,
            rank=rank,
            rank_objects=rank_objects,
            from_rank0=from_rank0,
        )
        if cp._async is not None:
            cp._async.start(
                state,
                writer=writer,
                planner=planner,
                location=location,
                rank=rank,
                distributed=distributed(collective),
                commit=commit,
                abandon=abandon,
                volatile=volatile,
                charge=None if record is None else lambda seconds: cp.saves.waited(record, seconds),
                settle=None if record is None else lambda: settle(record),
            )
            cp._record(started, location, "staged (writing in the background)")
            for held in cp._busy.started(location, step=step):  # removals held behind a skipped save
                cp.remove(held.url, collective=collective)
            return
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
    cp._record(started, location, "saved")


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


def writes_in_place(cp: Any, location: Location) -> bool:
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
        if not location.fs.exists(location.join(LIGHTNING_META_FILE)):
            location.remove()  # our own interrupted save: never a checkpoint
    if location.exists():
        return False
    if location.local:
        if not _has_committed_sibling(cp, location):
            return False
        os.makedirs(location.path, exist_ok=True)
    return True


def next_counter(cp: Any, location: Location) -> int:
    """The save counter of the next save into ``location``'s directory: one more than any this process saw.

    The first save into a directory reads the counters of its committed checkpoints; when tiered, of both tiers
    as far as the tier knows (no remote call in the training loop:
    :meth:`~lightning_dcp.engine.tiers.local.Tiers.known_checkpoints`). Later saves count on from there. Rank 0 only.
    """
    directory = location.parent()
    if directory.url not in cp._counters:
        tiered = cp.tiers is not None and cp.tiers.covers(location)
        found = cp.tiers.known_checkpoints(directory) if tiered else committed_checkpoints(directory)
        cp._counters[directory.url] = max((key[0] for key, _ in found), default=0)
        if cp.memory is not None:  # what the memory areas hold counts too (a resume from memory saves on)
            cp._counters[directory.url] = max(cp._counters[directory.url], cp.memory.highest)
    cp._counters[directory.url] += 1
    return cp._counters[directory.url]


def _has_committed_sibling(cp: Any, location: Location) -> bool:
    parent = location.parent()
    if parent.url not in cp._committed_in and committed_checkpoints(parent):
        cp._committed_in.add(parent.url)
    return parent.url in cp._committed_in


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
