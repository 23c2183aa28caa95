"""One background save of :mod:`lightning_dcp.engine.save.async_save`: its thread, its timings and what runs after it.

:class:`InFlight` runs in its own thread: the save's remaining staging (``stage``), the write, the commit on rank 0
and the removals queued behind it; it records what the step gate and the adaptive live-write choice need (when the
call returned, when the first step came, when this rank's data was written) and what went wrong, for the next call
to report. It also counts every wait of the training loop for it after its call returned (:meth:`InFlight.waited`:
optimizer steps at the gate, the next call, a load or the teardown waiting for it) and hands each to ``charge``
(rank 0: the save's :class:`~lightning_dcp.engine.save_log.SaveRecord`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lightning_dcp.engine.gc_pause import gc_paused
from lightning_dcp.engine.save import saving
from lightning_dcp.engine.save.live_write import LiveWrite
from lightning_dcp.engine.save.staging import StagingRaceError
from lightning_dcp.engine.save.step_gate import STEP_GATE
from lightning_dcp.engine.storage.location import Location

__all__ = ["InFlight", "Stage", "quietly"]

_GATE = STEP_GATE

log = logging.getLogger(__name__)


class InFlight:
    """One background save: its thread, what to do once it is done, and what went wrong."""

    def __init__(self, location: Location, rank: int, commit: Callable[[], None], abandon: Callable[[], None]) -> None:
        self.location = location
        self.rank = rank
        self.commit = commit
        self.abandon = abandon
        self.removals: list[Location] = []
        self.error: BaseException | None = None
        self.dropped: list[str] = []  # tensors that changed before their deferred copy: the save was dropped
        self.dropped_outside_steps = True  # whether they changed outside optimizer steps (copied at the call since)
        self.finished = threading.Event()
        self.removed = threading.Event()  # the removals queued behind it are done too
        self.staged = threading.Event()
        self.step_wait = 0.0
        self.loop_wait = 0.0  # every wait of the loop for this save after its call returned (step_wait included)
        self.charge: Callable[[float], None] = lambda seconds: None  # where each of those waits is also reported
        self.settle: Callable[[], None] | None = None  # run once on the caller's thread when no wait can come
        self.learn: Callable[[list[str]], None] = lambda names: None
        self.lock = threading.Lock()
        self.live = False  # written from the live tensors while steps wait (no staging copies)
        self.called_at: float | None = None  # perf_counter() when the call returned
        self.step_at: float | None = None  # ... when the first optimizer step after the call reached the gate
        self.released_at: float | None = None  # ... when steps were let go
        self.written_at: float | None = None  # ... when this rank's data was written
        self.live_write: LiveWrite | None = None
        self.hurried = False  # a step arrived while the live write went on
        self.hurry_after: float | None = None  # seconds after the call to hurry a live write unasked
        self.thread: threading.Thread | None = None  # the background thread, once started

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the background thread has ended (after its commit and removals); whether it has."""
        thread = self.thread
        if thread is None:
            return self.removed.wait(timeout)
        thread.join(timeout)
        return not thread.is_alive()

    def add_step_wait(self, seconds: float) -> None:
        """Count time an optimizer step (or code waiting for staging) waited for this save's staging copies."""
        self.step_wait += seconds
        self.waited(seconds)

    def waited(self, seconds: float) -> None:
        """Count ``seconds`` the training loop waited for this save (in its thread), and report them (``charge``)."""
        self.loop_wait += seconds
        self.charge(seconds)

    def settle_if_over(self, *, force: bool = False) -> None:
        """On the caller's thread: run ``settle`` once the save is finished (or at once, ``force``).

        Only the teardown waits for the removals queued behind a finished save (``AsyncSaves.close``): that wait
        reaches a record settled before it only if the record was not logged yet.
        """
        if self.settle is not None and (force or self.finished.is_set()):
            settle, self.settle = self.settle, None
            settle()

    def hurry(self) -> None:
        """A step waits for this save (run in its thread): a live write copies what it has not written yet."""
        with self.lock:
            self.hurried = True
            live_write = self.live_write
        if live_write is not None:
            live_write.hurry()

    def saw_step(self, now: float) -> None:
        """The first optimizer step after the call reached the gate at ``now`` (``perf_counter()``)."""
        self.step_at = now

    def ready_time(self) -> float | None:
        """Seconds from the call until this rank's data was written (what a live write keeps steps waiting)."""
        if self.written_at is None or self.called_at is None:
            return None
        return self.written_at - self.called_at

    def fail(self, error: BaseException) -> None:
        """Record a failure before the background part started: abandon the save (rank 0), report it later."""
        self.error = error
        if self.rank == 0:
            quietly(self.abandon)
        self.staged.set()
        self.finished.set()
        self.removed.set()

    def release(self) -> None:
        """The staging copies optimizer steps wait for are made: let them go (idempotent)."""
        if self.released_at is None:
            self.released_at = time.perf_counter()
        self.staged.set()
        _GATE.release(self.staged)

    def run(self, stage: Stage) -> None:
        """The background thread: ``stage()``, then write, finish, commit (rank 0), deferred removals.

        ``stage(release)`` plans the save if the call left that to this thread, makes the deferred staging copies
        (calling ``release`` once optimizer steps may go on, if before it returns) and returns the prepared save,
        this rank's staging error (``None`` when it has none) and, for a live write, the :class:`LiveWrite` its writer
        reads through (it lets steps go; otherwise they go when ``stage`` returns).
        """
        with gc_paused():
            self._run(stage)

    def _run(self, stage: Stage) -> None:
        live_write = None
        try:
            prepared, staging_error, live_write = stage(self.release)
        except BaseException as err:  # planning failed (on every rank alike): nothing to write
            self.fail(err)
            return
        finally:
            if live_write is None:
                self.release()
        if live_write is not None:
            with self.lock:
                self.live_write = live_write
                hurried = self.hurried
            if hurried:  # a step arrived while the save was planned: copy here
                live_write.hurry()
        timer = None
        if live_write is not None and self.hurry_after is not None:  # copy the rest shortly before the step is due
            timer = threading.Timer(max(0.0, self.called_at + self.hurry_after - time.perf_counter()), self.hurry)
            timer.daemon = True
            timer.start()

        def written() -> BaseException | None:
            self.written_at = time.perf_counter()
            if timer is not None:
                timer.cancel()
            try:
                if live_write is not None:
                    live_write.finish()
            except Exception as err:
                return err
            finally:
                self.release()
            return None

        try:
            saving.write(prepared, error=staging_error, written=written)
        except BaseException as err:
            race = next(iter(getattr(err, "failures", {}).values()), None)
            if isinstance(race, StagingRaceError):  # dropped on every rank alike, with a warning: not an error
                self.dropped = race.names
                self.dropped_outside_steps = race.outside_steps
                if race.outside_steps:
                    self.learn(race.names)
            else:
                self.error = err
            if self.rank == 0:
                quietly(self.abandon)
        else:
            if self.rank == 0:
                try:
                    self.commit()
                except BaseException as err:
                    self.error = err
        if live_write is not None and self.hurried and self.error is None:
            try:  # a step came before the write was done: make the next saves' copies cheap (see LiveWrite)
                live_write.warm_buffers()
            except Exception:  # e.g. out of memory: the next save allocates (and fails) in its own time
                log.debug("lightning_dcp: warming staging buffers failed", exc_info=True)
        with self.lock:
            removals, self.removals = self.removals, []
            self.finished.set()
        if self.error is None and not self.dropped:
            for location in removals:
                quietly(location.remove)
        self.removed.set()

    def defer_removal(self, location: Location) -> bool:
        """Queue ``location`` for deletion after this save commits; False if the save already finished."""
        with self.lock:
            if self.finished.is_set():
                return False
            self.removals.append(location)
            return True


Stage = Callable[[Callable[[], None]], tuple[saving.PreparedSave, BaseException | None, LiveWrite | None]]
"""What a save's background thread runs first (see :meth:`InFlight.run`)."""


def quietly(fn: Callable[[], None]) -> None:
    """Run ``fn``; log (never raise) what it raises: cleanup must not hide the error that triggered it."""
    try:
        fn()
    except Exception:  # cleanup must not hide the error that triggered it
        log.warning("lightning_dcp: cleanup after a background save failed", exc_info=True)
