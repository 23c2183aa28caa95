"""Tiered checkpoints: a local directory as the fast tier of a remote checkpoint directory.

A save to a remote path (``s3://bucket/run/epoch=3.ckpt``) is written and committed in the local tier
(``local_dir/epoch=3.ckpt``) at disk speed, synchronously or in the background as any save; once committed there, a
background uploader (one thread on rank 0, one upload at a time) copies it to the remote path, verifies it and commits
it there (:mod:`lightning_dcp.engine.upload`). The protocol of :class:`~lightning_dcp.engine.checkpointer.Checkpointer`
is unchanged: it calls :meth:`Tiers.prepare` before a save, :meth:`Tiers.committed` after the local commit, and routes
loads and removals of remote paths here.

What holds, whatever is killed when:

- Resume: the restarted run re-queues every committed local checkpoint whose remote copy is not committed with the
  same marker (at its first save or load, or when ``DCPModelCheckpoint`` sets up); leftovers of a cut-short upload
  are never loaded and are replaced.
- Loads: the newest checkpoint committed on either tier; the local copy first when both hold the same checkpoint
  (the same ``.commit``), the remote copy next (also when the local copy turns out damaged).
- Removals (top-k pruning, ``save_last`` replacement) apply to both tiers and run in the upload queue, behind the
  uploads queued before them: the remote store always holds the successor before a checkpoint leaves it. A removal
  requested while a save is in flight waits for its commit (and is dropped if it fails, as without tiers); removals
  wait while an upload is failing. A queued upload of a checkpoint being removed is skipped.
- The local tier keeps the newest ``keep`` checkpoints; older ones leave it only once committed remotely, so it may
  hold more while uploads fall behind.

A local tier mirrors one remote directory, recorded in ``local_dir/.lightning_dcp-tier.json``; every rank must write
to the same ``local_dir`` filesystem (one machine, or a shared filesystem).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

from lightning_dcp.engine.integrity import committed_checkpoints
from lightning_dcp.engine.lookup import candidates as one_tier_candidates
from lightning_dcp.engine.lookup import designates_last
from lightning_dcp.engine.marker import COMMIT_FILE, order_key
from lightning_dcp.engine.storage import STAGING_INFIX, Location, new_token
from lightning_dcp.engine.upload import SNAPSHOT_PREFIX, marker_of, remove_committed, same_checkpoint, snapshot, upload
from lightning_dcp.errors import CheckpointError

__all__ = ["MANIFEST_FILE", "Tiers"]

log = logging.getLogger(__name__)

MANIFEST_FILE = ".lightning_dcp-tier.json"
"""In ``local_dir``: ``{"remote": "<the remote directory this tier mirrors>"}``, written at the first save."""


@dataclasses.dataclass(eq=False)
class _Task:
    kind: Literal["upload", "remove", "evict", "link"]
    name: str = ""
    remote: Location | None = None
    marker: dict[str, Any] | None = None  # removals: the local copy's marker when the removal was asked for
    target: Location | None = None  # links: the checkpoint the pointer ``remote`` designates


class Tiers:
    """A local directory that takes saves at disk speed and replicates them to a remote directory in the background.

    Args:
        local_dir: Local directory of the fast tier (created when needed).
        keep: Committed checkpoints the local tier keeps (the newest); older ones are evicted once uploaded.
        storage_options: fsspec options of the remote store, for uploads resumed before the first save.

    Raises:
        ValueError: ``local_dir`` is not a local path, or ``keep`` is not a positive integer.
    """

    def __init__(self, local_dir: str | os.PathLike, *, keep: int = 2, storage_options: dict | None = None) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"`local_keep` must be a positive integer, got {keep!r}.")
        if not Location(os.fspath(local_dir)).local:
            raise ValueError(f"`local_dir` must be a directory on a local disk, got {os.fspath(local_dir)!r}.")
        self.local = Location(os.path.abspath(Location(os.fspath(local_dir)).path))  # "file://" and "~" resolved
        self.keep = keep
        self.storage_options = dict(storage_options or {})
        self._cond = threading.Condition()
        self._queue: collections.deque[_Task] = collections.deque()
        self._active: _Task | None = None
        self._failed: dict[str, tuple[Location, BaseException]] = {}
        self._held: list[_Task] = []  # removals waiting for the save in flight to commit
        self._saving: set[str] = set()  # names being saved locally: never evicted or removed meanwhile
        self._deferred: list[_Task] = []  # removals waiting for failed uploads to succeed
        self._thread: threading.Thread | None = None
        self._remote: Location | None = None
        self._resumed = False
        self.last_upload_seconds: float | None = None
        """Seconds the last upload took, from its snapshot to its remote commit (rank 0)."""
        self.last_upload_bytes: int | None = None
        """Bytes the last upload sent (every file of the checkpoint)."""

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

    def _twins(self, location: Location) -> tuple[Location, Location] | None:
        """``(local, remote)`` copies of the checkpoint at ``location`` (either side), when this tier mirrors it."""
        if location.local:
            if os.path.dirname(os.path.abspath(location.path)) != self.local.path or self.remote_dir() is None:
                return None
            return location, self.remote_dir().child(location.name)
        return (self.local_twin(location), location) if self.mirrors(location.parent()) else None

    # ------------------------------------------------------------------------------------ save hooks (rank 0)
    def prepare(self, remote: Location) -> None:
        """Before a save to ``remote``: bind the tier to its directory (first save) and resume pending uploads.

        Rank 0 only.

        Raises:
            CheckpointError: ``local_dir`` already mirrors another remote directory.
        """
        directory = remote.parent()
        bound = self.remote_dir()
        if bound is not None and not _same_url(bound.url, directory.url):
            raise CheckpointError(
                f"`local_dir` {self.local.url!r} is the local tier of {bound.url!r}, not of {directory.url!r}. Give"
                f" each remote directory its own `local_dir` (or delete {MANIFEST_FILE} there once its uploads are"
                " done)."
            )
        if bound is None:
            os.makedirs(self.local.path, exist_ok=True)
            tmp = os.path.join(self.local.path, f".{MANIFEST_FILE}{STAGING_INFIX}{new_token()}")
            with open(tmp, "w") as f:
                json.dump({"remote": directory.url.rstrip("/")}, f)
            os.replace(tmp, os.path.join(self.local.path, MANIFEST_FILE))
        self._remote = directory  # with this call's storage options
        with self._cond:
            self._saving.add(remote.name)
        self.resume()

    def committed(self, remote: Location) -> None:
        """The local copy of ``remote`` is committed: queue its upload, then the removals held behind the save.

        Rank 0 only (called in the background thread of an async save).
        """
        with self._cond:
            self._saving.discard(remote.name)
            self._requeue_failed()
            self._enqueue(_Task("upload", remote.name, remote))
            self._queue.extend(self._held)
            self._held.clear()
            self._cond.notify_all()

    def abandoned(self, remote: Location) -> None:
        """The save to ``remote`` failed: the removals requested behind it are dropped (nothing succeeds). Rank 0."""
        with self._cond:
            self._saving.discard(remote.name)
            self._held.clear()

    def remove(self, remote: Location, *, after_save: bool) -> None:
        """Delete the checkpoint ``remote`` from both tiers, behind the uploads queued before.

        Args:
            remote: The remote path of the checkpoint.
            after_save: A save is in flight: wait for its commit first (its upload goes first).

        Rank 0 only.
        """
        task = _Task("remove", remote.name, remote, _marker(self.local_twin(remote)))
        with self._cond:
            if after_save:
                self._held.append(task)
                return
            self._queue = collections.deque(t for t in self._queue if not (t.kind == "upload" and t.name == task.name))
            self._enqueue(task)
            self._cond.notify_all()

    def link(self, pointer: Location, target: Location) -> None:
        """Make the remote ``pointer`` (``save_last="link"``) designate ``target`` once ``target`` is uploaded.

        The uploader writes it behind that upload: the training loop never waits for the remote store, and the remote
        pointer never names a checkpoint the remote store does not have yet. Rank 0 only.
        """
        task = _Task("link", pointer.name, pointer, target=target)
        with self._cond:
            self._queue = collections.deque(t for t in self._queue if not (t.kind == "link" and t.name == task.name))
            if target.name in self._saving:  # its save is still in flight: after its commit queues the upload
                self._held = [t for t in self._held if not (t.kind == "link" and t.name == task.name)] + [task]
                return
            self._enqueue(task)
            self._cond.notify_all()

    def resume(self) -> None:
        """Queue the uploads that a previous run left unfinished (once per process). Rank 0 only."""
        if self._resumed or self.remote_dir() is None:
            return
        self._resumed = True
        for name, kind in self.local.entries(follow_links=False):
            if kind == "directory" and name.startswith(SNAPSHOT_PREFIX):
                shutil.rmtree(self.local.child(name).path, ignore_errors=True)
        remote_dir = self.remote_dir()
        with self._cond:  # the uploader skips those already committed remotely: the caller never waits for the remote
            for _, local in reversed(committed_checkpoints(self.local)):  # oldest first
                self._enqueue(_Task("upload", local.name, remote_dir.child(local.name)))
            self._enqueue(_Task("evict"))
            self._cond.notify_all()

    # ----------------------------------------------------------------------------------------- loads (rank 0)
    def checkpoints(self, remote_dir: Location) -> list[tuple[float, Location]]:
        """Committed checkpoints of ``remote_dir`` and of the local tier (when it mirrors it), newest first.

        The same checkpoint on both tiers (the same ``.commit``) appears twice, its local copy first. Rank 0 only.
        """
        found = []
        if self.mirrors(remote_dir) and os.path.isdir(self.local.path):
            found = [(t, 0, loc) for t, loc in committed_checkpoints(self.local)]
        found += [(t, 1, loc) for t, loc in _reachable(remote_dir, committed_checkpoints, [], bool(found))]
        found.sort(key=lambda entry: (entry[0], -entry[1], entry[2].name), reverse=True)
        return [(t, loc) for t, _, loc in found]

    def candidates(self, location: Location) -> list[str]:
        """:func:`lightning_dcp.engine.loading.candidates` over both tiers: what a load of ``location`` tries.

        A ``last*`` name or a ``.commit`` (in either tier's directory): every committed checkpoint of both tiers,
        newest first, local copies first. An explicit checkpoint: its committed copies, newest first, local first.
        Rank 0 only.
        """
        self.resume()
        if designates_last(location):
            directory = location.parent().parent() if location.name == COMMIT_FILE else location.parent()
            if directory.local and _same_url(os.path.abspath(directory.path), self.local.path):
                directory = self.remote_dir() or directory
            found = self.checkpoints(directory) if not directory.local else []
            return [loc.url for _, loc in found] or one_tier_candidates(location)
        resolved = location
        if not location.local:  # follow pointers; while the remote cannot be read, a local copy of the name serves
            local = self.local_twin(location) if self.mirrors(location.parent()) else None
            resolved = _reachable(location, Location.resolve, location, local is not None and _marker(local))
        twins = self._twins(resolved)
        if twins is None:
            return one_tier_candidates(location)
        local_marker = _marker(twins[0])
        copies = [(local_marker, 0, twins[0]), (_reachable(twins[1], _marker, None, local_marker), 1, twins[1])]
        committed = sorted(((order_key(m), -rank, c.url) for m, rank, c in copies if m is not None), reverse=True)
        return [url for *_, url in committed] or one_tier_candidates(location)

    # -------------------------------------------------------------------------------------------- queue state
    def pending(self) -> set[str]:
        """Names with an upload queued, running or failed (their remote prefix may be partly written). Rank 0."""
        with self._cond:
            tasks = [*self._queue, *([self._active] if self._active else [])]
            return {t.name for t in tasks if t.kind == "upload"} | set(self._failed)

    def wait(self) -> None:
        """Retry failed uploads once, then block until the queue is empty. Any rank (no-op where nothing queued).

        Raises:
            CheckpointError: Uploads that still fail (their checkpoints stay committed in ``local_dir``; the next
                run with the same ``local_dir`` uploads them).
        """
        with self._cond:
            self._requeue_failed()
            self._cond.notify_all()
            while self._queue or self._active is not None:
                self._cond.wait()
            failed = dict(self._failed)
        if failed:
            detail = "; ".join(f"{remote.url!r}: {err}" for remote, err in failed.values())
            raise CheckpointError(
                f"Uploading {len(failed)} checkpoint(s) from the local tier {self.local.url!r} failed: {detail}. They"
                " stay committed there; a run with the same `local_dir` uploads them."
            )

    def remove_incomplete(self) -> list[str]:
        """Delete uncommitted directories, staging and upload snapshots of the local tier. Returns their URLs.

        Call when no save is in flight. Rank 0 only.
        """
        removed = []
        with self._cond:
            busy = {t.name for t in [*self._queue, self._active] if t is not None}
        for name, kind in self.local.entries(follow_links=False):
            entry = self.local.child(name)
            hidden = name.startswith(".") and (STAGING_INFIX in name or name.startswith(SNAPSHOT_PREFIX))
            stale = hidden and not any(name.startswith(f"{SNAPSHOT_PREFIX}{b}-") for b in busy)
            if kind == "directory" and (stale or (not name.startswith(".") and not entry.is_committed())):
                entry.remove()
                removed.append(entry.url)
        return removed

    # ------------------------------------------------------------------------------------------------ worker
    def _enqueue(self, task: _Task) -> None:  # under the lock
        if task.kind == "upload" and any(t.kind == "upload" and t.name == task.name for t in self._queue):
            return  # one queued upload per name: it reads the newest committed version when it starts
        self._queue.append(task)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="lightning_dcp-uploader", daemon=True)
            self._thread.start()

    def _requeue_failed(self) -> None:  # under the lock
        for name, (remote, _) in list(self._failed.items()):
            if self._active is None or self._active.name != name:  # a retry under way needs no second one
                self._enqueue(_Task("upload", name, remote))

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None  # the next _enqueue starts a new worker
                    return
                task = self._active = self._queue.popleft()
            try:
                if task.kind == "upload":
                    self._upload(task)
                elif task.kind == "remove":
                    self._remove(task)
                elif task.kind == "link":
                    task.remote.write_pointer(task.target)
                else:
                    self._evict()
            except Exception as err:  # a failed upload is retried; the loop never dies
                log.warning("lightning_dcp: %s of %r in the local tier failed: %s", task.kind, task.name, err)
                if task.kind == "upload":
                    with self._cond:
                        self._failed[task.name] = (task.remote, err)
            finally:
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    def _upload(self, task: _Task) -> None:
        local = self.local_twin(task.remote)
        if not local.is_committed():
            with self._cond:
                self._failed.pop(task.name, None)
            return  # removed meanwhile, or being replaced (its commit queues it again)
        frozen = self.local.child(f"{SNAPSHOT_PREFIX}{task.name}-{new_token()}").path
        started = time.perf_counter()
        try:
            data, marker = snapshot(local, frozen)
            upload(frozen, data, marker, task.remote)
            sent = sum(os.path.getsize(os.path.join(frozen, name)) for name in os.listdir(frozen))
        finally:
            shutil.rmtree(frozen, ignore_errors=True)
        self.last_upload_seconds, self.last_upload_bytes = time.perf_counter() - started, sent
        with self._cond:
            self._failed.pop(task.name, None)
            if not self._failed:
                self._queue.extend(self._deferred)
                self._deferred.clear()
        log.info("lightning_dcp: uploaded %s to %s", local.url, task.remote.url)
        self._evict()

    def _remove(self, task: _Task) -> None:
        local = self.local_twin(task.remote)
        with self._cond:
            if self._failed:  # the successor may not be remote yet: keep every copy until uploads succeed
                self._deferred.append(task)
                return
            # Only the local version that was asked to go: not one saved under the same name since.
            if task.name not in self._saving and same_checkpoint(_marker(local), task.marker):
                remove_committed(local)
        remove_committed(task.remote)
        task.remote.remove_stale_staging()

    def _evict(self) -> None:
        remote_dir = self.remote_dir()
        if remote_dir is None or not os.path.isdir(self.local.path):
            return
        for _, local in committed_checkpoints(self.local)[self.keep :]:  # a copy committed remotely is redundant
            seen = _marker(local)
            if not same_checkpoint(seen, _marker(remote_dir.child(local.name))):
                continue
            with self._cond:  # unless that name is being saved again meanwhile
                if local.name not in self._saving and same_checkpoint(_marker(local), seen):
                    remove_committed(local)


def _reachable(remote: Location, read: Callable[[Location], Any], default: Any, fallback: Any) -> Any:
    """``read(remote)``, or ``default`` with a warning where the remote store fails and the local tier has a fallback.

    Loads go on from the local tier while the remote store cannot be reached; without a local fallback the remote
    store's error (a clear ``CheckpointError`` for refused credentials or a missing bucket) is raised.
    """
    try:
        return read(remote)
    except Exception as err:
        if not fallback:
            raise
        warnings.warn(
            f"lightning_dcp: the remote tier {remote.url!r} cannot be read ({err}); loading from the local tier only.",
            stacklevel=3,
        )
        return default


def _marker(location: Location) -> dict[str, Any] | None:
    found = marker_of(location)
    return None if found is None else found[1]


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")
