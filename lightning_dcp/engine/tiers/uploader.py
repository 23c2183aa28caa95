"""The local tier's uploader: one background thread on rank 0 that does, in order, every remote call of the tier.

The training loop only queues work here (:class:`~lightning_dcp.engine.tiers.local.Tiers` does, and journals removals
and pointer writes first: :mod:`lightning_dcp.engine.tiers.journal`). The thread takes one task at a time:

- ``listing``: what the remote directory holds (its committed checkpoints and pointers), for the journal;
- ``upload``: copy one committed local checkpoint and commit it remotely (:mod:`lightning_dcp.engine.tiers.upload`),
  then ``evict`` local copies beyond ``keep`` that the remote store holds;
- ``remove``: delete a checkpoint's remote copy (its local copy went when the removal was released), unless the
  remote copy is a version saved after the removal was asked for;
- ``link``: write a pointer, once the checkpoint it designates is committed remotely;
- ``call``: a remote clean-up of the front end (``DCPModelCheckpoint``: prefixes left by crashed saves).

Order: a removal or pointer write runs behind the uploads queued before it, so the remote store holds a successor
before a checkpoint leaves it; a removal waits while uploads are failing. A removal of a checkpoint that a remote
pointer designates waits for the pending write of that pointer (or, with none pending, deletes the pointer first):
a remote pointer never designates a missing checkpoint.

Outages: a task that fails because the store cannot be reached
(:func:`~lightning_dcp.engine.storage.stores.is_unreachable`: refused or reset connections, timeouts, HTTP 5xx) stays at
the head of the queue and is retried after a delay that doubles from :attr:`Retry.first_delay` up to
:attr:`Retry.max_delay`, each attempt logged. Other failures are logged; failed uploads are retried at the next save and
at teardown.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.format.marker import order_key
from lightning_dcp.engine.storage.location import Location, new_token
from lightning_dcp.engine.storage.names import snapshot_name
from lightning_dcp.engine.storage.stores import is_unreachable
from lightning_dcp.engine.tiers.journal import TierJournal
from lightning_dcp.engine.tiers.upload import (
    marker_of,
    remove_committed,
    same_checkpoint,
    snapshot,
    upload,
)
from lightning_dcp.errors import NotACheckpointError

__all__ = ["Outage", "Retry", "Task", "Uploader", "local_marker"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Retry:
    """How the uploader waits out a remote store that cannot be reached."""

    first_delay: float = 0.5
    """Seconds before the first retry of a task that met an outage; doubled after each failed attempt."""
    max_delay: float = 30.0
    """The longest wait between two attempts."""
    at_teardown: float = 60.0
    """Seconds ``teardown`` waits for an answer of the store: once the store has answered nothing (no task finished,
    no file or part of one taken) for this long since teardown began or since its last answer, teardown raises. A
    stopped store that hangs every request costs this long, not this long after its first request timed out."""
    first_listing: float = 10.0
    """Seconds the first save waits for the remote listing when the tier knows nothing of the remote directory."""


@dataclasses.dataclass
class Outage:
    """The remote store has failed every attempt since ``since`` (``time.monotonic()``)."""

    since: float
    error: BaseException
    attempts: int = 0


@dataclasses.dataclass(eq=False)
class Task:
    """One unit of the uploader's work (see the module docstring)."""

    kind: str  # "listing", "upload", "remove", "link", "evict", "call"
    name: str = ""
    version: dict[str, Any] | None = None  # remove: the local version asked to go
    target: str = ""  # link: the checkpoint the pointer designates
    seq: int | None = None  # the journal's intent
    call: Callable[[], Any] | None = None


class Uploader:
    """The queue and background thread of one local tier. Rank 0 only.

    Args:
        local: The local tier's directory.
        journal: The tier's journal.
        keep: Committed checkpoints the local tier keeps (the newest).
        retry: Backoff through outages.
    """

    def __init__(self, local: Location, journal: TierJournal, *, keep: int, retry: Retry) -> None:
        self.local, self.journal, self.keep, self.retry = local, journal, keep, retry
        self.remote_dir: Location | None = None
        self.cond = threading.Condition()
        """Guards every field below; ``Tiers`` takes it to change the queue."""
        self.queue: collections.deque[Task] = collections.deque()
        self.active: Task | None = None
        self.failed: dict[str, tuple[Task, BaseException]] = {}  # "<kind> <name>" -> the task and its error
        self.deferred: list[Task] = []  # removals and pointer writes waiting for failed uploads
        self.held: list[Task] = []  # removals and pointer writes waiting for the save in flight
        self.parked: list[Task] = []  # removals waiting for the pending write of a pointer to their checkpoint
        self.saving: dict[str, dict | None] = {}  # names being saved -> their committed version before
        self.outage: Outage | None = None
        self.listed = threading.Event()  # a listing of the remote directory ended (or failed)
        self._started: set[str] = set()  # names whose upload began in this process
        self._stop = False
        self._thread: threading.Thread | None = None
        self.last_upload_seconds: float | None = None
        self.last_upload_bytes: int | None = None
        self.answered_at = time.monotonic()
        """``time.monotonic()`` of the store's last answer: a task done, or a file or a part of one taken."""

    # ------------------------------------------------------------------------------------------- queue (locked)
    def enqueue(self, tasks: Iterable[Task]) -> None:
        """Append ``tasks`` (one queued upload per name) and make sure the thread runs. Call under :attr:`cond`."""
        for task in tasks:
            if task.kind == "upload" and any(t.kind == "upload" and t.name == task.name for t in self.queue):
                continue  # the queued one reads the newest committed version when it starts
            self.queue.append(task)
        self._stop = False
        if self.queue and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._work, name="lightning_dcp-uploader", daemon=True)
            self._thread.start()
        self.cond.notify_all()

    def requeue_failed(self) -> None:
        """Queue every failed task again (its record stays until it succeeds). Call under :attr:`cond`."""
        busy = self.active.name if self.active is not None else None
        self.enqueue(t for t, _ in list(self.failed.values()) if not (t.kind == "upload" and t.name == busy))

    def link_pending(self, pointer: str) -> bool:
        """Whether a write of the remote pointer ``pointer`` waits anywhere. Call under :attr:`cond`."""
        waiting = [*self.queue, *self.held, *self.deferred, *([self.active] if self.active else [])]
        return any(t.kind == "link" and t.name == pointer for t in waiting)

    def uploads_failing(self) -> bool:
        """Whether an upload failed (other than by an outage) and was not redone yet. Call under :attr:`cond`."""
        return any(t.kind == "upload" for t, _ in self.failed.values())

    def drain(self, *, patience: float) -> Outage | None:
        """Queue failed tasks again, then wait until the queue is empty; ``None`` once it is.

        One deadline for the whole wait: ``patience`` seconds after this call or after the store's last answer
        (:attr:`answered_at`), whichever is later. A store that keeps answering (uploads advancing, tasks finishing)
        is waited for; one that answers nothing, whether its requests fail or hang, is given up on at the deadline
        even while a request is still pending. Then the thread is stopped (after its current attempt; the queue is
        kept) and the outage returned: the failures seen, or the silence itself when no request has failed yet.
        """
        started = time.monotonic()
        with self.cond:
            self.requeue_failed()
            while self.queue or self.active is not None:
                quiet_since = max(started, self.answered_at)
                left = quiet_since + patience - time.monotonic()
                if left <= 0:
                    self._stop = True
                    self.cond.notify_all()
                    if self.outage is not None:
                        return self.outage
                    silence = TimeoutError(f"no request answered in {time.monotonic() - quiet_since:.0f} s")
                    return Outage(quiet_since, silence)
                self.cond.wait(timeout=min(0.5, left))
            return None

    def _heard(self) -> None:
        """The store answered (a task done, a file or part taken): teardown's deadline starts again from now."""
        self.answered_at = time.monotonic()

    # ------------------------------------------------------------------------------------------------ thread
    def _work(self) -> None:
        while True:
            with self.cond:
                if self._stop or not self.queue:
                    self._thread = None
                    self.cond.notify_all()
                    return
                task = self.active = self.queue.popleft()
            try:
                self._run(task)
            except Exception as err:
                if is_unreachable(err):
                    self._wait_out(task, err)
                else:
                    self._failure(task, err)
            else:
                self._answered(task)
            finally:
                with self.cond:
                    self.active = None
                    self.cond.notify_all()

    def _run(self, task: Task) -> None:
        if task.kind == "listing":
            self._listing()
        elif task.kind == "upload":
            self._upload(task)
        elif task.kind == "remove":
            self._remove(task)
        elif task.kind == "link":
            self._link(task)
        elif task.kind == "evict":
            self._evict()
        else:
            task.call()

    def _wait_out(self, task: Task, err: BaseException) -> None:
        """The store cannot be reached: put ``task`` back at the head and wait (backoff, interrupted by ``stop``)."""
        with self.cond:
            if self.outage is None:
                self.outage = Outage(time.monotonic(), err)
            self.outage.error, self.outage.attempts = err, self.outage.attempts + 1
            delay = min(self.retry.first_delay * 2 ** (self.outage.attempts - 1), self.retry.max_delay)
            self.queue.appendleft(task)
            log.warning(
                "lightning_dcp: the remote store cannot be reached (%s of %r, attempt %d, for %.0f s); retrying in"
                " %.1f s, checkpoints stay committed in the local tier %s meanwhile. %s",
                task.kind,
                task.name,
                self.outage.attempts,
                time.monotonic() - self.outage.since,
                delay,
                self.local.url,
                err,
            )
            self.cond.wait_for(lambda: self._stop, timeout=delay)

    def _answered(self, task: Task) -> None:
        self._heard()
        with self.cond:
            if self.outage is not None:
                log.warning(
                    "lightning_dcp: the remote store answers again after %.0f s (%d failed attempts); uploads go on.",
                    time.monotonic() - self.outage.since,
                    self.outage.attempts,
                )
                self.outage = None
            self.failed.pop(f"{task.kind} {task.name}", None)
            if not self.uploads_failing() and self.deferred:
                self.enqueue(self.deferred)
                self.deferred.clear()

    def _failure(self, task: Task, err: BaseException) -> None:
        log.warning("lightning_dcp: %s of %r in the local tier failed: %s", task.kind, task.name, err)
        with self.cond:
            if task.kind in ("upload", "remove", "link"):
                self.failed[f"{task.kind} {task.name}"] = (task, err)
        if task.kind == "listing":
            self.listed.set()  # nobody waits for a listing that cannot succeed

    # ------------------------------------------------------------------------------------------------- tasks
    def _listing(self) -> None:
        remote = {loc.name: key for key, loc in committed_checkpoints(self.remote_dir)}
        pointers = {}
        for name, kind in self.remote_dir.entries():
            if kind == "file":
                try:
                    target = self.remote_dir.child(name).read_pointer()
                except NotACheckpointError:  # a pointer leading elsewhere: not one of ours to follow
                    continue
                if target is not None:
                    pointers[name] = target
        self.journal.saw_listing(remote, pointers)
        self.listed.set()

    def _upload(self, task: Task) -> None:
        local, remote = self.local.child(task.name), self.remote_dir.child(task.name)
        frozen = self.local.child(snapshot_name(task.name, new_token())).path
        started = time.perf_counter()
        with self.cond:
            self._started.add(task.name)
        try:
            try:
                data, marker = snapshot(local, frozen)
            except NotACheckpointError:
                return  # removed meanwhile, or being replaced (its commit queues it again)
            upload(frozen, data, marker, remote, progress=self._heard)
            sent = sum(os.path.getsize(os.path.join(frozen, name)) for name in os.listdir(frozen))
        finally:
            shutil.rmtree(frozen, ignore_errors=True)
        self.journal.saw_remote(task.name, order_key(marker))
        self.last_upload_seconds, self.last_upload_bytes = time.perf_counter() - started, sent
        log.info("lightning_dcp: uploaded %s to %s", local.url, remote.url)
        self._evict()

    def _remove(self, task: Task) -> None:
        with self.cond:
            if self.uploads_failing():  # the successor may not be remote yet: keep every remote copy until then
                self.deferred.append(task)
                return
            pointers = [p for p, t in self.journal.pointers.items() if t == task.name]
            if any(self.link_pending(p) for p in pointers):
                self.parked.append(task)  # the pointer moves first
                return
            started = task.name in self._started
        if task.name in self.journal.remote or started or not self.journal.listed:
            for pointer in pointers:  # no write of it is pending: it would designate a missing checkpoint
                self.remote_dir.child(pointer).remove()
                self.journal.saw_pointer(pointer, None)
            remote = self.remote_dir.child(task.name)
            current, local = marker_of(remote), local_marker(self.local.child(task.name))
            saved_since = local is not None and not same_checkpoint(local, task.version)
            if not (current is not None and saved_since and same_checkpoint(current[1], local)):
                remove_committed(remote)
                remote.remove_stale_staging()
                self.journal.saw_remote(task.name, None)
        self.journal.done(task.seq)

    def _link(self, task: Task) -> None:
        with self.cond:
            if self.uploads_failing():
                self.deferred.append(task)
                return
        target = self.remote_dir.child(task.target)
        if marker_of(target) is None:
            log.warning(
                "lightning_dcp: the remote pointer %r is not written: %s is not committed remotely.",
                task.name,
                target.url,
            )
        else:
            self.remote_dir.child(task.name).write_pointer(target)
            self.journal.saw_pointer(task.name, task.target)
        self.journal.done(task.seq)
        with self.cond:  # removals parked behind a pointer write check again (they were at the head)
            self.queue.extendleft(reversed(self.parked))
            self.parked.clear()

    def _evict(self) -> None:
        if self.remote_dir is None or not os.path.isdir(self.local.path):
            return
        for _, local in committed_checkpoints(self.local)[self.keep :]:  # a copy committed remotely is redundant
            seen = local_marker(local)
            found = marker_of(self.remote_dir.child(local.name))
            if found is None or not same_checkpoint(seen, found[1]):
                continue
            with self.cond:  # unless that name is being saved again meanwhile
                if local.name not in self.saving and same_checkpoint(local_marker(local), seen):
                    remove_committed(local)


def local_marker(location: Location) -> dict[str, Any] | None:
    """The parsed ``.commit`` of ``location``, or ``None`` when it is not committed."""
    found = marker_of(location)
    return None if found is None else found[1]
