"""Storage: every read, write, list, rename and delete of a checkpoint path goes through fsspec here.

Checkpoint ids are ``str`` end to end (a local path or any fsspec URL); local vs remote is decided once, by
``fsspec.core.url_to_fs``, and ``storage_options`` travel with the :class:`Location` into every call, DCP's
writer and reader included. This module also owns the commit step (staging directory -> final path), checkpoint
pointers (how ``last.ckpt`` designates a checkpoint without a symlink) and the translation of storage errors
(denied credentials, missing bucket) into :class:`~lightning_dcp.errors.CheckpointError`.

Commit on object stores (S3, GCS, ...), where no directory rename exists:

- A save to a new name writes straight into the final prefix. DCP's coordinator writes ``.metadata`` (on S3 as
  ``.metadata.tmp`` + server-side copy, each object appearing atomically) and then ``.commit``, only after every
  rank finished; a prefix without ``.commit`` is never loaded and is removed later. No byte is copied.
- A save over an existing name writes into a hidden staging prefix first. Committing invalidates the old
  checkpoint (its ``.commit`` is deleted first), deletes it, copies the staging objects server-side (no data
  through this host) with ``.commit`` last, and deletes the staging prefix. A crash inside that window leaves the
  complete staging prefix, which :meth:`Location.resolve` rolls forward to. The price is one server-side copy of
  the checkpoint and twice its size for a moment; ``DCPModelCheckpoint`` avoids it by never rewriting a name
  (``last.ckpt`` is a pointer).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Iterator
from typing import Any

import fsspec
import fsspec.callbacks
from fsspec.implementations.local import LocalFileSystem

from lightning_dcp.engine.format.marker import (
    COMMIT_FILE,
    LIGHTNING_META_FILE,
    METADATA_FILE,
    checkpoint_kind,
)
from lightning_dcp.engine.storage import localfs
from lightning_dcp.engine.storage.commit_reads import permission_message, read_commit, unreadable
from lightning_dcp.engine.storage.localfs import STAGING_INFIX, fsync_dir
from lightning_dcp.engine.storage.names import is_staging_name, is_staging_of, staging_name
from lightning_dcp.engine.storage.paths import canonical_url
from lightning_dcp.engine.storage.pointers import POINTER_HEADER, Pointers
from lightning_dcp.engine.storage.stores import (
    access_message,
    bucket_message,
    check_storage_options,
    credentials_message,
    forget_listings,
    is_missing_credentials,
    is_refusal,
    is_unreachable,
    unreachable_message,
    with_timeouts,
)
from lightning_dcp.errors import (
    BucketNotFoundError,
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
    StorageAccessError,
    StorageUnavailableError,
)

__all__ = [
    "COMMIT_FILE",
    "METADATA_FILE",
    "POINTER_HEADER",
    "STAGING_INFIX",
    "Location",
    "fsync_dir",
    "new_token",
    "permission_message",
    "read_commit",
    "unreadable",
]


def new_token() -> str:
    """A fresh random token (12 hex characters) that names one save's staging directory."""
    return localfs.new_token()


class Location(Pointers):
    """One checkpoint path resolved through fsspec.

    Every method is a plain (non-collective) storage call: run it where the caller decided (rank 0 for anything
    that changes storage or decides for all ranks). Storage failures surface as :class:`StorageAccessError` (the
    server refused the credentials) or :class:`BucketNotFoundError`, both naming the bucket and the fix.

    Args:
        path: Local path or fsspec URL (``s3://bucket/run/step=10.ckpt``). ``os.PathLike`` is accepted and turned
            into ``str``; URLs are never passed through ``pathlib``. Put in canonical form first
            (:func:`~lightning_dcp.engine.storage.paths.canonical_url`: ``s3://b/exp//run`` is ``s3://b/exp/run``).
        storage_options: Keyword arguments for the fsspec filesystem (credentials, endpoint, region). On S3 a
            timeout for every request is filled in where not given
            (:data:`~lightning_dcp.engine.storage.stores.S3_TIMEOUTS`): a stalled server fails a call in bounded time.

    Raises:
        InvalidPathError: ``path`` cannot round-trip through its store (``..`` segments, ``?`` in an S3 key, ...).
    """

    def __init__(self, path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> None:
        check_storage_options(storage_options)
        self.url = canonical_url(path)
        self.storage_options = with_timeouts(self.url, dict(storage_options or {}))
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Location({self.url!r})"  # never the storage options: they may hold secrets

    # ----------------------------------------------------------------------------------------------- queries
    def join(self, name: str) -> str:
        """The fsspec path (no protocol) of ``name`` inside this location."""
        return self.path.rstrip("/") + "/" + name

    def at(self, url: str | os.PathLike) -> Location:
        """The location ``url`` (another checkpoint, another store's path) with this one's storage options."""
        return Location(url, storage_options=self.storage_options)

    def child(self, name: str) -> Location:
        """The location ``name`` inside this one (same protocol and options)."""
        return self.at(self.url.rstrip("/") + "/" + name)

    def exists(self) -> bool:
        """Whether anything (file, directory or link) exists at this path.

        Raises:
            BucketNotFoundError: The path's bucket does not exist (rather than answering ``False``).
            StorageAccessError: The server refused the credentials.
        """
        if self.local:
            return os.path.lexists(self.path)
        with self._translated():
            found = self.fs.exists(self.path)
            if not found:
                self._check_bucket()
            return found

    def isdir(self) -> bool:
        """Whether this path is a directory (a DCP checkpoint is one)."""
        with self._translated():
            return self.fs.isdir(self.path)

    def has_metadata(self) -> bool:
        """Whether DCP's ``.metadata`` is present."""
        with self._translated():
            return self.fs.exists(self.join(METADATA_FILE))

    def is_committed(self) -> bool:
        """Whether this is a checkpoint directory whose save finished (its ``.commit`` marker exists)."""
        with self._translated():
            return self.fs.exists(self.join(COMMIT_FILE))

    def is_lightning_sharded(self) -> bool:
        """Whether this directory holds Lightning's own sharded layout (its non-tensor state file beside DCP's)."""
        with self._translated():
            return self.fs.exists(self.join(LIGHTNING_META_FILE))

    def lightning_meta(self) -> Location:
        """The file of Lightning's own sharded layout that holds its non-tensor Trainer state (``torch.save``)."""
        return self.child(LIGHTNING_META_FILE)

    @property
    def marker_url(self) -> str:
        """The URL of this checkpoint's ``.commit`` marker (no I/O)."""
        return self.url.rstrip("/") + "/" + COMMIT_FILE

    def checkpoint_kind(self, names: Collection[str] | None = None) -> str | None:
        """``"dcp"``, ``"lightning"`` or ``None``: what this directory's entries make it.

        See :func:`~lightning_dcp.engine.format.marker.checkpoint_kind`. ``None`` for nothing there.

        Args:
            names: The directory's entries, when the caller listed them already; by default one listing.
        """
        if names is None:
            names = {name for name, _ in self.entries(follow_links=False)}
        return checkpoint_kind(names)

    def download(self, local_path: str) -> None:
        """Copy this committed checkpoint's files (those its ``.commit`` names) into the local directory ``local_path``.

        Needs no directory listing or range request (a plain HTTP server): the marker names every file. The files
        are checked against their checksums when they are loaded, not here.

        Raises:
            NotACheckpointError: There is no ``.commit`` marker: no committed checkpoint.
        """
        marker = read_commit(self)
        if marker is None:
            raise NotACheckpointError(f"{self.url!r} has no {COMMIT_FILE!r} marker: it is no committed checkpoint.")
        os.makedirs(local_path, exist_ok=True)
        for name in [COMMIT_FILE, METADATA_FILE, *marker["files"]]:  # the server's own errors: a 404 names the URL
            self.fs.get_file(self.join(name), os.path.join(local_path, name))

    def open(self, name: str | None = None, mode: str = "rb") -> Any:
        """Open this path (or ``name`` inside it) as a binary file object; writing creates local parents.

        A local file opened for reading must be a regular file (after links): a FIFO, socket or device would block
        or never end, so it is refused at once.

        Raises:
            CorruptCheckpointError: A local path to read is a FIFO, socket or device (the error names it).
        """
        path = self.path if name is None else self.join(name)
        if self.local and mode.startswith(("w", "a", "x")):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if self.local and mode in ("r", "rb"):
            try:
                return localfs.open_regular(path)
            except localfs.NotARegularFile as err:
                shown = f"{self.url}/{name}" if name is not None else self.url
                raise CorruptCheckpointError(
                    f"{shown!r} is {err.kind}, not a regular file: a checkpoint holds only regular files, and reading"
                    " this one could block forever. Remove or replace it (or resume from another checkpoint).",
                    file=name or self.name,
                ) from None
        with self._translated():
            return self.fs.open(path, mode)

    def entries(self, *, follow_links: bool = True) -> list[tuple[str, str]]:
        """``(name, type)`` of each entry directly inside this directory (``type``: ``"file"``/``"directory"``).

        Args:
            follow_links: Report a local symlink as what it points to (default); with ``False`` its type is
                ``"link"``, whatever it points to (or when it dangles).

        Returns an empty list when the directory does not exist.
        """
        with self._translated():
            try:
                listing = self.fs.ls(self.path.rstrip("/") or "/", detail=True)
            except (FileNotFoundError, NotADirectoryError):
                self._check_bucket()
                return []
        own = self.path.rstrip("/")
        out = []
        for entry in listing:
            path = entry["name"].rstrip("/")
            if path == own:
                continue
            kind = "directory" if entry["type"] == "directory" else "file"
            if not follow_links and (entry.get("islink") or (self.local and os.path.islink(path))):
                kind = "link"
            out.append((path.rsplit("/", 1)[-1], kind))
        return out

    def read_ends(self, names: list[str], nbytes: int) -> list[bytes | OSError | CheckpointError]:
        """The last ``nbytes`` bytes (or all, when shorter) of each file ``names[i]`` below this directory, in order.

        An object store is asked with one ranged request per file, all in flight together (fsspec's ``cat_ranges``
        with a negative start: a suffix range, no size lookup first); where its library takes no suffix range
        (adlfs), and in a local directory, file by file. A file that cannot be read gives its ``OSError`` in its
        place (``FileNotFoundError`` when it is absent), a local one that is no regular file (a FIFO) its
        ``CorruptCheckpointError``; any other failure of the store is raised (as a ``CheckpointError`` naming the
        fix where it is one the library recognises).
        """
        found: list[Any] = [None] * len(names)
        if not self.local and type(self.fs) not in _NO_SUFFIX_RANGES:
            with self._translated():
                found = self.fs.cat_ranges([self.join(n) for n in names], -nbytes, None, on_error="return")
        out: list[bytes | OSError | CheckpointError] = []
        for name, got in zip(names, found, strict=True):
            if isinstance(got, (bytes, OSError)):
                out.append(got)
                continue
            try:
                if self.local:
                    f = self.open(name)  # refuses a FIFO, a socket or a device
                else:
                    f = self.fs.open(self.join(name), "rb")
                with f:
                    f.seek(max(0, f.seek(0, 2) - nbytes))
                    out.append(f.read(nbytes))
            except CheckpointError as err:
                out.append(err)  # this file only: a FIFO, a socket, a device where a marker should be
            except OSError as err:
                out.append(err)  # absent, or unreadable: the caller reads it whole, which names why
            except Exception:
                with self._translated():
                    raise  # the store's refusal or outage, named
            else:
                if isinstance(got, (ValueError, NotImplementedError, TypeError)):
                    _NO_SUFFIX_RANGES.add(type(self.fs))  # the range was refused, the file is fine: no more tries
        return out

    def sizes(self) -> dict[str, int]:
        """``{name: bytes}`` of each file directly inside this directory (one fresh listing); ``{}`` when absent."""
        with self._translated():
            try:
                listing = self.fs.ls(self.path.rstrip("/") or "/", detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in listing if e["type"] == "file"
        }

    def parent(self) -> Location:
        """The directory holding this path (same protocol and options)."""
        url = self.url.rstrip("/")
        return self.at(url.rsplit("/", 1)[0] if "/" in url else ".")

    def sibling(self, name: str) -> Location:
        """The location named ``name`` in the same parent directory (same protocol and options)."""
        parent = self.url.rstrip("/").rsplit("/", 1)[0] if "/" in self.url.rstrip("/") else "."
        return self.at(parent + "/" + name)

    @property
    def name(self) -> str:
        """The last path component."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def bucket(self) -> str | None:
        """The bucket (first path component) on object stores; ``None`` on local and hierarchical filesystems."""
        if self.local or self.fs.root_marker:
            return None
        return self.path.lstrip("/").split("/", 1)[0] or None

    # ------------------------------------------------------------------------------------------------ changes
    def remove(self) -> None:
        """Delete this path (directory tree, file or link) if it exists; a link never deletes its target.

        A checkpoint's ``.commit`` marker goes first, so a removal cut short (a kill, a lost connection) leaves an
        uncommitted directory, never a marker that vouches for files already deleted.
        """
        if self.local:
            if os.path.isdir(self.path) and not os.path.islink(self.path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.join(COMMIT_FILE))
            localfs.remove_path(self.path)
            return
        with self._translated():
            if not self.fs.exists(self.path):
                return
            with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
                self.fs.rm_file(self.join(COMMIT_FILE))
            self.fs.rm(self.path, recursive=True)
            self.fs.invalidate_cache(self.path)
            # Some S3 servers (SeaweedFS) keep an emptied "directory" listed until its own key is deleted.
            with contextlib.suppress(FileNotFoundError, OSError):
                if self.fs.exists(self.path):
                    self.fs.rm_file(self.path.rstrip("/"))
            self.fs.invalidate_cache(self.path)

    def put(self, files: dict[str, str], *, progress: Callable[[], None] | None = None) -> None:
        """Upload local files into this directory: ``{name inside it: local path}``. Rank 0 only.

        Transfers run concurrently where the storage library does (``fs.put`` of a list: s3fs, gcsfs and adlfs run a
        batch at once; s3fs also uploads the parts of a large file concurrently). ``progress()`` is called (from the
        storage library's threads) whenever the store took a file or a part of one.
        """
        names = sorted(files)
        if self.local:
            os.makedirs(self.path, exist_ok=True)
        callback = _Progress(progress) if progress is not None else fsspec.callbacks.DEFAULT_CALLBACK
        with self._translated():
            self.fs.put([files[n] for n in names], [self.join(n) for n in names], callback=callback)

    def remove_file(self, name: str) -> None:
        """Delete the file ``name`` inside this directory; nothing happens when it does not exist."""
        path = self.join(name)
        if self.local:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(path)
            return
        with self._translated(), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def staging(self, token: str | None = None) -> Location:
        """The hidden sibling directory a save writes into before it is committed to this path.

        Args:
            token: Names this save's staging (12 hex characters, :func:`new_token`); a fresh one when ``None``.
        """
        return self.sibling(staging_name(self.name, new_token() if token is None else token))

    def remove_stale_staging(self, *, keep: str | None = None) -> list[str]:
        """Delete staging directories of earlier, interrupted saves to this path. Returns the URLs removed."""
        kept = None if keep is None else staging_name(self.name, keep)
        removed = []
        for name, _ in self.sibling("").entries():
            if is_staging_of(name, self.name) and name != kept:
                stale = self.sibling(name)
                stale.remove()
                removed.append(stale.url)
        return removed

    def remove_incomplete(self, suffix: str, *, busy: Collection[str] = ()) -> list[str]:
        """Clean this directory after crashed saves: its checkpoints whose save did not finish, and all staging.

        Each visible subdirectory named ``*suffix`` without a ``.commit`` is deleted, or, where its staging sibling
        of an interrupted overwrite is committed, completed from it (:meth:`commit_from`); then every staging
        directory left by any save, replace or copy is deleted. Entries of the checkpoints named in ``busy`` (an
        upload still writing them) are left alone. Call when no save to this directory is in flight; rank 0 only.

        Returns:
            The URLs removed.
        """
        removed = []
        for name, kind in sorted(self.entries()):
            if kind != "directory" or not name.endswith(suffix) or name.startswith(".") or name in busy:
                continue
            location = self.child(name)
            if location.is_committed():
                continue
            rolled = location.resolve()
            if rolled.url != location.url:
                location.commit_from(rolled)
            else:
                location.remove()
                removed.append(location.url)
        for name, kind in sorted(self.entries()):
            if kind == "directory" and is_staging_name(name) and not any(is_staging_of(name, b) for b in busy):
                stale = self.child(name)
                stale.remove()
                removed.append(stale.url)
        return removed

    def commit_from(self, staging: Location) -> None:
        """Make the complete checkpoint in ``staging`` visible at this path, replacing what was here.

        Locally this is a rename (an atomic exchange when something already exists, so the old checkpoint stays
        until the new one is in place). On object stores see the module docstring: the old checkpoint is
        invalidated (``.commit`` first) and deleted, the staging objects are copied server-side with ``.commit``
        last, then the staging prefix is deleted. Rank 0 only.

        Raises:
            NotACheckpointError: ``staging`` holds no committed checkpoint.
        """
        if self.local:
            localfs.replace_directory(staging.path, self.path)
            return
        with self._translated():
            files = staging.fs.find(staging.path, detail=True)
            names = {p[len(staging.path.rstrip("/")) + 1 :]: p for p, info in files.items() if info["type"] == "file"}
            if COMMIT_FILE not in names:
                raise NotACheckpointError(f"{staging.url!r} has no {COMMIT_FILE!r}: nothing complete to commit.")
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.join(COMMIT_FILE))  # from here on, no reader takes the old checkpoint
            self.remove()
            order = sorted(names, key=lambda n: (n == COMMIT_FILE, n == METADATA_FILE, n))
            for rel in order:
                self.fs.copy(names[rel], self.join(rel))
            self.fs.invalidate_cache(self.path)
        staging.remove()

    # ------------------------------------------------------------------------------------------------ errors
    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        """Start from fresh listings; turn the storage library's refusals into errors naming the fix.

        Both differ between object stores: see the notes of :mod:`lightning_dcp.engine.storage.stores`.
        """
        if not self.local:
            forget_listings(self.fs, self.path)
        try:
            yield
        except CheckpointError:
            raise
        except FileNotFoundError as err:
            if self.bucket is not None and "bucket" in str(err).lower():
                raise BucketNotFoundError(bucket_message(self.url, self.bucket, self._protocol())) from err
            raise
        except Exception as err:
            if is_missing_credentials(err):
                raise StorageAccessError(credentials_message(self.url, self._protocol(), err)) from err
            if is_refusal(err):
                if self.local:
                    shown = getattr(err, "filename", None) or self.url
                    raise StorageAccessError(permission_message(str(shown))) from err
                raise StorageAccessError(access_message(self.url, self.bucket, self._protocol(), err)) from err
            if not self.local and is_unreachable(err):
                raise StorageUnavailableError(unreachable_message(self.url, self._protocol(), err)) from err
            raise

    def _check_bucket(self) -> None:
        bucket = self.bucket
        if bucket is None or (id(self.fs), bucket) in _KNOWN_BUCKETS:
            return
        if not self.fs.exists(bucket):
            raise BucketNotFoundError(bucket_message(self.url, self.bucket, self._protocol()))
        _KNOWN_BUCKETS.add((id(self.fs), bucket))

    def _protocol(self) -> str:
        if "://" in self.url:  # as the user wrote it ("az", not adlfs' first name "abfs")
            return self.url.split("://", 1)[0]
        return self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]


_KNOWN_BUCKETS: set[tuple[int, str]] = set()
_NO_SUFFIX_RANGES: set[type] = set()
"""Filesystem classes whose ``cat_file`` refused a negative start (a suffix range, e.g. adlfs):
:meth:`Location.read_ends` reads their files one by one."""


class _Progress(fsspec.callbacks.Callback):
    """An fsspec callback that calls ``hook()`` whenever a transfer advances: a file taken, or a part of one.

    The children of a transfer of several files (``branched``) report to the same hook.
    """

    def __init__(self, hook: Callable[[], None]) -> None:
        super().__init__()
        self._hook = hook

    def call(self, *args: Any, **kwargs: Any) -> None:
        self._hook()

    def branched(self, path_1: str, path_2: str, **kwargs: Any) -> _Progress:
        return self
