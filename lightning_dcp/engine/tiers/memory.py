"""The memory tier: checkpoints in host shared memory, one area per node, replicated to peer nodes.

A save (collective: every rank calls :meth:`MemoryTier.save`) runs in these steps, over the tier's own gloo group:

1. rank 0 picks a token (and whether this save is persisted); each node's leader takes a staging directory in its
   area (a free slot when there is one: its files and pages are reused);
2. planning (:func:`lightning_dcp.engine.save.saving.prepare`); with ``async_save`` the call returns here, objects and
   small tensors copied, large tensors copied in the background while optimizer steps wait for them;
3. each rank copies its records into its mapped data file (:mod:`~lightning_dcp.engine.tiers.shm_writer`); a
   synchronous save copies them in the call and returns once they are copied (the stall is the copy), an async one
   in the background;
4. in the background: each rank hashes its records where they lie in its file (xxHash3-64, as every writer of this
   library records in ``.commit``); the coordinator writes ``.metadata`` and
   makes the ``.commit`` marker, which every node receives; each node's leader commits its part
   (:class:`~lightning_dcp.engine.tiers.parts.PartStore`): the checkpoint is committed in memory once every node did;
5. in the background: every part is copied to ``replicas`` other nodes and committed there once whole
   (:mod:`~lightning_dcp.engine.tiers.replication`); older parts are evicted; every ``persist_every``-th checkpoint
   (or the first after ``persist_every_seconds``) is persisted to the durable tiers
   (:mod:`~lightning_dcp.engine.tiers.persist`). :meth:`MemoryTier.wait` returns after this step.

At most one save is in flight; the next save, :meth:`MemoryTier.wait`, a load and :meth:`MemoryTier.close` wait for it
and raise its error. :meth:`MemoryTier.close` (the strategy's teardown, or at interpreter exit) then leaves the tier's
gloo group in a defined order (:func:`~lightning_dcp.engine.tiers.nodes.leave`).
Restores are in :mod:`~lightning_dcp.engine.tiers.recovery`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_dcp.engine.save import saving
from lightning_dcp.engine.save.dcp_io import save_planner
from lightning_dcp.engine.save.step_gate import STEP_GATE
from lightning_dcp.engine.storage.localfs import new_token, remove_path
from lightning_dcp.engine.tiers.nodes import Topology, discover, leave, single_process
from lightning_dcp.engine.tiers.parts import Part, PartStore
from lightning_dcp.engine.tiers.replication import replicate
from lightning_dcp.engine.tiers.saves import Captured, InFlight, Saved
from lightning_dcp.engine.tiers.shm_writer import Mappings, ShmWriter
from lightning_dcp.errors import CheckpointError, StorageAccessError, checkpoint_failure

__all__ = ["LAST_ENTRY", "MemoryTier", "Saved", "area_error"]

LAST_ENTRY = "last"
"""A file in every memory area that designates "the newest checkpoint across the tiers" (``ckpt_path="last"``)."""

log = logging.getLogger(__name__)

Persister = Callable[["Saved", Part], None]


class MemoryTier:
    """Checkpoints in a node-local shared-memory area, replicated to ``replicas`` other nodes.

    Args:
        memory_dir: A directory on a tmpfs (``/dev/shm/...``, or a tmpfs the user mounts), one per node; created
            when needed. It outlives the training processes (a crash or ``kill -9`` of the whole job keeps it) and
            goes with the machine (a reboot or a lost node).
        replicas: K, the other nodes that hold a copy of each node's part; losing K nodes loses nothing committed
            in memory. 0 keeps a node's part on that node only.
        keep: Checkpoints kept in memory (the newest); older ones are evicted once a newer one is committed and
            replicated.
        persist_every: Persist every this-many-th memory checkpoint to the durable tiers (``0``: never on a count).
        persist_every_seconds: Also persist the first checkpoint saved this many seconds after the last persisted
            one (``None``: no time schedule).
        async_save: Return from a save once it is planned; copies are made in the background (optimizer steps wait for
            them). ``False``: return once this rank's state is copied into the memory area; the checkpoint is committed
            there behind the call (checksums of the copies, ~55 ms per GiB here; the marker), then replicated. A failure
            after planning is raised by the next save or [`MemoryTier.wait`][lightning_dcp.MemoryTier.wait] either way.
            Either way, [`MemoryTier.wait`][lightning_dcp.MemoryTier.wait] returns once it is committed and replicated.

    Memory per node: ``(keep + 1) x (1 + replicas) x`` the node's part of a checkpoint (a part of the newest, one
    being written, and as much again for the replicas of other nodes' parts).

    Raises:
        ValueError: A count that is not a non-negative integer (``keep`` positive).
    """

    def __init__(
        self,
        memory_dir: str | os.PathLike,
        *,
        replicas: int = 1,
        keep: int = 1,
        persist_every: int = 10,
        persist_every_seconds: float | None = None,
        async_save: bool = True,
    ) -> None:
        for label, value, least in (("replicas", replicas, 0), ("keep", keep, 1), ("persist_every", persist_every, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"`{label}` must be an integer >= {least}, got {value!r}.")
        self.memory_dir = os.path.abspath(os.fspath(memory_dir))
        self.replicas, self.keep, self.async_save = replicas, keep, async_save
        self.persist_every, self.persist_every_seconds = persist_every, persist_every_seconds
        self.store = PartStore(self.memory_dir, create=False)  # the area is made at `setup`
        self.mappings = Mappings()
        self.topology: Topology | None = None
        self.group: dist.ProcessGroup | None = None
        self.distributed = False
        self.highest = 0
        """The largest save counter of any checkpoint in the areas when the tier was set up, raised to the largest on
        node-local disks by the recovery (``engine/tiers/recovery.py``)."""
        self.run: str | None = None
        """The token of the run whose parts this tier saves and restores (``engine/tiers/runs.py``;
        set by the checkpointer from the durable directory, ``None`` while it holds none)."""
        self.run_known = False  # whether ``run`` was resolved from the durable directory (once per tier)
        self.warned_foreign, self.origin = False, ""  # origin: where the last restore's copy came from, in words
        self.persister: Persister | None = None
        """Copies a checkpoint to the durable tiers (set by the checkpointer). Collective over ``group``."""
        self.saved: list[Saved] = []
        """Checkpoints committed in memory by this run, oldest first (the newest ``keep``)."""
        self.timings: dict[str, float] = {}
        """Seconds of each step of the last save: ``stage`` (a synchronous save's planning and copy, in the call),
        ``write`` (from the call's planning to the commit), ``replicate``, ``persist``."""
        self._inflight: InFlight | None = None
        self._abandoned = False  # `give_up` left a save unfinished: the tier is not used again
        self._saves = 0
        self._persisted_at = time.monotonic()

    # ----------------------------------------------------------------------------------------------- setup
    def setup(self, *, distributed: bool) -> Topology:
        """Join the tier's gloo group and find the nodes, once. Collective when ``distributed``."""
        if self.topology is not None:
            return self.topology
        error = self.open_area()
        self.distributed = distributed
        if distributed:
            self.group = dist.new_group(backend="gloo")
            self.topology = discover(self.memory_dir, group=self.group)
        else:
            self.topology = single_process()
        atexit.register(_close_at_exit, weakref.ref(self))
        own = max((part.key[0] for part in self.store.parts()), default=0) if error is None else 0
        answers = self.gather((error, own))  # one exchange: whether every area opened, and the newest counters
        failed = list(dict.fromkeys(e for e, _ in answers if e is not None))
        if failed:
            raise area_error(failed)
        if self.topology.leader:
            self.store.remove_stale()
        self.highest = max(o for _, o in answers)
        if self.replicas > 0 and self.topology.nodes == 1 and self.topology.rank == 0:
            warnings.warn(
                f"lightning_dcp: `replicas={self.replicas}` but every rank shares one memory area ({self.memory_dir}):"
                " one node, so no copy is made on another node, and losing this machine loses the memory"
                " checkpoints (the persisted ones stay). Pass `replicas=0` to say so, or run on several nodes.",
                stacklevel=3,
            )
        return self.topology

    def open_area(self) -> str | None:
        """Create the memory area and its ``last`` entry (this rank); what failed, or ``None``. Any rank, no I/O else.

        Nothing is created before a front end sets the tier up, so a tier refused at set-up leaves no trace.
        """
        sentinel = os.path.join(self.memory_dir, LAST_ENTRY)
        try:
            os.makedirs(self.memory_dir, exist_ok=True)
            with open(sentinel, "a") as f:  # opened for writing even when it exists: a read-only area fails here
                if not f.tell():
                    f.write("lightning_dcp memory tier: loading this path loads the newest checkpoint of every tier.\n")
        except OSError as err:
            where = getattr(err, "filename", None) or self.memory_dir
            return f"{where!r} ({type(err).__name__}: {err.strerror or err})"
        return None

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (rank order). Collective over the tier's group."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: Any, *, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank. Collective over the tier's group."""
        if not self.distributed:
            return value
        payload = [value]
        dist.broadcast_object_list(payload, src=src, group=self.group)
        return payload[0]

    # ------------------------------------------------------------------------------------------------ save
    def save(self, state: dict[str, Any], *, name: str, counter: int, step: int | None, distributed: bool) -> None:
        """Save the DCP state dict ``state`` as the checkpoint ``name`` in memory (see the module docstring).

        Args:
            state: The state dict as built for DCP (tensors, objects, rank objects).
            name: The checkpoint's name (its name in the durable directory when persisted).
            counter: Its save counter (recorded in ``.commit``; decides what is newest).
            step: The training step, recorded beside the counter.
            distributed: Whether every rank of the default group takes part.

        Collective: call on all ranks when ``distributed``.

        Raises:
            CheckpointError: The previous save failed (raised at this call), or planning this one failed (nothing of
                it is committed). A failure after planning (a copy, the commit) is raised by the next save or
                [`MemoryTier.wait`][lightning_dcp.MemoryTier.wait], and nothing of that save is committed.
        """
        self.wait()
        topology = self.setup(distributed=distributed)
        token, persist = self.broadcast((new_token(), self._persist_due()) if topology.rank == 0 else None)
        staging = self.store.staging(name, topology.node, token)
        self.mappings.prune()
        inflight = InFlight(name)
        writer = ShmWriter(staging, mappings=self.mappings, on_copied=inflight.on_copied)
        writer.order = {"counter": counter, "step": step if isinstance(step, int) and step >= 0 else None}
        if topology.leader:
            writer.on_setup = lambda: self.store.take_slot(staging)
        planner = save_planner(writers=topology.world_size)
        started = time.perf_counter()
        self.timings = {}
        try:
            prepared = saving.prepare(state, writer=writer, planner=planner, group=self.group, distributed=distributed)
        except saving.RankFailure as err:
            self._drop(staging)
            raise checkpoint_failure(err, f"Saving {name!r} to the memory tier {self.memory_dir!r} failed") from err
        failed = None
        if not self.async_save:
            try:
                writer.stage(prepared.plan, prepared.planner)
            except Exception as err:  # every rank learns it in the background's exchange, and fails the save
                failed = err
            self.timings["stage"] = time.perf_counter() - started
        else:
            prepared.planner = Captured(planner, prepared.plan.items, inflight)
            if inflight.versions:
                STEP_GATE.hold(inflight.copied)
        self._inflight = inflight
        thread = threading.Thread(
            target=self._background,
            args=(inflight, prepared, name, staging, failed, persist, started),
            name="lightning_dcp-memory",
            daemon=True,
        )
        inflight.thread = thread
        thread.start()

    def _persist_due(self) -> bool:
        self._saves += 1
        due = self.persist_every > 0 and self._saves % self.persist_every == 0
        late = self.persist_every_seconds is not None
        return due or (late and time.monotonic() - self._persisted_at >= self.persist_every_seconds)

    def _write(self, prepared: Any, name: str, staging: str, *, failed: BaseException | None) -> Saved:
        """Steps 3-4: copy (unless staged), hash, exchange, commit every node's part.

        Collective; raises ``RankFailure`` everywhere.
        """
        writer = prepared.writer
        saving.write(prepared, error=failed)
        metadata, marker = self.broadcast((writer.metadata_bytes, writer.marker) if self.topology.rank == 0 else None)
        saved = Saved(name, metadata, marker, self.topology)
        error = None
        if self.topology.leader:
            try:
                self.store.commit(
                    staging,
                    name=name,
                    node=self.topology.node,
                    nodes=self.topology.nodes,
                    files=saved.node_files[self.topology.node],
                    metadata=metadata,
                    marker=marker,
                    run=self.run,
                )
            except Exception as err:
                error = err
        saving.agree(error, group=self.group, distributed=self.distributed)
        self.saved = [*self.saved, saved][-self.keep :]
        return saved

    def _background(
        self,
        inflight: InFlight,
        prepared: Any,
        name: str,
        staging: str,
        failed: BaseException | None,
        persist: bool,
        started: float,
    ) -> None:
        try:
            try:
                saved = self._write(prepared, name, staging, failed=failed)
            except BaseException:
                self._drop(staging)  # every rank of the node is done with it (the write's exchange)
                raise
            self.timings["write"] = time.perf_counter() - started
            self._after_commit(saved, persist=persist)
        except BaseException as err:
            inflight.error = err
        finally:
            inflight.copied.set()
            STEP_GATE.release(inflight.copied)
            inflight.finished.set()

    def _after_commit(self, saved: Saved, *, persist: bool) -> None:
        """Step 5: replicas, eviction, persistence. Collective over the tier's group (background thread)."""
        topology = self.topology
        if topology.nodes > 1 and self.replicas > 0:
            began = time.perf_counter()
            try:
                self._replicate(saved)
            except saving.RankFailure as err:  # on every rank: the save is dropped, the older ones stay
                self.saved = [s for s in self.saved if s is not saved]
                if topology.leader:
                    for part in self.store.parts():
                        if (part.name, part.identity) == (saved.name, saved.identity):
                            self.store.uncommit(part.path)
                            remove_path(part.path)
                raise checkpoint_failure(
                    err,
                    f"Replicating {saved.name!r} to {self.replicas} other node(s) failed; it was dropped from the"
                    " memory tier (the older checkpoints stay). Give every memory area room for"
                    " `(keep + 1) x (1 + replicas)` parts, or lower `replicas` or `keep`",
                ) from err
            self.timings["replicate"] = time.perf_counter() - began
        self.gather(None)  # every node holds its replicas before anything older goes
        if topology.leader:
            self.evict()
        if persist:
            self.persist(saved)

    def _replicate(self, saved: Saved) -> None:
        topology = self.topology
        replicate(
            self.store,
            topology,
            name=saved.name,
            files=saved.files,
            node_files=saved.node_files,
            replicas=self.replicas,
            own_dir=os.path.join(self.store.root, f"{saved.name}@{topology.node}"),
            metadata=saved.metadata,
            marker=saved.marker,
            token=self.broadcast(new_token() if topology.rank == 0 else None),
            group=self.group,
            run=self.run,
        )

    def _drop(self, staging: str) -> None:
        """Remove the staging directory of a save that failed (its node's leader; nothing writes there any more)."""
        if self.topology.leader:
            remove_path(staging)

    def evict(self) -> None:
        """Remove this node's parts of every checkpoint but the newest ``keep`` this run committed (leader)."""
        keep = {(s.name, s.identity) for s in self.saved}
        for part in self.store.parts():
            if (part.name, part.identity) in keep or part.run != self.run:  # another run's: never ours to remove
                continue
            if part.node == self.topology.node:
                self.store.free(part, slots=1)
            else:
                self.store.uncommit(part.path)
                remove_path(part.path)

    def persist(self, saved: Saved) -> None:
        """Copy ``saved`` to the durable tiers (``persister``). Collective over the tier's group."""
        if self.persister is None or saved.persisted:
            return
        began = time.perf_counter()
        part = self.store.read(f"{saved.name}@{self.topology.node}")
        held = self.gather(part is not None)  # every rank raises, or none: persisting is collective
        if not all(held):
            lost = sorted(j for j, ranks in enumerate(self.topology.ranks) if any(not held[r] for r in ranks))
            raise CheckpointError(f"The memory tier lost the part(s) {lost} of {saved.name!r} before persisting it.")
        self.persister(saved, part)
        saved.persisted = True
        self._persisted_at = time.monotonic()
        self.timings["persist"] = time.perf_counter() - began

    def persist_newest(self) -> str | None:
        """Persist the newest checkpoint committed in memory by this run, unless it was (what SIGTERM calls).

        Collective: call on all ranks (after the save in flight, which it waits for). Returns its name.

        Raises:
            CheckpointError: The save in flight failed (raised after the newest committed checkpoint is persisted),
                or persisting failed.
        """
        failed = None
        try:
            self.wait()
        except CheckpointError as err:  # every rank alike; the newest committed checkpoint is still worth keeping
            failed = err
        if self.saved:
            self.persist(self.saved[-1])
        if failed is not None:
            raise failed
        return self.saved[-1].name if self.saved else None

    # ------------------------------------------------------------------------------------------- waiting
    def wait(self) -> None:
        """Block until the save in flight (if any) has finished every step; raise its error.

        Raises:
            CheckpointError: The background part of the save failed (naming the checkpoint).
        """
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        inflight.finished.wait()
        inflight.thread.join()  # its frames, which hold the tier's group, are gone before anyone destroys it
        if inflight.error is not None:
            raise checkpoint_failure(
                inflight.error, f"The memory-tier save of {inflight.name!r} failed in the background"
            ) from None

    def give_up(self, *, after: float) -> bool:
        """After a failed run: wait at most ``after`` seconds for the save in flight, then leave it unfinished.

        A transfer to a peer that died waits for good (gloo's point-to-point waits, unlike its collectives, do not fail
        when the connection closes). A save left keeps its files mapped and the group alive (the waiting thread uses
        them); [`close`][lightning_dcp.MemoryTier.close] then does nothing. What was committed stays. Returns whether a
        save was left.
        """
        inflight = self._inflight
        if inflight is None or inflight.finished.wait(after):
            return False
        self._inflight, self._abandoned = None, True
        self.group, self.topology = None, None
        log.warning(
            "lightning_dcp: the run failed; the memory-tier save of %r was left unfinished after %.0f s (a peer gone?)",
            inflight.name,
            after,
        )
        return True

    def close(self) -> None:
        """Wait for the save in flight, unmap the files (they stay in the area), then leave the tier's group.

        Does nothing after [`give_up`][lightning_dcp.MemoryTier.give_up] left a save unfinished.

        Collective: call on all ranks (a later save joins a new group). Raises like
        [`MemoryTier.wait`][lightning_dcp.MemoryTier.wait].
        """
        if self._abandoned:
            return
        try:
            self.wait()
        finally:
            self.mappings.close()
            group, self.group, self.topology = self.group, None, None
            leave(group)


def area_error(failed: list[str]) -> StorageAccessError:
    """The error for memory areas that cannot be written (``failed``: what :meth:`MemoryTier.open_area` said)."""
    return StorageAccessError(
        f"The memory area cannot be written: {'; '.join(failed)}. Give `memory_dir` a directory on a tmpfs that every"
        " rank of the node can create and write (e.g. `/dev/shm/<user>-<run>`)."
    )


def _close_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit, close a tier nobody closed (Fabric never tears its strategy down); log its error."""
    tier = ref()
    if tier is None or tier.topology is None:
        return
    try:
        tier.close()
    except Exception as err:
        log.warning("lightning_dcp: closing the memory tier at exit: %s", err)
