"""Background saves: at most one in flight; its commit and the removals queued behind it run when it completes.

The training loop pays only for staging (:mod:`lightning_dcp.engine.staging`). ``dcp.async_save`` then plans and
writes in a background thread over a dedicated gloo process group (created once per run; DCP requires a CPU backend
and the training collectives must not share a group with a background thread). When the save completes on rank 0
(DCP's coordinator finishes only after every rank wrote), rank 0 commits it in that thread, then deletes the
checkpoints whose removal was requested while it was in flight: a checkpoint is never removed before its successor
is saved.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageWriter

from lightning_dcp.engine.staging import Stager
from lightning_dcp.engine.storage import Location
from lightning_dcp.errors import checkpoint_failure

__all__ = ["AsyncSaves"]

log = logging.getLogger(__name__)


class _InFlight:
    """One background save: its future, what to do once it is done, and what went wrong."""

    def __init__(self, location: Location, rank: int, commit: Callable[[], None], abandon: Callable[[], None]) -> None:
        self.location = location
        self.rank = rank
        self.commit = commit
        self.abandon = abandon
        self.removals: list[Location] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.lock = threading.Lock()

    def done(self, future: Future) -> None:
        """Runs in DCP's background thread when this rank's part of the save ends."""
        try:
            future.result()
        except BaseException as err:  # DCP's CheckpointException derives from BaseException
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


class AsyncSaves:
    """Run saves with ``dcp.async_save`` one at a time and surface their errors at the next call.

    Args:
        pin_memory: Pinned staging buffers (default: whether CUDA is available).
    """

    def __init__(self, *, pin_memory: bool | None = None) -> None:
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
        location: Location,
        rank: int,
        distributed: bool,
        commit: Callable[[], None],
        abandon: Callable[[], None],
    ) -> None:
        """Stage ``state_dict`` (blocking) and write it in the background; call :meth:`wait` first.

        Collective: call on all ranks when ``distributed`` (the first call creates the gloo group).
        """
        if self._inflight is not None:
            raise RuntimeError("A background save is still in flight: call wait() before starting another.")
        group = None
        if distributed:
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            group = self._group
        inflight = _InFlight(location, rank, commit, abandon)
        if not distributed:
            _expect_single_process_save()
        future = dcp.async_save(
            state_dict, storage_writer=writer, process_group=group, async_stager=self.stager, no_dist=not distributed
        )
        self._inflight = inflight
        future.add_done_callback(inflight.done)

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


def _expect_single_process_save() -> None:
    """Silence DCP's "assuming the intent is to save in a single process" warning for our single-process saves.

    Under a stock strategy (rank 0 alone calls the CheckpointIO) a background save runs without a process group on
    purpose. DCP warns from its executor thread (attributed to ``torch.distributed.checkpoint.utils``), where a
    ``warnings.catch_warnings`` around ``dcp.async_save`` no longer applies, so a filter for exactly that message is
    added to the process's filters (idempotent: ``filterwarnings`` replaces an identical entry). Synchronous saves
    and loads are silenced locally instead (``single_process_ok``).
    """
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a"
        r" single process",
        module=r"torch\.distributed\.checkpoint\.utils",
    )


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # cleanup must not hide the error that triggered it
        log.warning("lightning_dcp: cleanup after a background save failed", exc_info=True)
