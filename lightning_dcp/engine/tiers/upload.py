"""Copying one committed checkpoint from the local tier to a remote store, and committing it there.

Steps of :func:`upload` (run by the tier's background uploader, :mod:`lightning_dcp.engine.tiers`):

1. :func:`snapshot`: hard links to every file of the committed local checkpoint, taken through one open directory
   descriptor, in a hidden directory of the local tier (``.upload-<name>-<token>``). The save that replaces a name
   swaps directories with an atomic rename, so all links come from one version; a file deleted meanwhile (the old
   version being removed) makes the snapshot start again from the new one. Links cost no data copy; where the
   filesystem refuses them the files are copied instead.
2. Every file but ``.commit`` is put to the remote prefix (data files concurrently, ``fs.put`` of a list).
3. Verification before the commit: a fresh listing of the remote prefix must show every file with exactly its local
   size, and ``.metadata``, read back, must match the size and checksum its marker records. Data files are not read
   back (that would download the checkpoint): every record is checked against its checksum whenever it is loaded.
4. ``.commit`` is written last, byte for byte the local marker, so both copies carry the same ``committed_at`` and are
   recognisably the same checkpoint. Over an existing remote checkpoint of the same name the files go to a hidden
   staging prefix first and :meth:`Location.commit_from` replaces the old one (server-side copies, ``.commit`` last).

A kill at any step leaves the remote checkpoint uncommitted (never loaded) or committed whole; the local copy stays
committed until the remote one is, so the upload can be redone.

:func:`begin` and :func:`finish` are steps 2 and 3-4 apart, for uploads whose files several processes put (the memory
tier's node-local disks, :mod:`~lightning_dcp.engine.tiers.node_disks`: each node puts its own files in between).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from typing import Any

from lightning_dcp.engine.format.marker import (
    COMMIT_FILE,
    MAX_MARKER_BYTES,
    METADATA_FILE,
    MarkerError,
    checksum,
    parse_commit,
)
from lightning_dcp.engine.storage.localfs import SNAPSHOT_PREFIX
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError

__all__ = [
    "SNAPSHOT_PREFIX",
    "abandon",
    "begin",
    "finish",
    "marker_of",
    "remove_committed",
    "same_checkpoint",
    "snapshot",
    "upload",
]

_SNAPSHOT_ATTEMPTS = 5


def marker_of(location: Location) -> tuple[bytes, dict[str, Any]] | None:
    """The raw and the parsed ``.commit`` of ``location``; ``None`` when uncommitted or the marker is invalid."""
    try:
        with location.open(COMMIT_FILE) as f:
            data = f.read(MAX_MARKER_BYTES + 1)
        return data, parse_commit(data)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, MarkerError):
        return None


def same_checkpoint(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two parsed markers commit the same checkpoint (same commit time and ``.metadata``)."""
    return a is not None and b is not None and a["committed_at"] == b["committed_at"] and a["metadata"] == b["metadata"]


def snapshot(local: Location, into: str) -> tuple[bytes, dict[str, Any]]:
    """Freeze the committed checkpoint ``local`` (a local directory) into the new directory ``into``.

    Returns:
        The raw and the parsed ``.commit`` marker of the version frozen.

    Raises:
        NotACheckpointError: ``local`` is not committed (or its marker is invalid).
        CheckpointError: A file of the marker is missing (e.g. ``local_dir`` is node-local while ranks run on
            several machines), or no consistent version could be frozen in 5 attempts.
    """
    for _ in range(_SNAPSHOT_ATTEMPTS):
        shutil.rmtree(into, ignore_errors=True)
        os.makedirs(into)
        try:
            fd = os.open(local.path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise NotACheckpointError(f"{local.url!r} does not exist (removed before its upload).") from None
        try:
            data = _read_at(fd, COMMIT_FILE)
            if data is None:
                raise NotACheckpointError(f"{local.url!r} is not committed: nothing to upload.")
            try:
                marker = parse_commit(data)
            except MarkerError as err:
                raise NotACheckpointError(f"{local.url!r}: invalid {COMMIT_FILE}: {err}") from None
            names = [*marker["files"], METADATA_FILE]
            if all(_freeze(fd, name, into) for name in names):
                with open(os.path.join(into, COMMIT_FILE), "wb") as f:
                    f.write(data)
                _check_sizes(local.url, marker, {n: os.path.getsize(os.path.join(into, n)) for n in names})
                return data, marker
        finally:
            os.close(fd)
    shutil.rmtree(into, ignore_errors=True)
    raise CheckpointError(f"{local.url!r} kept changing while its upload started ({_SNAPSHOT_ATTEMPTS} attempts).")


def _read_at(fd: int, name: str) -> bytes | None:
    try:
        handle = os.open(name, os.O_RDONLY, dir_fd=fd)
    except FileNotFoundError:
        return None
    with os.fdopen(handle, "rb") as f:
        return f.read(MAX_MARKER_BYTES + 1)


def _freeze(fd: int, name: str, into: str) -> bool:
    """Hard-link (or copy) ``name`` of the directory open as ``fd`` into ``into``; False if it vanished."""
    try:
        os.link(name, os.path.join(into, name), src_dir_fd=fd)
        return True
    except FileNotFoundError:
        return False
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    try:
        handle = os.open(name, os.O_RDONLY, dir_fd=fd)
    except FileNotFoundError:
        return False
    with os.fdopen(handle, "rb") as src, open(os.path.join(into, name), "wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
    return True


def _check_sizes(url: str, marker: dict[str, Any], sizes: dict[str, int]) -> None:
    """Every file of ``marker`` has its recorded size in ``sizes`` (and ``.metadata`` exactly its size)."""
    expected = {name: entry["size"] for name, entry in marker["files"].items()}
    expected[METADATA_FILE] = marker["metadata"]["size"]
    for name, size in expected.items():
        found = sizes.get(name)
        if found is None:
            raise CorruptCheckpointError(
                f"{url!r}: {name} is missing. With `local_dir`, every rank must write to the same filesystem (one"
                " machine, or a shared filesystem).",
                file=name,
            )
        if found != size:
            raise CorruptCheckpointError(f"{url!r}: {name} holds {found} bytes, not the {size} recorded.", file=name)


def upload(
    source: str,
    marker_bytes: bytes,
    marker: dict[str, Any],
    remote: Location,
    *,
    progress: Callable[[], None] | None = None,
) -> None:
    """Copy the frozen checkpoint in the local directory ``source`` to ``remote``, verify it, then commit it there.

    Rank 0 only (the tier's uploader thread). ``progress()`` is called whenever the store took a file or a part of one.

    Raises:
        CorruptCheckpointError: A remote file does not have its local size, or ``.metadata`` read back differs.
        CheckpointError: Storage failures (translated: ``StorageAccessError``, ``BucketNotFoundError``).
    """
    target = begin(remote, marker)
    if target is None:
        return
    names = [name for name in os.listdir(source) if name != COMMIT_FILE]
    try:
        target.put({name: os.path.join(source, name) for name in names}, progress=progress)
        finish(target, remote, marker_bytes, marker)
    except BaseException:
        abandon(target, remote)
        raise


def begin(remote: Location, marker: dict[str, Any]) -> Location | None:
    """Steps 1-2 of an upload of the checkpoint ``marker`` to ``remote``: where its files go (``None``: nowhere).

    ``None`` when ``remote`` already holds that checkpoint committed (a run killed after the commit, before its
    bookkeeping). Otherwise ``remote`` itself (leftovers of an interrupted upload, uncommitted and never loaded, are
    removed first), or a new staging prefix beside it when a committed checkpoint is there. Any rank.
    """
    current = marker_of(remote) if remote.exists() else None
    if current is not None and same_checkpoint(current[1], marker):
        return None
    staged = remote.exists() and not (remote.isdir() and current is None)
    if not staged:
        remote.remove()
    return remote.staging() if staged else remote


def finish(target: Location, remote: Location, marker_bytes: bytes, marker: dict[str, Any]) -> None:
    """Steps 3-4: verify every file ``target`` holds against ``marker``, write ``.commit`` last, commit ``remote``.

    ``target`` (from :func:`begin`) holds every file of the checkpoint but ``.commit``, whoever put them. Any rank.

    Raises:
        CorruptCheckpointError: A remote file does not have its recorded size, or ``.metadata`` read back differs.
    """
    _check_sizes(target.url, marker, target.sizes())
    with target.open(METADATA_FILE) as f:
        metadata = f.read(marker["metadata"]["size"] + 1)
    if len(metadata) != marker["metadata"]["size"] or checksum(metadata) != marker["metadata"]["checksum"]:
        raise CorruptCheckpointError(f"{target.url!r}: {METADATA_FILE} read back differs.", file=METADATA_FILE)
    with target.open(COMMIT_FILE, "wb") as f:
        f.write(marker_bytes)
    if target.url != remote.url:
        remote.commit_from(target)
    remote.remove_stale_staging()  # of earlier attempts cut short


def abandon(target: Location, remote: Location) -> None:
    """After a failed upload: remove ``target`` when it is a staging prefix (an uncommitted ``remote`` stays)."""
    if target.url != remote.url:
        with contextlib.suppress(Exception):
            target.remove()


def remove_committed(location: Location) -> None:
    """Delete a checkpoint with its ``.commit`` first, so a deletion cut short never leaves a broken "committed" one."""
    location.remove_file(COMMIT_FILE)
    location.remove()
