"""SIGTERM (preemption) with Fabric and the memory tier: persist the newest memory checkpoint, then exit as asked.

A scheduler that preempts a job sends SIGTERM and gives it a grace period. The memory tier's newest checkpoint lives
in host memory, which a preemption may take away with the machine, so it should reach the durable directory first.
Persisting is collective and a signal handler runs wherever the main thread was interrupted (between two
collectives of a save, say), so the handler installed here only records the signal; the strategy's next
``fabric.save`` (a collective point of every rank) lets the ranks agree whether any of them received it, and if so,
after that save, every rank persists the newest memory checkpoint (:meth:`MemoryTier.persist_newest`) and then
raises SIGTERM on itself under the handler that was there before (Python's default ends the process), so the job
stops the way it would have, a checkpoint later. The Trainer does the same through
:class:`~lightning_dcp.trainer.memory.MemoryCheckpoint` and Lightning's own SIGTERM flag.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from lightning_dcp.engine.tiers.memory import MemoryTier

__all__ = ["Preemption"]

log = logging.getLogger(__name__)


class Preemption:
    """Records SIGTERM in the main thread's handler; acts on it at a point where every rank is (a save)."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        """Install the recording handler once (main thread only; elsewhere SIGTERM keeps its handler)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.received = True

    def after_save(self, memory: MemoryTier, *, anywhere: Callable[[bool], bool]) -> None:
        """If any rank received SIGTERM: persist the newest memory checkpoint, then raise SIGTERM as before.

        ``anywhere(flag)`` tells whether any rank's flag is set, over the training's process group (the strategy's
        ``reduce_boolean_decision``): the memory tier's group may be busy with the save's background part.

        Collective: call on all ranks after each save.
        """
        if not anywhere(self.received) or memory.topology is None:
            return
        name = memory.persist_newest()
        if memory.topology.rank == 0:
            log.warning("lightning_dcp: SIGTERM: persisted the memory checkpoint %r before exiting.", name)
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False
        self.received = False
        signal.raise_signal(signal.SIGTERM)
