"""Ending a process whose main thread cannot run a signal's Python handler: a rank stuck in a collective.

Python runs signal handlers in the main thread, between two bytecodes. A main thread blocked inside one C call never
gets there: a gloo collective waiting for a peer whose host vanished (its connections are not closed, so the wait
lasts the process group's timeout, 30 minutes by default) ignores the SIGTERM of torchelastic's agent until the agent
SIGKILLs it 30 s later, or SLURM's until its ``KillWait``. Lightning's handlers and the ``dcp_*`` strategies' flag-only
handlers (:mod:`lightning_dcp.trainer.preemption`) alike. Without a Python handler SIGTERM would end it at once.

CPython's C-level handler still writes the signal's number to the wakeup fd (:func:`signal.set_wakeup_fd`) the moment
the signal arrives. :class:`SignalWatch` reads it in a thread of its own; when the Python handler has not run
``after`` seconds later, the main thread is stuck, and the thread dumps every thread's stack to stderr, calls
``on_stuck`` (e.g. forwarding the signal to the processes the run launched) and ends the process with status
``128 + signal`` (what a process killed by the signal reports). A main thread that is only busy runs the handler
within milliseconds and nothing happens.

The wakeup fd is one per process: where another owner set it (an asyncio loop in the main thread), the watch stays
off. A child forked while the watch runs drops the fd (its signals are not the parent's).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["SignalWatch"]

log = logging.getLogger(__name__)

_STOP = 0  # the byte stop() writes: no signal has number 0
_WATCHED_FDS: set[int] = set()  # the write ends in use in this process (a forked child clears its wakeup fd)


class SignalWatch:
    """Ends the process when a watched signal's Python handler has not run ``after`` seconds after it arrived.

    The caller installs the Python handlers and calls :meth:`handler_ran` from them.

    Args:
        signals: The signal numbers watched.
        after: Seconds the main thread gets to run the handler. ``None``: no watch.
        on_stuck: Called with the signal number from the watch's thread before the process ends.
    """

    STUCK_AFTER_S = 10.0
    """Default ``after`` (seconds) of the front ends' preemption handlers (torchelastic's agent SIGKILLs 30 s after
    its SIGTERM)."""

    def __init__(
        self,
        *,
        signals: Iterable[int],
        after: float | None,
        on_stuck: Callable[[int], None] | None = None,
    ) -> None:
        self.signals = frozenset(int(s) for s in signals)
        self.after = after
        self.on_stuck = on_stuck
        self._runs = 0  # handler runs; the watch's thread only reads it
        self._fds: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether the watch's thread reads the wakeup fd."""
        return self._fds is not None

    def handler_ran(self) -> None:
        """Tell the watch a Python handler ran (call it from the handlers of the watched signals)."""
        self._runs += 1

    def start(self) -> bool:
        """Make a pipe the process's wakeup fd and start reading it. Main thread only.

        Returns:
            False (and nothing changed) off the main thread, with ``after=None``, when running already, or when the
            wakeup fd has another owner.
        """
        if self.after is None or self.running or threading.current_thread() is not threading.main_thread():
            return False
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # set_wakeup_fd's requirement: a full pipe never blocks the C handler
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            log.debug(
                "lightning_dcp: the signal wakeup fd belongs to another owner (%d); no stuck-rank watch", previous
            )
            return False
        self._fds = (read_end, write_end)
        _WATCHED_FDS.add(write_end)
        self._thread = threading.Thread(target=self._watch, args=(read_end,), name="lightning_dcp-signal-watch")
        self._thread.daemon = True
        self._thread.start()
        return True

    def stop(self) -> None:
        """Give the wakeup fd back and end the watch's thread. Main thread only (a no-op when not running)."""
        if self._fds is None or threading.current_thread() is not threading.main_thread():
            return
        read_end, write_end = self._fds
        self._fds = None
        _WATCHED_FDS.discard(write_end)
        current = signal.set_wakeup_fd(-1)
        if current != write_end:  # not ours any more: put the other owner's back
            signal.set_wakeup_fd(current)
        try:
            os.write(write_end, bytes([_STOP]))
        except BrokenPipeError:  # the thread saw `_fds` gone while it waited on a signal and closed the read end
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        os.close(write_end)  # the thread closes the read end

    def _watch(self, read_end: int) -> None:
        seen = self._runs
        try:
            while True:
                data = os.read(read_end, 64)
                if not data or _STOP in data:
                    return
                arrived = next((s for s in data if s in self.signals), None)
                if arrived is None:
                    continue
                deadline = time.monotonic() + float(self.after or 0.0)
                while self._runs == seen and time.monotonic() < deadline and self._fds is not None:
                    time.sleep(0.02)
                if self._fds is None:
                    return
                if self._runs == seen:
                    self._end(arrived)
                seen = self._runs
                # signals that arrived before the handler ran were all written by then (the C handler writes first),
                # and one handler run may stand for several of them (CPython coalesces): they are answered too
                os.set_blocking(read_end, False)
                try:
                    data = os.read(read_end, 4096)
                except BlockingIOError:
                    data = b""
                finally:
                    os.set_blocking(read_end, True)
                if _STOP in data:
                    return
        finally:
            os.close(read_end)

    def _end(self, signum: int) -> None:
        log.warning(
            "lightning_dcp: signal %d arrived %.1f s ago and the main thread has not run its handler (stuck in a call"
            " such as a collective with a peer that is gone); ending the process with status %d",
            signum,
            self.after,
            128 + signum,
        )
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:  # noqa: BLE001 - stderr closed: end anyway
            pass
        if self.on_stuck is not None:
            try:
                self.on_stuck(signum)
            except Exception:  # noqa: BLE001 - the process ends either way
                log.exception("lightning_dcp: on_stuck failed")
        os._exit(128 + signum)


def _after_fork_in_child() -> None:
    if not _WATCHED_FDS:
        return
    _WATCHED_FDS.clear()
    try:
        signal.set_wakeup_fd(-1)  # a child's signals must not reach the parent's watch through the shared pipe
    except ValueError:  # forked from a thread other than the main one: set_wakeup_fd refuses there
        pass


os.register_at_fork(after_in_child=_after_fork_in_child)
