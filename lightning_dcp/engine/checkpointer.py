"""``Checkpointer``: the engine's verbs. Save, load and remove a DCP checkpoint of a state tree on any storage.

A front end (the Trainer's ``DCPCheckpointIO``, the Fabric strategies) turns its users' state into three parts and
hands them here (see :mod:`lightning_dcp.engine.format.layout`):

- the *tree*: top-level keys mapping to nested state dicts of tensors (DTensor shards included) and small leaves,
  written by DCP with every rank writing its part;
- the *objects*: everything else, one ``weights_only``-safe blob written by rank 0;
- the *rank objects*: each rank's own blob (its RNG states).

The save writes into a fresh directory (or a hidden staging directory beside an existing checkpoint) and commits it
once every rank finished; loads reshard to the current world size and verify every record they read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_dcp.engine import shutdown, transaction
from lightning_dcp.engine.agreement import first_failure
from lightning_dcp.engine.catalog.metadata import parsed_meanwhile_forgotten
from lightning_dcp.engine.config import CheckpointerConfig
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.format.marker import is_run_token
from lightning_dcp.engine.gc_pause import gc_paused
from lightning_dcp.engine.load import page_cache
from lightning_dcp.engine.load.candidates import load_first
from lightning_dcp.engine.load.loading import Probe
from lightning_dcp.engine.load.restore import Loaded, load_one
from lightning_dcp.engine.save.async_save import AsyncSaves
from lightning_dcp.engine.save.incremental import Incremental
from lightning_dcp.engine.save.when_busy import WhenBusy
from lightning_dcp.engine.save_log import SaveLog, SaveRecord
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import DurableCatalog, Tiers
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.engine.tiers.memory_io import MemoryRoute
from lightning_dcp.engine.transaction import SaveTransaction
from lightning_dcp.errors import (
    CheckpointError,
)

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)


class Checkpointer:
    """Save, load and remove committed, checksummed DCP checkpoints; the engine under both front ends.

    Args:
        config: The options (:class:`~lightning_dcp.engine.config.CheckpointerConfig`, each described there, checked
            when it was made); ``None``: the defaults. The front ends build one from their keyword arguments. The
            parts this object holds are made from it here: the when-busy policy, the async saves, the incremental
            state, the local tier (``local_dir``), the durable catalog, the save log and the save transaction.
    """

    def __init__(self, config: CheckpointerConfig | None = None) -> None:
        config = CheckpointerConfig() if config is None else config
        self.config = config
        """The options this checkpointer was made with."""
        self.storage_options = dict(config.storage_options or {})
        self.thread_count = config.thread_count
        self.sync_files = config.sync_files
        self.async_save = config.async_save
        tiers = None
        if config.local_dir is not None:
            tiers = Tiers(config.local_dir, keep=config.local_keep, storage_options=config.storage_options)
        self._busy = WhenBusy(config.when_busy)
        # Under "skip" a step never waits for a live writer (the storage): see when_busy.
        self._async = (
            AsyncSaves(defer=config.defer_staging, steps_wait_for_writer=config.when_busy != "skip")
            if config.async_save
            else None
        )
        self.last_save_seconds: float | None = None
        """Seconds the last :meth:`save` took for its own save, on this rank: without a wait in it for the previous
        async save, and without the waits after an async call (its record's ``blocked_s`` counts them all)."""
        self.incremental = Incremental() if config.incremental else None
        """The incremental state (its ``stats`` describe the last save), ``None`` when off."""
        self.tiers = tiers
        self.catalog = DurableCatalog(tiers)
        """Which committed checkpoints a directory holds on the durable tiers, newest first (rank 0)."""
        self.saves = SaveLog()
        """Rank 0's records of recent saves and the last restore, for the front ends' logger metrics."""
        self._transaction = SaveTransaction(
            saves=self.saves,
            thread_count=config.thread_count,
            sync_files=config.sync_files,
            async_saves=self._async,
            tiers=tiers,
            catalog=self.catalog,
            incremental=self.incremental,
        )
        self.memory_route: MemoryRoute | None = None
        """The route to the memory tier (its saves, ``last`` across every tier); ``None`` without a memory tier."""
        if config.memory is not None:
            self.attach_memory(config.memory)
        self._prefetched: str | None = None  # the directory prefetch() started reading, until the next load
        self._into_memory = False
        self._call_began: float | None = None  # when the save being made began, less its wait for the previous one
        self._disagreed: set[tuple[str, str]] = set()  # (this rank's path, rank 0's) already warned about
        # At exit, the save in flight, then the uploads (a script may end without waiting, or drop this object):
        # each part that owns the work finishes it, as long as it lives (the save in flight keeps its own alive).
        if self._async is not None:
            shutdown.on_exit("work", AsyncSaves.finish_at_exit, owner=self._async)
        if tiers is not None:
            shutdown.on_exit("work", Tiers.finish_at_exit, owner=tiers)

    @property
    def memory(self) -> MemoryTier | None:
        """The memory tier of :meth:`into_memory` (``None``: none)."""
        return None if self.memory_route is None else self.memory_route.tier

    def attach_memory(self, tier: MemoryTier) -> MemoryRoute:
        """Route saves inside :meth:`into_memory` to ``tier``, and ``last`` loads across it; returns the route.

        The Trainer's :class:`~lightning_dcp.trainer.memory.MemoryCheckpoint` attaches its tier at ``setup``; a
        config's ``memory`` is attached when the checkpointer is made. Any rank; every rank attaches its own.
        """
        if self.memory_route is None or self.memory_route.tier is not tier:
            self.memory_route = MemoryRoute(tier, catalog=self.catalog)
            self._transaction.memory = tier  # saves count on above what memory holds
        return self.memory_route

    @contextlib.contextmanager
    def into_memory(self) -> Iterator[None]:
        """Saves made inside go to the memory tier (a no-op without one). Use around one collective save."""
        self._into_memory = self.memory is not None
        try:
            yield
        finally:
            self._into_memory = False

    @property
    def when_busy(self) -> str:
        """What an async save called while the previous one is being written does: ``"wait"`` or ``"skip"``."""
        return self._busy.policy

    @property
    def skipped(self) -> list[tuple[int | None, str]]:
        """``(step, url)`` of each save skipped under ``when_busy="skip"``, oldest first (on every rank)."""
        return list(self._busy.skipped)

    @property
    def last_step_wait(self) -> float | None:
        """Seconds optimizer steps waited for the background staging copies of the last async save (after ``wait``)."""
        return None if self._async is None else self._async.last_step_wait

    def finished_saves(self) -> list[SaveRecord]:
        """Rank 0's records of the saves that are over, oldest first, taken from :attr:`saves` (others: ``[]``).

        A save is over once committed and, for an async save, once its background work is seen finished here (the
        removals queued behind it may still run): its ``blocked_s`` then holds every wait of the loop for it (see
        :class:`~lightning_dcp.engine.save_log.SaveRecord`). Call on the training loop's thread (the front ends'
        metrics do). Not collective.
        """
        if self._async is not None:
            self._async.collect()
        return self.saves.drain()

    def location(self, path: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Location:
        """``path`` with this checkpointer's storage options (and ``storage_options`` merged on top)."""
        return Location(path, storage_options={**self.storage_options, **(storage_options or {})})

    # ----------------------------------------------------------------------------------------------- save
    def save(
        self,
        tree: dict[str, Any],
        path: str | os.PathLike,
        *,
        objects: dict[str, Any] | None = None,
        rank_objects: dict[str, Any] | None = None,
        info: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        collective: bool = False,
        volatile: Iterable[torch.Tensor] | None = None,
        step: int | None = None,
        from_rank0: Iterable[tuple[str, ...]] = (),
    ) -> None:
        """Write ``tree`` (and the blobs) as a DCP directory at ``path`` and commit it.

        Args:
            tree: Top-level keys to nested state dicts of tensors; not modified, tensors are not copied (sync).
            path: Target directory, a local path or fsspec URL. An existing checkpoint there is replaced only once
                the new one is complete.
            objects: Rank 0's non-tensor state (ignored on other ranks), written as one ``weights_only``-safe blob.
            rank_objects: This rank's own state, written by this rank.
            info: Facts recorded in the blob's ``"lightning_dcp"`` entry, beside the world size and versions.
            storage_options: fsspec options for this call, merged over the checkpointer's.
            collective: ``True`` when every rank calls this; ``False`` when one process writes everything.
            volatile: Async saves with ``defer_staging``: the tensors of ``tree`` that may change in place before the
                next optimizer step (module buffers, values that are not a module's or an optimizer's); they are
                staged before this returns, the other CPU tensors in the background. ``None``: everything is staged
                before this returns.
            step: The training step (Lightning's ``global_step``), recorded in ``.commit`` beside the directory's save
                counter: together they order the checkpoints of a directory (``ckpt_path="last"``), never a clock.
            from_rank0: Paths in ``tree`` of replicated values that may differ between ranks (module buffers): rank
                0's copy is written (:func:`~lightning_dcp.engine.format.layout.build_state`). Replicated values of
                other paths are written once, spread over the ranks that hold them, as long as the ranks' non-tensor
                values agree; where those differ (a learning rate set by a per-rank scheduler) rank 0 writes every
                replicated value (:func:`~lightning_dcp.engine.save.saving.prepare`).

        Collective: call on all ranks when ``collective=True``; otherwise on one process only.

        Raises:
            InvalidPathError: The checkpoint's name is one of this library's own hidden names (staging, upload
                snapshots), or the path cannot round-trip through its store.
            CheckpointError: Writing failed on some rank (the message names it); nothing was committed.
        """
        called = time.perf_counter()
        path = self._agreed(path, collective, "saves to")
        if not self._into_memory and self._skip(path, storage_options, collective, step, called):
            return
        waited = self._await_pending(collective)  # the previous save's wait, counted on its record
        self._call_began = called + waited
        parts = layout.SaveParts(tree, objects, rank_objects, info, from_rank0)
        location = self.location(path, storage_options)
        started = time.perf_counter()
        with gc_paused():  # thousands of short-lived objects (see gc_pause)
            if self._into_memory:
                record = None
                if rank_and_world(collective)[0] == 0:
                    record = self.saves.begin(location.url, step=step, tier="memory", started=started)
                versioned = dataclasses.replace(parts, info={**(parts.info or {}), **transaction.versions()})
                route = self.memory_route
                route.prepare(location, collective=collective)
                counter, run = on_rank0(  # rank 0's, for every rank
                    collective, lambda: (self._transaction.next_counter(location), route.run_token())
                )
                route.save(versioned, location, counter=counter, run=run, collective=collective, step=step)
                self._record(started, location, "saved to the memory tier", record)
                return
            saved = self._transaction.save(
                parts, location, collective=collective, volatile=volatile, step=step, started=started
            )
            self._record(started, saved.location, saved.what, saved.record)
            if saved.background:
                for held in self._busy.started(saved.location, step=step):  # removals held behind a skipped save
                    self.remove(held.url, collective=collective)

    def _agreed(self, path: str | os.PathLike, collective: bool, what: str) -> str:
        """Rank 0's ``path`` on every rank: a collective save or removal writes where rank 0 says.

        Lightning's stock strategies write rank 0's name; a metric logged without ``sync_dist`` in
        ``ModelCheckpoint``'s ``filename`` formats another name on each rank. A rank whose own path differs warns,
        once per pair of paths. A save into the memory tier agrees on the checkpoint's name only: its persisted
        copies may go to node-local directories that differ by node.

        Collective: call on all ranks when ``collective`` (one broadcast of the path).
        """
        mine = os.fspath(path)
        if not distributed(collective):
            return mine
        if self._into_memory:  # node-local directories may differ by node: only the checkpoint's name must agree
            head, _, name = mine.rstrip("/").rpartition("/")
            chosen_name = on_rank0(collective, lambda: name)
            chosen = f"{head}/{chosen_name}" if head else chosen_name
        else:
            chosen = on_rank0(collective, lambda: mine)
        if chosen != mine and (mine, chosen) not in self._disagreed:
            self._disagreed.add((mine, chosen))
            warnings.warn(
                f"lightning_dcp: rank {dist.get_rank()} {what} {mine!r}, rank 0 {what} {chosen!r}; every rank uses"
                " rank 0's path, as Lightning saves rank 0's. Ranks format different checkpoint names when"
                " `ModelCheckpoint(filename=...)` holds a metric logged without `sync_dist=True`: log it with"
                " `self.log(..., sync_dist=True)` so that names and top-k choices agree.",
                stacklevel=3,
            )
        return chosen

    def _skip(
        self, path: Any, storage_options: dict[str, Any] | None, collective: bool, step: int | None, called: float
    ) -> bool:
        """``when_busy="skip"``: whether this save is skipped (the previous one still writing); records the stall.

        The call of a skipped save (the vote) is a wait of the loop for the save in flight: counted on its record.
        """
        inflight = self._async.current if self._async is not None else None
        if self._busy.policy != "skip" or inflight is None:
            return False
        location = self.location(path, storage_options)
        if not self._busy.skip(self._async, location, step=step, collective=collective):
            return False
        self.last_save_seconds = time.perf_counter() - called
        inflight.waited(self.last_save_seconds)
        log.debug("lightning_dcp: checkpoint to %s skipped (the previous save is still being written)", location.url)
        return True

    def resumable(self, *, collective: bool = False) -> bool:
        """Whether the memory tier or its durable directory holds a committed checkpoint (``True`` without a tier).

        Collective: call on all ranks when ``collective=True``.
        """
        return self.memory_route is None or self.memory_route.anything(collective=collective)

    def _record(self, started: float, location: Location, what: str, record: SaveRecord | None) -> None:
        """Record a save's stall (:attr:`last_save_seconds`) on rank 0's ``record`` and log it."""
        now = time.perf_counter()
        self.last_save_seconds = now - started
        began, self._call_began = self._call_began, None
        if record is None:  # not rank 0: one line per save, not per rank
            return
        self.saves.returned(record, call_s=None if began is None else now - began)
        if record.tier == "memory":
            self.saves.committed(record)
        line = self.saves.announce(record)
        if line is not None:
            log.info(line)
        else:
            log.debug("lightning_dcp: checkpoint %s to %s in %.3f s", what, location.url, self.last_save_seconds)

    # ----------------------------------------------------------------------------------------------- load
    def load(
        self,
        path: str | os.PathLike,
        *,
        target: dict[str, Any] | None = None,
        strict: bool = True,
        collective: bool = False,
        weights_only: bool = True,
        only: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        map_location: Any | None = None,
        model_key: str = layout.MODEL_KEY,
        objects_only: bool = False,
        checked: Probe | None = None,
    ) -> Loaded:
        """Load the checkpoint at ``path``: a lightning_dcp directory, Lightning's sharded layout or one file.

        Args:
            path: Checkpoint directory or file, local path or fsspec URL.
            target: The tree to fill in place (from ``get_state_dict``: this rank's shards, resharding to the
                current world size). ``None`` loads every tensor into CPU memory.
            strict: Require the checkpoint's model keys to equal the target's (see ``StateDictMismatchError``).
            collective: ``True`` when every rank calls this with its own target.
            weights_only: Restrict unpickling of non-tensor state to safe types.
            only: With a target, read these top-level keys only and no blobs (``None``: everything).
            exclude: Glob patterns of model FQNs neither loaded nor reported as unexpected (with a target).
            map_location: Passed to ``torch.load`` for single-file checkpoints.
            model_key: The top-level key whose FQNs ``strict`` and ``exclude`` apply to and the report names
                (``"state_dict"``: the Trainer's; a Fabric checkpoint names its modules by their state keys).
            objects_only: With ``target={}``: read the non-tensor state (``objects``, ``rank_objects``) and no
                tensor at all (otherwise the saved state dicts the target does not name load as new CPU tensors).
            checked: What :func:`~lightning_dcp.engine.load.loading.probe` found at ``path`` when the caller probed it
                itself (rank 0's, broadcast to every rank; with its ``metadata``): the checkpoint it names is loaded
                as found, without resolving or checking it again. Fabric's ``load_state`` probes once, then loads
                parts of the checkpoint with it.

        A checkpoint named like ``ModelCheckpoint``'s last one (``last.ckpt``, ``last-v1.ckpt``) that is incomplete
        or corrupt falls back to the newest valid checkpoint in the same directory, with a warning naming both.

        Collective: call on all ranks when ``collective=True``.

        Raises:
            CheckpointNotFoundError: Nothing exists at ``path``.
            NotACheckpointError: ``path`` is not a readable checkpoint (or an incomplete save).
            StateDictMismatchError: Keys, shapes or dtypes differ from the target; nothing was loaded.
            CheckpointError: Non-tensor state that ``weights_only`` refuses.
        """
        self._await_pending(collective)
        location = self.location(path)
        options = dict(
            target=target,
            strict=strict,
            weights_only=weights_only,
            only=only,
            exclude=exclude,
            map_location=map_location,
            model_key=model_key,
            objects_only=objects_only,
        )
        with parsed_meanwhile_forgotten():  # the parsed metadata dies with the collector paused
            if checked is not None:
                loaded = load_one(location.at(checked.url), collective=collective, checked=checked, **options)
            elif self.memory_route is not None and self.memory_route.covers(location):
                loaded = self.memory_route.load_newest(location, collective=collective, **options)
                if loaded is None:  # the durable tiers hold the newest (or the memory tier nothing loadable)
                    durable = self.memory_route.durable_candidates(location)
                    loaded = self.load_candidates(durable, collective=collective, **options)
                    loaded.tier = "durable"
            else:
                loaded = self.load_candidates(location, collective=collective, **options)
        run = (loaded.objects.get(layout.INFO_KEY) or {}).get("run") if isinstance(loaded.objects, dict) else None
        if isinstance(run, str) and is_run_token(run) and not objects_only:
            transaction.continue_run(run)  # a resume continues the run it resumed
        return loaded

    def prefetch(self, path: str | os.PathLike) -> bool:
        """Start reading the local checkpoint directory ``path`` into the page cache in a background thread.

        For a restore that reads every byte of the checkpoint on every rank (DDP, one device): call it before
        building the load's target, so the disk reads while the target is built and the checkpoint is probed
        (:func:`~lightning_dcp.engine.load.page_cache.prefetch`). Not for sharded restores (FSDP, tensor parallel),
        where each rank needs a part of the files.

        Any rank. Never raises: a path that is not a local checkpoint directory (a store, the memory tier, a file,
        a pointer) starts nothing, and what is wrong with it is for the load to report.

        Returns:
            Whether a thread started: ``False`` also when this Checkpointer started one for ``path`` since its last
            load (the Trainer's strategies start it at ``setup`` and again in ``load_checkpoint``).
        """
        try:
            location = self.location(path)
            if not location.local or (self.memory_route is not None and self.memory_route.covers(location)):
                return False
            if self._prefetched == os.path.realpath(location.path):  # started for the coming load already
                return False
            started = page_cache.prefetch(location.path)
        except Exception:  # the load reports it
            return False
        if started:  # the load of this path starts no prefetch of its own
            self._prefetched = os.path.realpath(location.path)
        return started

    def load_candidates(self, location: Location, *, collective: bool, **options: Any) -> Loaded:
        """Load the first loadable of the durable checkpoints ``location`` designates (see :meth:`load`).

        Collective: call on all ranks when ``collective=True``.
        """
        urls = on_rank0(collective, lambda: self.catalog.candidates(location))
        prefetched, self._prefetched = self._prefetched, None
        candidates = [self.location(url) for url in urls]  # read with this checkpointer's storage options
        return load_first(location, candidates, prefetched=prefetched, collective=collective, **options)

    # --------------------------------------------------------------------------------------------- remove
    def remove(self, path: str | os.PathLike, *, collective: bool = False) -> None:
        """Delete the checkpoint at ``path`` (and any staging left by an interrupted save to it) once.

        A removal of another checkpoint while a background save is in flight runs after that save commits, so a
        checkpoint is never deleted before its successor exists. With ``tiers``, a remote path is removed from both
        tiers by the uploader, after the uploads queued before it (:meth:`Tiers.remove`).

        Collective: call on all ranks when ``collective=True``; rank 0 deletes, the others wait for it. Rank 0's
        ``path`` is the one removed (as for :meth:`save`).
        """
        location = self.location(self._agreed(path, collective, "removes"))
        if self._busy.hold(location):  # a save was skipped: nothing is removed before a newer save commits
            return
        in_flight = self._async.in_flight if self._async is not None else None
        if self.tiers is not None and self.tiers.covers(location):  # both tiers, behind the uploads queued before
            if in_flight is not None and in_flight.url == self.tiers.local_twin(location).url:
                self._await_pending(collective)
                in_flight = None
            on_rank0(collective, lambda: self.tiers.remove(location, after_save=in_flight is not None))
            return
        if in_flight is not None and in_flight.url == location.url:
            self._await_pending(collective)  # removing the checkpoint being written: let it finish first
        elif in_flight is not None:
            if rank_and_world(collective)[0] == 0 and not self._async.defer_removal(location):
                location.remove()
            return

        def remove() -> None:
            location.remove()
            location.remove_stale_staging()

        on_rank0(collective, remove)

    # --------------------------------------------------------------------------------------------- async
    def wait(self, *, collective: bool = False) -> None:
        """Block until the background save in flight (if any) is committed.

        Collective: call on all ranks when ``collective=True``; then every rank raises if any rank's part failed.

        Raises:
            CheckpointError: The background save failed (naming the rank and the path); it was not committed.
        """
        self._await_pending(collective)

    def wait_for_staging(self) -> None:
        """Block until the staging copies of the async save in flight are made (not its write). Not collective.

        Call before code that changes tensors in place outside an optimizer step (optimizer steps wait on their own).
        """
        if self._async is not None:
            self._async.wait_for_staging()

    def give_up(self, *, after: float) -> bool:
        """After a failed run: give the memory tier's save in flight ``after`` seconds, then leave it unfinished.

        See :meth:`~lightning_dcp.engine.tiers.memory.MemoryTier.give_up`. Returns whether a save was left.
        """
        return self.memory.give_up(after=after) if self.memory is not None else False

    def close(self) -> None:
        """Wait for the background save in flight (if any), release the staging buffers, then wait for the uploads.

        Raises:
            CheckpointError: The background save failed (it was not committed), or uploads of the local tier failed
                (those checkpoints stay committed locally).
        """
        try:
            if self.memory is not None:
                self.memory.close()
        finally:
            try:
                if self._async is not None:
                    self._async.close()
            finally:
                if self.tiers is not None:
                    self.tiers.wait()

    def _await_pending(self, collective: bool) -> float:
        """Wait for the async save in flight (and the memory tier's); the seconds waited for the former.

        Those seconds (the wait and the gathering of the ranks' errors) are a wait of the loop for that save: they
        are counted on its record (``charge``), which is settled once the save is finished.
        """
        if self.memory is not None:
            self.memory.wait()
        inflight = self._async.current if self._async is not None else None
        if inflight is None:
            return 0.0
        started = time.perf_counter()
        error: CheckpointError | None = None
        try:
            try:
                self._async.wait()
            except CheckpointError as err:
                error = err
            lowest = first_failure(error, collective)  # collective on every rank, whatever this rank saw
            error = error or lowest  # this rank's own, else the lowest failing rank's
        finally:
            waited = time.perf_counter() - started
            inflight.waited(waited)
            self._async.collect()
        if error is not None:
            raise error
        return waited


# --------------------------------------------------------------------------------------------------- helpers
