"""Storage: every read, write, list, rename and delete of a checkpoint path goes through fsspec here.

Checkpoint ids are ``str`` end to end (a local path or any fsspec URL); local vs remote is decided once, by
``fsspec.core.url_to_fs``. This module also owns the commit step (staging directory -> final path), the one
mechanism that decides when a checkpoint becomes visible.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp import _dcp_io
from lightning_dcp._dcp_io import METADATA_FILE
from lightning_dcp.errors import NotACheckpointError

__all__ = [
    "METADATA_FILE",
    "Location",
    "new_token",
]

STAGING_INFIX = ".tmp-"


def new_token() -> str:
    """A fresh random token (12 hex characters) that names one save's staging directory."""
    return uuid.uuid4().hex[:12]


class Location:
    """One checkpoint path resolved through fsspec.

    Args:
        path: Local path or fsspec URL (``s3://bucket/run/step=10.ckpt``). ``os.PathLike`` is accepted and turned
            into ``str``; URLs are never passed through ``pathlib``.
        storage_options: Keyword arguments for the fsspec filesystem (credentials, endpoint, region).
    """

    def __init__(self, path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> None:
        self.url = os.fspath(path)
        self.storage_options = dict(storage_options or {})
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Location({self.url!r})"

    def resolve(self) -> Location:
        """The location a checkpoint reference at this path designates (itself: no indirection yet)."""
        return self

    # ----------------------------------------------------------------------------------------------- queries
    def join(self, name: str) -> str:
        """The fsspec path (no protocol) of ``name`` inside this location."""
        return self.path.rstrip("/") + "/" + name

    def exists(self) -> bool:
        """Whether anything (file, directory or link) exists at this path."""
        if self.local:
            return os.path.lexists(self.path)
        return self.fs.exists(self.path)

    def isdir(self) -> bool:
        """Whether this path is a directory (a DCP checkpoint is one)."""
        return self.fs.isdir(self.path)

    def has_metadata(self) -> bool:
        """Whether DCP's ``.metadata`` (the commit marker) is present."""
        return self.fs.exists(self.join(METADATA_FILE))

    def open(self, name: str | None = None, mode: str = "rb") -> Any:
        """Open this path (or ``name`` inside it) as a binary file object."""
        return self.fs.open(self.path if name is None else self.join(name), mode)

    def sibling(self, name: str) -> Location:
        """The location named ``name`` in the same parent directory (same protocol and options)."""
        parent = self.url.rstrip("/").rsplit("/", 1)[0] if "/" in self.url.rstrip("/") else "."
        return Location(parent + "/" + name, storage_options=self.storage_options)

    @property
    def name(self) -> str:
        """The last path component."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    # ------------------------------------------------------------------------------------------- DCP plumbing
    def storage_writer(self, *, thread_count: int, sync_files: bool) -> StorageWriter:
        """A DCP storage writer for this directory (see :func:`lightning_dcp._dcp_io.storage_writer`)."""
        return _dcp_io.storage_writer(self, thread_count=thread_count, sync_files=sync_files)

    def storage_reader(self) -> StorageReader:
        """A DCP storage reader for this directory (see :func:`lightning_dcp._dcp_io.storage_reader`)."""
        return _dcp_io.storage_reader(self)

    def read_metadata(self) -> Metadata:
        """Read this checkpoint's DCP metadata with :func:`lightning_dcp._dcp_io.load_metadata`.

        Raises:
            NotACheckpointError: It cannot be read, or it holds anything but DCP metadata.
        """
        try:
            with self.open(METADATA_FILE) as f:
                return _dcp_io.load_metadata(f)
        except NotACheckpointError:
            raise
        except Exception as err:
            raise NotACheckpointError(f"Cannot read the DCP metadata of {self.url!r}: {err}") from err

    # ------------------------------------------------------------------------------------------------ changes
    def remove(self) -> None:
        """Delete this path (directory tree, file or link) if it exists; a link never deletes its target."""
        if self.local:
            if os.path.islink(self.path) or os.path.isfile(self.path):
                os.unlink(self.path)
            elif os.path.isdir(self.path):
                shutil.rmtree(self.path)
            return
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def staging(self, token: str) -> Location:
        """The hidden sibling directory a save writes into before it is committed to this path."""
        return self.sibling(f".{self.name}{STAGING_INFIX}{token}")

    def remove_stale_staging(self, *, keep: str | None = None) -> list[str]:
        """Delete staging directories of earlier, interrupted saves to this path. Returns the paths removed."""
        parent = self.sibling("")
        prefix = f".{self.name}{STAGING_INFIX}"
        try:
            entries = parent.fs.ls(parent.path.rstrip("/") or "/", detail=False)
        except FileNotFoundError:
            return []
        removed = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(prefix) and name != f"{prefix}{keep}":
                Location(self._with_protocol(entry), storage_options=self.storage_options).remove()
                removed.append(entry)
        return removed

    def commit_from(self, staging: Location) -> None:
        """Make the complete checkpoint in ``staging`` visible at this path, replacing what was here.

        Locally this is a rename (an atomic exchange when something already exists, so the old checkpoint stays
        until the new one is in place). On object stores, where no rename exists, the objects are copied with
        ``.metadata`` last and the staging prefix is deleted.
        """
        if self.local:
            _local_replace(staging.path, self.path)
            return
        self.remove()
        files = sorted(staging.fs.find(staging.path), key=lambda p: p.endswith("/" + METADATA_FILE))
        for src in files:
            rel = src[len(staging.path.rstrip("/")) + 1 :]
            self.fs.copy(src, self.join(rel))
        staging.remove()

    def _with_protocol(self, fs_path: str) -> str:
        if self.local:
            return fs_path
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{fs_path}"


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _rename_exchange(src: str, dst: str) -> bool:
    """Atomically swap two existing paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_EXCHANGE)
    return result == 0


def _local_replace(src: str, dst: str) -> None:
    """Move directory ``src`` to ``dst``; an existing ``dst`` is replaced only once ``src`` is in place."""
    if not os.path.lexists(dst):
        os.rename(src, dst)
    elif _rename_exchange(src, dst):
        # ``src`` now holds the previous checkpoint.
        Location(src).remove()
    else:
        parent, name = os.path.split(os.path.abspath(dst))
        old = os.path.join(parent, f".{name}{STAGING_INFIX}old-{new_token()}")
        os.rename(dst, old)
        os.rename(src, dst)
        Location(old).remove()
    _fsync_dir(os.path.dirname(os.path.abspath(dst)))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
