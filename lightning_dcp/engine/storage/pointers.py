"""Checkpoint pointers: how ``last.ckpt`` designates a checkpoint without a symlink, and how a path is resolved.

A pointer is a small object (or local file) beside the checkpoints of a directory: :data:`POINTER_HEADER`, then the
name of the checkpoint it designates in the same directory. Resolving a path follows pointers (at most 8 hops), a
``.commit`` path to its directory, and an interrupted overwrite on an object store forward to its complete staging
prefix.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_dcp.engine.format.marker import COMMIT_FILE, is_plain_name, order_key
from lightning_dcp.engine.storage.commit_reads import read_commit
from lightning_dcp.engine.storage.localfs import replace_file
from lightning_dcp.engine.storage.names import is_staging_of
from lightning_dcp.errors import NotACheckpointError

__all__ = ["POINTER_HEADER", "Pointers"]

POINTER_HEADER = b"lightning_dcp pointer v1\n"
"""First line of a pointer object; the second line is the relative name of the checkpoint it designates."""


_POINTER_MAX_BYTES = 4096


_MAX_HOPS = 8


class Pointers:
    """The pointer verbs of :class:`~lightning_dcp.engine.storage.location.Location` (mixed into it)."""

    # ------------------------------------------------------------------------------------------- pointers
    def read_pointer(self) -> str | None:
        """The name held by the pointer object at this path, or ``None`` when this is no pointer.

        Raises:
            NotACheckpointError: A pointer whose target is not a plain name in the same directory (``../x``,
                ``/abs``, ``a/b``): a pointer never leads out of its directory.
        """
        with self._translated():
            try:
                if not self.fs.isfile(self.path) or self.fs.size(self.path) > _POINTER_MAX_BYTES:
                    return None
                data = self.fs.cat_file(self.path)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
        if not data.startswith(POINTER_HEADER):
            return None
        try:
            name = data[len(POINTER_HEADER) :].decode().strip()
        except UnicodeDecodeError:
            name = None
        if not is_plain_name(name):
            raise NotACheckpointError(
                f"The checkpoint pointer {self.url!r} names {name!r}, which is not a checkpoint in the same directory;"
                " pointers written by lightning_dcp never leave their directory. Delete or rewrite it."
            )
        return name

    def write_pointer(self, target: Any) -> None:
        """Make this path a pointer object to ``target`` (a sibling), replacing what is here.

        The pointer holds ``target``'s name relative to this path's directory; one object write (atomic on object
        stores, a rename of a temporary file on local disks). Rank 0 only.
        """
        data = POINTER_HEADER + target.name.encode() + b"\n"
        if self.local:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            replace_file(self.path, data, replace_directory=True)  # a checkpoint directory here goes only then
            return
        with self._translated():
            if self.fs.isdir(self.path):
                self.remove()
            self.fs.pipe_file(self.path, data)

    def resolve(self) -> Any:
        """The checkpoint this path designates: itself, or the target of a pointer object (followed in chains).

        A path to a checkpoint's ``.commit`` marker designates that checkpoint directory. An uncommitted directory
        whose overwrite was interrupted mid-commit resolves to the complete staging prefix it was being replaced
        with (roll forward). Local symlinks are left to the operating system. Rank 0 only (its result is broadcast).

        Raises:
            NotACheckpointError: Pointers form a cycle or a chain longer than 8.
        """
        location: Any = self
        if location.name == COMMIT_FILE:  # a checkpoint referred to by its commit marker (an object with a mtime)
            location = location.parent()
        for _ in range(_MAX_HOPS):
            name = location.read_pointer()
            if name is None:
                return location._rolled_forward()
            location = location.sibling(name)
        raise NotACheckpointError(f"{self.url!r}: checkpoint pointers form a chain longer than {_MAX_HOPS}.")

    def _rolled_forward(self) -> Any:
        if self.local or not self.isdir() or self.is_committed():
            return self
        committed = []
        for name, kind in self.sibling("").entries():
            if kind == "directory" and is_staging_of(name, self.name):
                marker = read_commit(self.sibling(name))
                if marker is not None:
                    committed.append((order_key(marker), name))
        return self.sibling(max(committed)[1]) if committed else self
