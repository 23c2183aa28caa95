"""What each save and restore cost: small records that the front ends turn into logger metrics.

The :class:`~lightning_dcp.engine.checkpointer.Checkpointer` opens a :class:`SaveRecord` on rank 0 when a save
starts, notes how long the call blocked its caller and, once the checkpoint is committed (at the call for a
synchronous save, in the background thread for an async one), how long the whole save took and how many bytes the
committed checkpoint holds. An async save costs the training loop more than its call: every later wait for it (an
optimizer step waiting for its staging copies or its live write, the next save call or a load waiting for its
write, the teardown) is added to its record (:meth:`SaveLog.waited`), so ``blocked_s`` is everything the loop paid
for that save. Such a record is finished once the save is *settled* (:meth:`SaveLog.settled`: its background work seen
finished on the caller's thread), when no further wait for it can come. A front end
drains the finished records on its own (main) thread with :meth:`SaveLog.drain` and logs them; nothing here touches
a logger or the training loop.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["TIER_CODES", "RestoreRecord", "SaveLog", "SaveRecord", "save_metrics", "summary"]

TIER_CODES = {"durable": 0, "local_dir": 1, "memory": 2}
"""``checkpoint/tier`` as a number (loggers take numbers): 0 the checkpoint's own directory (local disk or remote
store, written there), 1 the local tier of a remote path (``DCPCheckpointIO(local_dir=...)``; uploaded afterwards),
2 the memory tier (``MemoryCheckpoint``)."""


@dataclass
class SaveRecord:
    """One save as rank 0 saw it."""

    url: str
    """Where the checkpoint was committed (the local twin for a tiered save, the durable name for a memory save)."""
    step: int | None
    """The training step saved (Lightning's ``global_step``), ``None`` when unknown."""
    tier: str
    """``"durable"``, ``"local_dir"`` or ``"memory"`` (see :data:`TIER_CODES`)."""
    started: float
    """``time.perf_counter()`` when the save was called."""
    blocked_s: float | None = None
    """Seconds the training loop waited for this save: ``call_s`` plus ``waits_s`` (``None`` until the call ends)."""
    call_s: float | None = None
    """Seconds the save call itself blocked its caller (a wait in it for the previous save is that save's)."""
    waits_s: float = 0.0
    """Seconds the loop waited for this save after its call returned: optimizer steps at the step gate (its deferred
    staging copies, its live write), code waiting for its staging (validation, the end of training), the next save
    call, a load or a removal waiting for its write (back-pressure), the teardown."""
    save_s: float | None = None
    """Seconds from the call until the checkpoint was committed."""
    nbytes: int | None = None
    """Bytes of the committed checkpoint's files (``None`` for memory saves)."""
    announced: bool = False
    """Whether its INFO summary was logged (see :meth:`SaveLog.announce`)."""
    settled: bool = True
    """Whether no further wait of the loop can be added (``False`` for an async save until :meth:`SaveLog.settled`)."""

    @property
    def finished(self) -> bool:
        """Whether the save returned, was committed and is settled: its ``blocked_s`` is final."""
        return self.blocked_s is not None and self.save_s is not None and self.settled


@dataclass
class RestoreRecord:
    """One restore: where from, and how long the load took on this rank."""

    url: str
    tier: str | None
    restore_s: float
    source: str | None = None
    """Where the bytes really came from, in words (:func:`lightning_dcp.engine.catalog.lookup.source_of`): the tier and
    a location that exists; ``None``: ``url`` says it."""


def save_metrics(record: SaveRecord) -> dict[str, float]:
    """The ``checkpoint/*`` logger metrics of a finished save (bytes and throughput only where they are known).

    ``checkpoint/save_blocked_s`` is :attr:`SaveRecord.blocked_s`: every wait of the loop for the save, the call and
    the waits after it.
    """
    metrics: dict[str, float] = {
        "checkpoint/save_blocked_s": float(record.blocked_s or 0.0),
        "checkpoint/save_s": float(record.save_s or 0.0),
        "checkpoint/tier": float(TIER_CODES[record.tier]),
    }
    if record.nbytes is not None:
        metrics["checkpoint/save_bytes"] = float(record.nbytes)
        if record.save_s:
            metrics["checkpoint/save_gbps"] = record.nbytes / record.save_s / 1e9
    return metrics


def summary(record: SaveRecord) -> str:
    """One line for the log: where, which step, what the loop waited, when it was committed, how much, how fast."""
    if record.tier == "memory":  # not on disk (yet): the name it has in the tier, and the directory it persists to
        directory, _, name = record.url.rstrip("/").rpartition("/")
        where = f"the memory tier as {name!r} (of {directory})"
    else:
        where = record.url + (" (the local tier; the upload follows)" if record.tier == "local_dir" else "")
    line = (
        f"lightning_dcp: checkpoint saved to {where}, step {record.step}: the loop waited"
        f" {record.blocked_s or 0.0:.3f} s, committed after {record.save_s or 0.0:.3f} s"
    )
    if record.nbytes is not None:
        line += f", {record.nbytes / 1e6:.3g} MB"
        if record.save_s:
            line += f" at {record.nbytes / record.save_s / 1e9:.3g} GB/s"
    return line


class SaveLog:
    """The records of recent saves (rank 0), filled by the save path and drained by a front end. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[SaveRecord] = []
        self.restore: RestoreRecord | None = None
        """The last restore not yet reported (set by the front end's load, taken by its logger)."""

    def begin(self, url: str, *, step: int | None, tier: str, started: float, background: bool = False) -> SaveRecord:
        """Open the record of a save that starts now; records of earlier saves that never committed are dropped.

        ``background``: an async save, whose record stays unfinished until :meth:`settled`.
        """
        record = SaveRecord(url=url, step=step, tier=tier, started=started, settled=not background)
        with self._lock:
            self._records = [r for r in self._records if r.save_s is not None]
            self._records.append(record)
            del self._records[:-16]  # nobody drains (no logger): keep a few
        return record

    def returned(self, record: SaveRecord, *, call_s: float | None = None) -> None:
        """The save's call returns now, having blocked its caller ``call_s`` seconds (default: since ``started``).

        A save committed before its call returned counts as committed now.
        """
        with self._lock:
            record.call_s = time.perf_counter() - record.started if call_s is None else call_s
            self._blocked(record)

    def waited(self, record: SaveRecord, seconds: float) -> None:
        """The loop waited ``seconds`` for this save after its call returned (any thread). Thread-safe."""
        with self._lock:
            record.waits_s += seconds
            if record.call_s is not None:
                self._blocked(record)

    def settled(self, record: SaveRecord) -> None:
        """No further wait of the loop for this async save can come: its record is final once committed."""
        with self._lock:
            record.settled = True

    @staticmethod
    def _blocked(record: SaveRecord) -> None:
        record.blocked_s = (record.call_s or 0.0) + record.waits_s
        if record.save_s is not None:  # a wait that ended after the commit (the loop waited for the removals too)
            record.save_s = max(record.save_s, record.blocked_s)

    def committed(self, record: SaveRecord, *, sizes: Any = None) -> None:
        """The save is committed now; ``sizes()`` gives ``{name: bytes}`` of its files (a failure leaves them out)."""
        nbytes = None
        if sizes is not None:
            try:
                nbytes = sum(sizes().values())
            except Exception:  # a measurement never fails a save
                nbytes = None
        with self._lock:  # finished (drained) only once everything is in it
            record.nbytes = nbytes
            record.save_s = max(time.perf_counter() - record.started, record.blocked_s or 0.0)

    def announce(self, record: SaveRecord) -> str | None:
        """The one-line summary of ``record`` the first time it is asked for once finished, else ``None``."""
        with self._lock:
            if not record.finished or record.announced:
                return None
            record.announced = True
        return summary(record)

    def drain(self) -> list[SaveRecord]:
        """Take the finished records, oldest first; the one in flight stays."""
        with self._lock:
            done = [r for r in self._records if r.finished]
            self._records = [r for r in self._records if not r.finished]
        return done
