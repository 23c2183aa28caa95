"""Live writes: an async save's background writer reads the training tensors themselves, not staging copies.

With deferred staging (:mod:`lightning_dcp.engine.save.async_save`) the tensors only optimizer steps change are copied
into staging buffers in the background while the next optimizer step waits for the copies. On a local disk the
copy can be skipped: the writer reads those tensors while they are live, and the next step waits until the writer
is done with them instead. When the write is over before that step (its forward and backward passes are longer
than the write) a save costs no copy and no staging memory at all; the first save of a run then also avoids
faulting in fresh staging buffers, which costs more than the copy itself (one page fault per 4 KiB page).

When a step arrives while the write still goes on, it does not wait for the rest of the write: it copies the
tensors the writer is not done with into staging buffers (:meth:`LiveWrite.hurry`, in the waiting thread), and the
writer takes the copies from then on, a large record from its next piece on (:meth:`LiveWrite.swap`). So a step
waits about as long as a staging copy of the rest would take, plus at most one piece of each file being written;
unless the writer, at the rate it wrote so far, would be done sooner than those copies (fresh staging buffers cost a
page fault per 4 KiB page on their first use): then the step just waits for it (not with ``patient=False``, the
choice under ``when_busy="skip"``, where a step never waits for the storage).
The version counter of each live tensor is checked when the writer is done with it or when it is copied: a tensor
changed in place before then (outside an optimizer step, since steps are held) fails the save with a
:class:`~lightning_dcp.engine.save.staging.StagingRaceError` naming it, as a deferred staging copy does; a checkpoint
never holds a tensor torn between two steps.

The writer calls :meth:`LiveWrite.resolve_data` for each item before writing it, :meth:`LiveWrite.swap` between
the pieces of a large record, and :meth:`LiveWrite.record_written` once it no longer needs the item's memory (see
:func:`lightning_dcp.engine.save.datafiles.write_local`); an item it never reports is released when the whole write is
over (:meth:`LiveWrite.finish`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem

from lightning_dcp._compat.torch_dcp import tensor_version
from lightning_dcp.engine.save.staging import Deferred, Stager, StagingRaceError

__all__ = ["LiveWrite"]

_WRITING, _DONE, _COPIED = 1, 2, 3
_WARM_COPY = 4e9
"""Bytes per second a copy into existing staging buffers is counted at (a busy core; ~20e9 on an idle one here)."""
_COLD_COPY = 0.5e9
"""... into fresh ones: a page fault per 4 KiB page (~9 us each in a 2-rank fit on this project's machine)."""


class LiveWrite:
    """The data one rank writes in a live write (see the module docstring); the planner its writer resolves with.

    Args:
        staged: Each write item's data by index: the live tensor for those in ``live``, staged copies otherwise.
        live: The live tensors (``buffer`` unset), each with its version counter when the save was called.
        stager: Where their staging buffers come from, should a step arrive before the writer is done.
        release: Lets optimizer steps go on; called once, when no live tensor is needed any more.
        rate: Bytes per second the last live write wrote (:attr:`rate`), for estimates before this one wrote any.
        patient: Whether a step may wait for the writer when it would be done sooner than the copies
            (:meth:`hurry`); ``False``: a step always copies the rest, never waiting for the storage.
    """

    def __init__(
        self,
        staged: dict[Any, Any],
        live: Iterable[Deferred],
        *,
        stager: Stager,
        release: Callable[[], None],
        rate: float | None = None,
        patient: bool = True,
    ) -> None:
        self.staged = staged
        self.patient = patient
        self._live = {copy_.index: copy_ for copy_ in live}
        self._state: dict[Any, int] = {}
        self._writing = 0  # items handed to the writer live and not reported written
        self._changed: list[str] = []
        self._hurried = False
        self._copied = threading.Event()  # the copies hurry() makes are complete
        self._released = False
        self._error: BaseException | None = None  # the copies hurry() made failed
        self._stager = stager
        self._release = release
        self._lock = threading.Lock()
        self._total = sum(copy_.source.nbytes for copy_ in self._live.values())
        self._done_bytes = 0  # of the live tensors, bytes the writer is done with
        self._done_items = 0
        self._started = time.perf_counter()
        self._rate_hint = rate
        self.rate: float | None = None
        """Bytes per second the writer was done with the live tensors at (set when they all are)."""

    def resolve_data(self, item: WriteItem) -> Any:
        """The writer's view of ``item``: the live tensor, or its staging copy once a step hurried the write."""
        copy_ = self._live.get(item.index)
        if copy_ is None:
            return self.staged[item.index]
        with self._lock:
            if not self._hurried:
                self._state[item.index] = _WRITING
                self._writing += 1
                return copy_.source
        self._copied.wait()
        return copy_.buffer

    def record_written(self, item: WriteItem) -> None:
        """The writer no longer needs ``item``'s memory (any thread)."""
        copy_ = self._live.get(item.index)
        if copy_ is None:
            return
        with self._lock:
            if self._state.get(item.index) != _WRITING:
                return
            self._state[item.index] = _DONE
            self._writing -= 1
            self._done_bytes += copy_.source.nbytes
            self._done_items += 1
            if self._done_items == len(self._live):
                self.rate = self._total / max(time.perf_counter() - self._started, 1e-6)
            if tensor_version(copy_.source) != copy_.version:
                self._changed.append(copy_.name)
            let_go = self._done_items == len(self._live) or (
                self._hurried and self._copied.is_set() and not self._writing
            )
        if let_go:
            self._let_go()

    def swap(self, item: WriteItem) -> torch.Tensor | None:
        """Between two pieces of ``item``'s record: its staging copy once a step hurried the write, else ``None``.

        The writer no longer needs the live tensor's memory when it asks (any thread).
        """
        if not self._hurried:
            return None
        copy_ = self._live.get(item.index)
        if copy_ is None:
            return None
        self._copied.wait()
        with self._lock:
            if self._state.get(item.index) != _WRITING or copy_.buffer is None:
                return None
            self._state[item.index] = _DONE
            self._writing -= 1
            let_go = not self._writing
        if let_go:
            self._let_go()
        return copy_.buffer

    def hurry(self) -> None:
        """A step waits (any thread, run there): copy what the writer is not done with, let steps go once it is.

        The writer takes the copies from then on: records not started, and the rest of large records being written
        (from their next piece, :meth:`swap`); steps go on once no live tensor is read any more.
        """
        with self._lock:
            if self._hurried or self._released:
                return
            rest = [copy_ for index, copy_ in self._live.items() if self._state.get(index, _WRITING) == _WRITING]
            if self.patient and self._sooner_written(rest):
                return
            self._hurried = True
            for copy_ in rest:
                self._state.setdefault(copy_.index, _COPIED)
        try:
            self._stager.assign_buffers(rest)
            Stager.copy(rest, check=True)
        except Exception as err:  # e.g. out of memory: this save fails (reported at the next call), not the step
            self._error = err
        finally:
            self._copied.set()
        with self._lock:
            self._changed += [copy_.name for copy_ in rest if copy_.changed]
            let_go = not self._writing
        if let_go:
            self._let_go()

    def warm_buffers(self) -> None:
        """Give every live tensor its staging buffer and fault its pages in (after the write, in the background).

        Called when a step came before the writer was done: the next saves may stage or hurry, and a copy into
        fresh buffers costs a page fault per 4 KiB page, several times the copy itself.
        """
        cold = [copy_ for copy_ in self._live.values() if copy_.buffer is None]
        self._stager.assign_buffers(cold)
        for copy_ in cold:
            copy_.buffer.zero_()

    def _sooner_written(self, rest: list[Deferred]) -> bool:
        """Whether the writer would be done with ``rest`` before copies of it are made (an estimate)."""
        rate = self._done_bytes / (time.perf_counter() - self._started) if self._done_bytes else self._rate_hint
        if not rate:
            return False
        rest_bytes = sum(copy_.source.nbytes for copy_ in rest)
        warm = self._stager.has_buffers(rest)
        copy_seconds = warm / _WARM_COPY + (rest_bytes - warm) / _COLD_COPY
        return (self._total - self._done_bytes) / rate < copy_seconds

    def finish(self) -> None:
        """The writer is done (or failed): check what was never reported, let steps go.

        Raises:
            StagingRaceError: Some live tensors changed in place before the writer was done with them or before
                they were copied.
            Exception: What making the copies raised (:meth:`hurry`): the save is not to be committed.
        """
        with self._lock:
            if not self._released:
                unreported = [c for i, c in self._live.items() if self._state.get(i) == _WRITING]
                self._changed += [c.name for c in unreported if tensor_version(c.source) != c.version]
            changed = list(self._changed)
        self._let_go()
        if self._error is not None:
            raise self._error
        if changed:
            raise StagingRaceError(changed)

    def _let_go(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()
