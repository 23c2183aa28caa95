"""The local-disk commit: a finished staging directory takes the checkpoint's name atomically, and is made durable.

A save writes into a hidden sibling (``.{name}.tmp-{token}``; names.py bounds its length) of its target and renames it
into place once every rank finished. Replacing an existing checkpoint swaps the two directories with one
``renameat2(RENAME_EXCHANGE)`` where Linux offers it, so the old checkpoint stays readable until the new one is in
place. Renames that cross filesystems (``EXDEV``) fall back to a copy under a hidden name, then a rename
(:func:`replace_directory`); on a mount that cannot rename at all (FUSE mounts of object stores) the copy is made under
the checkpoint's own name, every file synced before ``.commit`` is written last: until then the directory is no
checkpoint, and no reader takes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
from typing import BinaryIO

from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.names import (
    SNAPSHOT_PREFIX,
    STAGING_INFIX,
    is_internal_name,
    new_token,
    staging_name,
)

__all__ = [
    "CANNOT_RENAME",
    "SNAPSHOT_PREFIX",
    "STAGING_INFIX",
    "NotARegularFile",
    "fsync_dir",
    "is_internal_name",
    "new_token",
    "open_regular",
    "remove_path",
    "replace_directory",
    "replace_file",
]

CANNOT_RENAME = frozenset({errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})
"""``errno`` of a rename refused by the filesystem itself (across filesystems, or a mount without renames)."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


class NotARegularFile(OSError):
    """A path to read is a FIFO, socket or device. ``kind`` says which (``"a FIFO"``, ...)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file", path)
        self.kind = kind


def open_regular(path: str) -> BinaryIO:
    """Open a local regular file for binary reading, without ever blocking on what is not one.

    The open itself is non-blocking (a FIFO with no writer would otherwise wait forever); the type is then checked on
    the descriptor, so nothing can swap the file between the check and the read. Links are followed.

    Raises:
        NotARegularFile: ``path`` is a FIFO, socket or device.
        IsADirectoryError, FileNotFoundError, OSError: As ``open``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a socket (or a FIFO held open for writing only)
            raise NotARegularFile(path, "a socket") from err
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if not stat.S_ISREG(mode):
            raise NotARegularFile(path, "a FIFO" if stat.S_ISFIFO(mode) else "a device or special file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def remove_path(path: str) -> None:
    """Delete ``path`` (directory tree, file or link) if it exists; a link never deletes its target.

    Entries that vanish meanwhile (a concurrent removal of the same checkpoint) are not an error. A checkpoint
    directory loses its ``.commit`` marker first, so that a removal cut short (a kill) never leaves a marker vouching
    for files that are gone.
    """
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            os.unlink(os.path.join(path, COMMIT_FILE))
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            pass
    for _ in range(3):  # a concurrent removal took some entries: finish what is left
        try:
            if os.path.islink(path) or os.path.isfile(path):
                os.unlink(path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
            return
        except FileNotFoundError:
            if not os.path.lexists(path):
                return
    shutil.rmtree(path)


def replace_directory(src: str, dst: str) -> None:
    """Move the complete directory ``src`` to ``dst``; an existing ``dst`` is replaced only once ``src`` is in place.

    A rename that crosses filesystems (``EXDEV``: overlayfs refuses to rename a directory of a lower layer, e.g. one
    baked into a container image; bind mounts) falls back to a copy (see :func:`_move`). When ``dst`` itself cannot
    be renamed out of the way, it is deleted just before ``src`` is moved in; ``src`` carries its own ``.commit``
    marker, so the new checkpoint is whole under its hidden name during that window. Rank 0 only.
    """
    parent, name = os.path.split(os.path.abspath(dst))
    if not os.path.lexists(dst):
        _move(src, dst)
    elif _rename_exchange(src, dst):
        remove_path(src)  # ``src`` now holds the previous checkpoint
    else:
        old: str | None = os.path.join(parent, staging_name(name, f"old-{new_token()}"))
        try:
            os.rename(dst, old)
        except OSError as err:
            if err.errno != errno.EXDEV:
                raise
            remove_path(dst)
            old = None
        _move(src, dst)
        if old is not None:
            remove_path(old)
    fsync_dir(parent)


def _rename_exchange(src: str, dst: str) -> bool:
    """Atomically swap two existing paths with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_EXCHANGE)
    return result == 0


def _move(src: str, dst: str) -> None:
    """Rename ``src`` to the free name ``dst``; across filesystems (``EXDEV``), copy first, then rename.

    The copy is written under a hidden name beside ``dst`` (``.{name}.tmp-copy-{token}``, on ``dst``'s filesystem),
    synced, and renamed into place; only then is ``src`` deleted. A crash leaves ``src`` intact and at most a hidden
    partial copy, which the next save to that name removes with the other staging leftovers. The copy takes the
    data and links only, no permission bits: mounts that refuse ``chmod`` (some network and FUSE filesystems) take it.
    """
    try:
        os.rename(src, dst)
        return
    except OSError as err:
        if err.errno not in CANNOT_RENAME:
            raise
    parent, name = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(parent, staging_name(name, f"copy-{new_token()}"))
    try:
        _copy_tree(src, tmp)
        _fsync_tree(tmp)
        os.rename(tmp, dst)
    except OSError as err:
        remove_path(tmp)
        if err.errno not in CANNOT_RENAME:
            raise
        _copy_in_place(src, dst)  # the mount renames nothing: the marker written last makes it a checkpoint
    except BaseException:
        remove_path(tmp)
        raise
    remove_path(src)


def _copy_in_place(src: str, dst: str) -> None:
    """Copy the checkpoint ``src`` to the free name ``dst`` with its ``.commit`` last, each file synced first.

    A crash leaves ``dst`` without a marker (no checkpoint: never taken by a resume, removed by the next save to that
    name) and ``src`` whole.
    """
    marker = os.path.join(src, COMMIT_FILE)
    _copy_tree(src, dst, skip=COMMIT_FILE)
    _fsync_tree(dst)
    if os.path.exists(marker):
        shutil.copyfile(marker, os.path.join(dst, COMMIT_FILE))
        _fsync_file(os.path.join(dst, COMMIT_FILE))
        fsync_dir(dst)


def _copy_tree(src: str, dst: str, *, skip: str | None = None) -> None:
    """Copy the directory ``src`` to the new ``dst``: file data and links only, all but the entry named ``skip``.

    No modes or times: ``shutil.copytree`` sets both, and fails where ``chmod`` is refused.
    """
    os.makedirs(dst)
    for entry in os.scandir(src):
        if entry.name == skip:
            continue
        target = os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir():
            _copy_tree(entry.path, target)
        else:
            shutil.copyfile(entry.path, target)


def _fsync_tree(root: str) -> None:
    for directory, _, files in os.walk(root):
        for file in files:
            _fsync_file(os.path.join(directory, file))
        fsync_dir(directory)


def replace_file(path: str, data: bytes, *, replace_directory: bool = False) -> None:
    """Make the local file ``path`` hold ``data``, all at once (how this package replaces a small local file).

    ``data`` goes to a hidden staging name beside ``path``, is synced, renamed over whatever file is at ``path``, and
    the directory is synced: a crash or power loss leaves the old file or the new one, never part of either. The
    directory must exist. A directory at ``path`` is removed only with ``replace_directory``, and only once
    ``data`` is safely on disk (else ``IsADirectoryError``, and it stays).
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, staging_name(os.path.basename(path), new_token()))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace_directory and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """``fsync`` a local directory so a rename inside it survives a power loss (best effort)."""
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
