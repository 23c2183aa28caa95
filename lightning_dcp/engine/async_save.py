"""Background saves: at most one in flight; its commit and the removals queued behind it run when it completes.

The training loop pays for planning and staging only. In the caller's thread, over a dedicated gloo process group
(created once per run: the training collectives must not share a group with a background thread), the save is
planned (:func:`lightning_dcp.engine.saving.prepare`: after the first save of a run, a 16-byte exchange) and the
items *this rank writes* are copied into reused buffers (:mod:`lightning_dcp.engine.staging`): under DDP a rank
stages its share of the replicated state, not all of it. With ``defer_from``, the copies of large CPU tensors are
made by the background thread instead, while every optimizer step waits for them. A background thread then writes
(direct I/O and checksums, both outside the GIL, so the training loop keeps the interpreter) and finishes the
checkpoint over the same group. When the save completes, rank 0 commits it in that thread, then deletes the
checkpoints whose removal was requested while it was in flight: a checkpoint is never removed before its successor
is saved.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import SavePlanner, StorageWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_dcp.engine import saving
from lightning_dcp.engine.staging import Deferred, Stager
from lightning_dcp.engine.storage import Location
from lightning_dcp.errors import checkpoint_failure

__all__ = ["DEFER_FROM", "STEP_GATE", "AsyncSaves"]

DEFER_FROM = 1 << 20
"""CPU tensors from this size on are staged in the background (parameters and optimizer state, in practice)."""

log = logging.getLogger(__name__)


class _InFlight:
    """One background save: its thread, what to do once it is done, and what went wrong."""

    def __init__(self, location: Location, rank: int, commit: Callable[[], None], abandon: Callable[[], None]) -> None:
        self.location = location
        self.rank = rank
        self.commit = commit
        self.abandon = abandon
        self.removals: list[Location] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.staged = threading.Event()
        self.lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        """Record a failure before the background part started: abandon the save (rank 0), report it later."""
        self.error = error
        if self.rank == 0:
            _quietly(self.abandon)
        self.staged.set()
        self.finished.set()

    def run(self, prepared: saving.PreparedSave, deferred: list[Deferred]) -> None:
        """The background thread: the deferred staging copies, write, finish, commit (rank 0), deferred removals."""
        staging_error = None
        try:
            Stager.finish(deferred)
        except Exception as err:
            staging_error = err
        finally:
            self.staged.set()
            _GATE.done(self.staged)
        try:
            saving.write(prepared, error=staging_error)
        except BaseException as err:
            self.error = err
            if self.rank == 0:
                _quietly(self.abandon)
        else:
            if self.rank == 0:
                try:
                    self.commit()
                except BaseException as err:
                    self.error = err
        with self.lock:
            removals, self.removals = self.removals, []
            self.finished.set()
        if self.error is None:
            for location in removals:
                _quietly(location.remove)

    def defer_removal(self, location: Location) -> bool:
        """Queue ``location`` for deletion after this save commits; False if the save already finished."""
        with self.lock:
            if self.finished.is_set():
                return False
            self.removals.append(location)
            return True


class _Staged:
    """What the background writer reads: the staged copy of each of this rank's write items."""

    def __init__(self, staged: dict[Any, Any]) -> None:
        self.staged = staged

    def resolve_data(self, item: WriteItem) -> Any:
        return self.staged[item.index]


class _StepGate:
    """Makes every optimizer step wait for the deferred staging copies in flight.

    A global optimizer pre-step hook, installed on first use; while nothing is pending it returns at once.
    """

    def __init__(self) -> None:
        self._pending: set[threading.Event] = set()
        self._lock = threading.Lock()
        self._hook: Any = None

    def hold(self, staged: threading.Event) -> None:
        with self._lock:
            self._pending.add(staged)
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(self._wait)

    def done(self, staged: threading.Event) -> None:
        with self._lock:
            self._pending.discard(staged)

    def _wait(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._pending:
            return
        with self._lock:
            pending = list(self._pending)
        for staged in pending:
            staged.wait()


_GATE = _StepGate()
STEP_GATE = _GATE
"""The gate every optimizer step passes: ``hold(event)`` makes steps wait until ``event`` is set, ``done(event)``
releases it (the memory tier's async saves copy into shared memory behind it too)."""


class AsyncSaves:
    """Run saves in the background one at a time and surface their errors at the next call.

    Staging copies of CPU tensors of at least ``defer_from`` bytes are made in the background too, after the call
    returned: an optimizer step (anywhere in the process) waits until they are done, and a tensor changed in place
    before its copy was made fails that save (``StagingRaceError``, reported at the next call) instead of writing a
    checkpoint that mixes two steps. Smaller tensors (buffers a forward pass may update) are copied before returning.

    Args:
        pin_memory: Pinned staging buffers (default: whether CUDA is available).
        defer_from: Bytes from which a CPU tensor's staging copy is deferred (``None``: copy everything before
            returning).
    """

    def __init__(self, *, pin_memory: bool | None = None, defer_from: int | None = None) -> None:
        self.defer_from = defer_from
        self.stager = Stager(pin_memory=pin_memory)
        self._group: dist.ProcessGroup | None = None
        self._inflight: _InFlight | None = None

    @property
    def in_flight(self) -> Location | None:
        """The location of the save in flight, if one is."""
        return None if self._inflight is None else self._inflight.location

    def start(
        self,
        state_dict: dict[str, Any],
        *,
        writer: StorageWriter,
        planner: SavePlanner,
        location: Location,
        rank: int,
        distributed: bool,
        commit: Callable[[], None],
        abandon: Callable[[], None],
    ) -> None:
        """Plan and stage ``state_dict`` (blocking), then write it in the background; call :meth:`wait` first.

        Collective: call on all ranks when ``distributed`` (the first call creates the gloo group).

        A failure while planning or staging (on any rank) is reported like one of the background write: by the next
        :meth:`wait` on every rank.
        """
        if self._inflight is not None:
            raise RuntimeError("A background save is still in flight: call wait() before starting another.")
        group = None
        if distributed:
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            group = self._group
        inflight = _InFlight(location, rank, commit, abandon)
        self._inflight = inflight
        try:
            prepared = saving.prepare(state_dict, writer=writer, planner=planner, group=group, distributed=distributed)
            error: BaseException | None = None
            deferred: list[Deferred] = []
            try:
                staged, deferred = self.stager.stage_items(
                    prepared.plan.items, planner.resolve_data, defer_from=self.defer_from
                )
                prepared.planner = _Staged(staged)
            except Exception as err:  # e.g. out of memory: no rank may start writing, or the others would wait
                error = err
            saving.agree(error, group=group, distributed=distributed)
        except saving.RankFailure as failure:  # raised on every rank alike: reported at the next call, as a write's
            inflight.fail(failure)
            return
        if deferred:
            _GATE.hold(inflight.staged)
        thread = threading.Thread(target=inflight.run, args=(prepared, deferred), name="lightning_dcp-save")
        thread.daemon = True
        thread.start()

    def defer_removal(self, location: Location) -> bool:
        """Delete ``location`` once the save in flight has committed (rank 0). False when nothing is in flight."""
        return self._inflight is not None and self._inflight.defer_removal(location)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed on this rank's side.

        Raises:
            CheckpointError: The background save failed (the message names the rank and the path); it was never
                committed, so the checkpoint it would have replaced is intact.
        """
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        inflight.finished.wait()
        if inflight.error is not None:
            raise checkpoint_failure(
                inflight.error,
                f"The background save to {inflight.location.url!r} failed (seen on rank {inflight.rank})",
            ) from None

    def close(self) -> None:
        """Wait for the save in flight, then release the staging buffers. Raises like :meth:`wait`."""
        try:
            self.wait()
        finally:
            self.stager.close()  # the gloo group stays for this plugin's next run: groups are created once


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # cleanup must not hide the error that triggered it
        log.warning("lightning_dcp: cleanup after a background save failed", exc_info=True)
