"""Tiered checkpoints: a local directory as the fast tier of a remote checkpoint directory.

A save to a remote path (``s3://bucket/run/epoch=3.ckpt``) is written and committed in the local tier
(``local_dir/epoch=3.ckpt``) at disk speed, synchronously or in the background as any save; once committed there, the
tier's uploader (one thread on rank 0, :mod:`lightning_dcp.engine.tiers.uploader`) copies it to the remote path,
verifies it and commits it there (:mod:`lightning_dcp.engine.tiers.upload`). The protocol of
:class:`~lightning_dcp.engine.checkpointer.Checkpointer` is unchanged: it calls :meth:`Tiers.prepare` before a save,
:meth:`Tiers.committed` after the local commit, and routes loads and removals of remote paths here.

What holds, whatever is killed when, and whatever the remote store does:

- Nothing remote runs in the training loop. Saves, removals (top-k pruning, ``save_last`` replacement), pointer writes
  (``save_last="link"``), ``DCPModelCheckpoint``'s existence checks and the save counter are answered from the local
  tier and the tier's journal; the uploader does every remote call. While the store cannot be reached, training goes
  on, each save warns, the uploader retries with bounded backoff, and ``teardown`` raises
  ``StorageUnavailableError`` if the store stays unreachable (every checkpoint stays committed locally).
- Removals and pointer writes are journaled in ``local_dir`` before they are acted on
  (:mod:`lightning_dcp.engine.tiers.journal`); the next run finishes them. Uploads need no journal: the next run
  uploads every committed local checkpoint whose remote copy is not the same checkpoint (at its first save or load, or
  when ``DCPModelCheckpoint`` sets up). A checkpoint asked to go never comes back, and a remote pointer never
  designates a checkpoint the remote store does not hold.
- Removals apply to the local copy at once (once the save they wait for is committed) and to the remote copy behind
  the uploads queued before them: the remote store holds a successor before a checkpoint leaves it.
- Loads: the newest checkpoint committed on either tier; the local copy first when both hold the same checkpoint
  (the same ``.commit``), the remote copy next (also when the local copy turns out damaged). While the remote store
  cannot be read, loads go on from the local tier with a warning.
- The local tier keeps the newest ``keep`` checkpoints; older ones leave it only once committed remotely, so it may
  hold more while uploads fall behind.

A local tier mirrors one remote directory, recorded in ``local_dir/.lightning_dcp-tier.json``; every rank must write
to the same ``local_dir`` filesystem (one machine, or a shared filesystem).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from typing import Any

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.storage.localfs import is_internal_name, replace_file
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.names import snapshot_prefix
from lightning_dcp.engine.tiers.journal import TierJournal, version_of
from lightning_dcp.engine.tiers.reads import TierReads
from lightning_dcp.engine.tiers.upload import SNAPSHOT_PREFIX, remove_committed, same_checkpoint
from lightning_dcp.engine.tiers.uploader import Retry, Task, Uploader, local_marker
from lightning_dcp.errors import CheckpointError, StorageUnavailableError

log = logging.getLogger("lightning_dcp.engine.checkpointer")  # the checkpointer's log: filters name it

__all__ = ["MANIFEST_FILE", "Retry", "Tiers"]

MANIFEST_FILE = ".lightning_dcp-tier.json"
"""In ``local_dir``: ``{"remote": "<the remote directory this tier mirrors>"}``, written at the first save."""


class Tiers(TierReads):
    """A local directory that takes saves at disk speed and replicates them to a remote directory in the background.

    Args:
        local_dir: Local directory of the fast tier (created when needed).
        keep: Committed checkpoints the local tier keeps (the newest); older ones are evicted once uploaded.
        storage_options: fsspec options of the remote store, for uploads resumed before the first save.
        retry: How the uploader waits out an unreachable store (:class:`~lightning_dcp.engine.tiers.uploader.Retry`).

    Raises:
        ValueError: ``local_dir`` is not a local path, or ``keep`` is not a positive integer.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike,
        *,
        keep: int = 2,
        storage_options: dict | None = None,
        retry: Retry | None = None,
    ) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"`local_keep` must be a positive integer, got {keep!r}.")
        if not Location(os.fspath(local_dir)).local:
            raise ValueError(f"`local_dir` must be a directory on a local disk, got {os.fspath(local_dir)!r}.")
        self.local = Location(os.path.abspath(Location(os.fspath(local_dir)).path))  # "file://" and "~" resolved
        self.keep = keep
        self.storage_options = dict(storage_options or {})
        self.journal = TierJournal(self.local.path)
        """Removals and pointer writes not carried out yet, and what the remote directory is known to hold."""
        self.uploader = Uploader(self.local, self.journal, keep=keep, retry=retry or Retry())
        """The background thread that does every remote call of the tier (rank 0)."""
        self._remote: Location | None = None
        self._resumed = False
        self._gave_up: StorageUnavailableError | None = None  # the error of the last `wait`, ended in an outage

    @property
    def retry(self) -> Retry:
        """How the uploader waits out an unreachable store (settable)."""
        return self.uploader.retry

    @retry.setter
    def retry(self, value: Retry) -> None:
        self.uploader.retry = value

    @property
    def last_upload_seconds(self) -> float | None:
        """Seconds the last upload took, from its snapshot to its remote commit (rank 0)."""
        return self.uploader.last_upload_seconds

    @property
    def last_upload_bytes(self) -> int | None:
        """Bytes the last upload sent (every file of the checkpoint)."""
        return self.uploader.last_upload_bytes

    # --------------------------------------------------------------------------------------------- mapping
    @staticmethod
    def covers(location: Location) -> bool:
        """Whether saves to ``location`` go through the local tier (any non-local path)."""
        return not location.local

    def local_twin(self, remote: Location) -> Location:
        """The local tier's path for the remote checkpoint ``remote`` (same name). Any rank."""
        return self.local.child(remote.name)

    def remote_dir(self) -> Location | None:
        """The remote directory this tier mirrors (from its manifest), or ``None`` before the first save."""
        if self._remote is None:
            try:
                with open(os.path.join(self.local.path, MANIFEST_FILE)) as f:
                    url = json.load(f)["remote"]
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                return None
            self._remote = Location(url, storage_options=self.storage_options)
        return self._remote

    def mirrors(self, directory: Location) -> bool:
        """Whether the local tier mirrors the remote ``directory``."""
        remote = self.remote_dir()
        return remote is not None and _same_url(remote.url, directory.url)

    def twins(self, location: Location) -> tuple[Location, Location] | None:
        """``(local, remote)`` copies of the checkpoint at ``location`` (either side), when this tier mirrors it."""
        if location.local:
            if os.path.dirname(os.path.abspath(location.path)) != self.local.path or self.remote_dir() is None:
                return None
            return location, self.remote_dir().child(location.name)
        return (self.local_twin(location), location) if self.mirrors(location.parent()) else None

    # ------------------------------------------------------------------------------------ save hooks (rank 0)
    def bind(self, directory: Location) -> None:
        """Make the local tier the mirror of the remote ``directory`` (recorded at the first call). Rank 0 only.

        Raises:
            CheckpointError: ``local_dir`` already mirrors another remote directory.
        """
        bound = self.remote_dir()
        if bound is not None and not _same_url(bound.url, directory.url):
            raise CheckpointError(
                f"`local_dir` {self.local.url!r} is the local tier of {bound.url!r}, not of {directory.url!r}. Give"
                f" each remote directory its own `local_dir` (or delete {MANIFEST_FILE} there once its uploads are"
                " done)."
            )
        if bound is None:
            os.makedirs(self.local.path, exist_ok=True)
            manifest = json.dumps({"remote": directory.url.rstrip("/")}).encode()
            replace_file(os.path.join(self.local.path, MANIFEST_FILE), manifest)
        self._remote = self.uploader.remote_dir = directory  # with the caller's storage options

    def prepare(self, remote: Location) -> None:
        """Before a save to ``remote``: bind the tier to its directory, resume pending work, warn of an outage.

        Rank 0 only.

        Raises:
            CheckpointError: ``local_dir`` already mirrors another remote directory.
        """
        self.bind(remote.parent())
        self._gave_up = None
        with self.uploader.cond:
            self.uploader.saving[remote.name] = version_of(local_marker(self.local_twin(remote)))
        self.resume()
        outage = self.uploader.outage
        if outage is not None:
            waiting = len(self.pending())
            warnings.warn(
                f"lightning_dcp: the remote store of {self.remote_dir().url!r} has been unreachable for"
                f" {time.monotonic() - outage.since:.0f} s ({type(outage.error).__name__}: {outage.error});"
                f" {waiting} checkpoint(s) wait for their upload, committed in the local tier {self.local.url!r}."
                f" Training goes on and uploads are retried (at most {self.retry.max_delay:.0f} s apart); teardown"
                " raises if the store stays unreachable.",
                stacklevel=2,
            )

    def committed(self, remote: Location) -> None:
        """The local copy of ``remote`` is committed: queue its upload, then what waited for the save.

        Rank 0 only (called in the background thread of an async save).
        """
        u = self.uploader
        with u.cond:
            u.saving.pop(remote.name, None)
            u.requeue_failed()
            u.enqueue([Task("upload", remote.name)])
            held, u.held = u.held, []
        for task in held:
            if task.kind == "remove":
                self.journal.release(task.seq)
                self._release_removal(task)
            else:
                with u.cond:
                    u.enqueue([task])

    def abandoned(self, remote: Location) -> None:
        """The save to ``remote`` failed: what waited for it is dropped (nothing succeeds). Rank 0."""
        with self.uploader.cond:
            self.uploader.saving.pop(remote.name, None)
            held, self.uploader.held = self.uploader.held, []
        for task in held:
            self.journal.done(task.seq)

    def remove(self, remote: Location, *, after_save: bool) -> None:
        """Delete the checkpoint ``remote`` from both tiers: the local copy now, the remote one behind the uploads.

        Args:
            remote: The remote path of the checkpoint.
            after_save: A save is in flight: wait for its commit first (nothing is removed if it fails).

        Rank 0 only.
        """
        if not self.mirrors(remote.parent()):  # not a directory of this tier: nothing of it is local
            remote.remove()
            return
        self.resume()
        version = version_of(local_marker(self.local_twin(remote)))
        with self.uploader.cond:
            after = [{"name": n, "version": v} for n, v in self.uploader.saving.items()] if after_save else None
        task = Task("remove", remote.name, version=version)
        task.seq = self.journal.add_removal(remote.name, version, after or None).seq
        if after:
            with self.uploader.cond:
                self.uploader.held.append(task)
            return
        self._release_removal(task)

    def _release_removal(self, task: Task) -> None:
        """Remove the local copy asked to go (not a version saved since), and queue the remote removal."""
        local = self.local.child(task.name)
        with self.uploader.cond:
            busy = task.name in self.uploader.saving
            queue = self.uploader.queue
            self.uploader.queue = type(queue)(t for t in queue if not (t.kind == "upload" and t.name == task.name))
        if not busy and task.version is not None and same_checkpoint(local_marker(local), task.version):
            remove_committed(local)
        with self.uploader.cond:
            self.uploader.enqueue([task])

    def link(self, pointer: Location, target: Location) -> None:
        """Make the remote ``pointer`` (``save_last="link"``) designate ``target`` once ``target`` is uploaded.

        The uploader writes it behind that upload: the training loop never waits for the remote store, and the remote
        pointer never names a checkpoint the remote store does not have. Rank 0 only.
        """
        self.resume()
        task = Task("link", pointer.name, target=target.name)
        task.seq = self.journal.add_link(pointer.name, target.name).seq
        u = self.uploader
        with u.cond:
            older = [t for t in [*u.queue, *u.held] if t.kind == "link" and t.name == task.name]
            u.queue = type(u.queue)(t for t in u.queue if t not in older)
            u.held = [t for t in u.held if t not in older]
            if target.name in u.saving:  # its save is still in flight: its commit queues the upload first
                u.held.append(task)
            else:
                u.enqueue([task])
        for superseded in older:
            self.journal.done(superseded.seq)

    def defer(self, call: Callable[[], Any], *, what: str) -> None:
        """Run ``call`` (remote clean-up) in the uploader, in order, retried while the store is unreachable. Rank 0."""
        self.resume()
        with self.uploader.cond:
            self.uploader.enqueue([Task("call", what, call=call)])

    def resume(self) -> None:
        """Queue what a previous run left unfinished (journaled removals and pointers, uploads), once. Rank 0 only."""
        if self._resumed or self.remote_dir() is None:
            return
        self._resumed = True
        self.uploader.remote_dir = self.remote_dir()
        for name, kind in self.local.entries(follow_links=False):
            if kind == "directory" and name.startswith(SNAPSHOT_PREFIX):
                shutil.rmtree(self.local.child(name).path, ignore_errors=True)
        self.journal.open()
        links: dict[str, Task] = {}
        removals = []
        for intent in self.journal.pending():
            if intent.op == "link":
                if intent.name in links:
                    self.journal.done(links[intent.name].seq)  # superseded by a later write
                links[intent.name] = Task("link", intent.name, target=intent.target, seq=intent.seq)
                continue
            if intent.after is not None:  # it waited for saves of the run that ended: only if they committed
                if not all(_saved(self.local.child(a["name"]), a["version"]) for a in intent.after):
                    self.journal.done(intent.seq)
                    continue
                self.journal.release(intent.seq)
            removals.append(Task("remove", intent.name, version=intent.version, seq=intent.seq))
        for task in removals:  # local copies asked to go leave first: they are never uploaded again
            local = self.local.child(task.name)
            if task.version is not None and same_checkpoint(local_marker(local), task.version):
                remove_committed(local)
        uploads = [Task("upload", loc.name) for _, loc in reversed(committed_checkpoints(self.local))]  # oldest first
        with self.uploader.cond:
            self.uploader.enqueue([Task("listing"), *uploads, *links.values(), *removals, Task("evict")])

    # -------------------------------------------------------------------------------------------- queue state
    def pending(self) -> set[str]:
        """Names with an upload queued, running or failed (their remote prefix may be partly written). Rank 0."""
        u = self.uploader
        with u.cond:
            tasks = [*u.queue, *([u.active] if u.active else []), *(t for t, _ in u.failed.values())]
            return {t.name for t in tasks if t.kind == "upload"}

    def finish_at_exit(self, deadline: float) -> None:
        """The exit's ``"work"`` (:mod:`~lightning_dcp.engine.shutdown`): wait for the queued uploads.

        A script that ends without closing its checkpointer still gets its uploads: :meth:`wait` runs while any is
        queued (``deadline`` is the exit's; the wait keeps its own, :attr:`Retry.at_teardown`). What cannot finish is
        named in an error line; nothing raises.
        """
        if not self.pending():
            return
        started = time.monotonic()
        try:
            self.wait()
        except CheckpointError as err:
            log.error("lightning_dcp: uploads of the local tier did not finish at exit: %s", err)
        else:
            log.warning(
                "lightning_dcp: the process began to exit with uploads of the local tier queued; waited %.2f s"
                " for them.",
                time.monotonic() - started,
            )

    def wait(self) -> None:
        """Retry failed work once, then block until the queue is empty. Any rank (no-op where nothing queued).

        The wait ends at one deadline: :attr:`Retry.at_teardown` seconds after this call or after the store's last
        answer, whichever is later (a store that answers nothing, failing or hanging, is given up on then).

        Raises:
            StorageUnavailableError: The store stayed unreachable; what is left stays committed and journaled in
                ``local_dir``, and the next run with the same ``local_dir`` finishes it.
            CheckpointError: Uploads that still fail (their checkpoints stay committed in ``local_dir``; the next
                run with the same ``local_dir`` uploads them).
        """
        u, started = self.uploader, time.monotonic()
        outage = u.drain(patience=0.0 if self._gave_up is not None else self.retry.at_teardown)
        if outage is not None:
            if self._gave_up is not None:  # Lightning tears down again after an error: no second wait, same error
                raise self._gave_up
            left = sorted(self.pending())
            now = time.monotonic()
            self._gave_up = StorageUnavailableError(
                f"The remote store of {self.remote_dir().url!r} has been unreachable for {now - outage.since:.0f} s"
                f" ({type(outage.error).__name__}: {outage.error}); the wait for the uploads ended after"
                f" {now - started:.0f} s without an answer. Not uploaded yet: {left}; they stay committed in the local"
                f" tier {self.local.url!r}, and the removals and pointer writes left are journaled there: a run with"
                " the same `local_dir` finishes them."
            )
            raise self._gave_up
        with u.cond:
            failed = {key: err for key, (_, err) in u.failed.items()}
        if failed:
            detail = "; ".join(f"{key}: {err}" for key, err in failed.items())
            raise CheckpointError(
                f"Work of the local tier {self.local.url!r} failed ({len(failed)}): {detail}. Checkpoints stay"
                " committed there; a run with the same `local_dir` uploads them."
            )

    def remove_incomplete(self) -> list[str]:
        """Delete uncommitted directories, staging and upload snapshots of the local tier. Returns their URLs.

        Call when no save is in flight. Rank 0 only.
        """
        removed = []
        with self.uploader.cond:
            u = self.uploader
            busy = {t.name for t in [*u.queue, u.active] if t is not None}
        for name, kind in self.local.entries(follow_links=False):
            entry = self.local.child(name)
            hidden = is_internal_name(name)
            stale = hidden and not any(name.startswith(snapshot_prefix(b)) for b in busy)
            if kind == "directory" and (stale or (not name.startswith(".") and not entry.is_committed())):
                entry.remove()
                removed.append(entry.url)
        return removed


def _saved(location: Location, before: dict | None) -> bool:
    """Whether ``location`` is committed with another version than ``before`` (a save to it finished)."""
    now = local_marker(location)
    return now is not None and not same_checkpoint(now, before)


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")
