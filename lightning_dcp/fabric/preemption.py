"""SIGTERM (preemption) with Fabric and the memory tier: persist the newest memory checkpoint, then exit as asked.

A scheduler that preempts a job sends SIGTERM and gives it a grace period. The memory tier's newest checkpoint lives
in host memory, which a preemption may take away with the machine, so it should reach the durable directory first.
Persisting is collective and a signal handler runs wherever the main thread was interrupted (between two
collectives of a save, say), so the handler installed here only records the signal; the strategy's next
``fabric.save`` (a collective point of every rank) lets the ranks agree whether any of them received it, and if so,
after that save, every rank persists the newest memory checkpoint (:meth:`MemoryTier.persist_newest`) and then
raises SIGTERM on itself under the handler that was there before (Python's default ends the process), so the job
stops the way it would have, a checkpoint later.

What is deferred stays bounded: a second SIGTERM before that save goes to the previous handler at once (a job that
never saves again still stops), and the strategy's ``teardown`` (or the end of the process) puts the previous handler
back. A process that ignores SIGTERM (``SIG_IGN``) keeps ignoring it. A main thread stuck inside one C call (a
collective with a peer whose host vanished) cannot run the handler: ``stuck_after`` seconds after the signal the
process ends with status 143 (:class:`~lightning_dcp.engine.SignalWatch`). The Trainer does the same through
:class:`~lightning_dcp.trainer.memory.MemoryCheckpoint` and Lightning's own SIGTERM flag.
"""

from __future__ import annotations

import logging
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any

from lightning_dcp.engine import SignalWatch
from lightning_dcp.engine.tiers.memory import MemoryTier

__all__ = ["Preemption"]

log = logging.getLogger(__name__)


class Preemption:
    """Records SIGTERM in the main thread's handler; acts on it at a point where every rank is (a save).

    Args:
        stuck_after: Seconds after a SIGTERM by which the main thread must have run the handler, else the process
            ends with status 143; ``None``: never.
    """

    def __init__(self, *, stuck_after: float | None = SignalWatch.STUCK_AFTER_S) -> None:
        self.received = False
        self._watch = SignalWatch(signals=[signal.SIGTERM], after=stuck_after)
        self._previous: Any = None
        self._installed = False
        self._warned = False

    def install(self) -> None:
        """Install the recording handler (main thread only; elsewhere SIGTERM keeps its handler, with a warning)."""
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "lightning_dcp: `fabric.save` runs outside the main thread, so SIGTERM cannot be deferred to"
                    " persist the newest memory checkpoint first; it keeps its handler.",
                    stacklevel=3,
                )
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return  # the process ignores SIGTERM: nothing to defer
        self._previous = previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        self._watch.start()

    def uninstall(self) -> None:
        """Put the previous handler back (main thread; a no-op when not installed)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False
        self._watch.stop()
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._watch.handler_ran()
        if self.received:  # a second one: no save came to act on the first; stop as the process would have
            self.uninstall()
            signal.raise_signal(signal.SIGTERM)
            return
        self.received = True

    def after_save(self, memory: MemoryTier, *, anywhere: Callable[[bool], bool]) -> None:
        """If any rank received SIGTERM: persist the newest memory checkpoint, then raise SIGTERM as before.

        ``anywhere(flag)`` tells whether any rank's flag is set, over the training's process group (the strategy's
        ``reduce_boolean_decision``): the memory tier's group may be busy with the save's background part. SIGTERM
        is raised again (under the previous handler) even when persisting fails.

        Collective: call on all ranks after each save.

        Raises:
            CheckpointError: Persisting failed (when the previous handler returns instead of ending the process).
        """
        if not anywhere(self.received) or memory.topology is None:
            return
        try:
            name = memory.persist_newest()
            if memory.topology.rank == 0:
                log.warning("lightning_dcp: SIGTERM: persisted the memory checkpoint %r.", name)
        finally:
            self.received = False
            self.uninstall()
            signal.raise_signal(signal.SIGTERM)
