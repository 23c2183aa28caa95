"""Atomic outputs: a file or a directory that appears at its final path complete, or not at all.

Local disks: written under a hidden temporary sibling, ``fsync``-ed and renamed into place. Object stores (no rename):
a file is written in place and becomes visible when it is closed (its upload completes); a directory is staged under
a hidden sibling prefix and copied into place by :meth:`Location.commit_from`. After an error nothing is left at the
final path, and the temporary file or directory is deleted.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO

from lightning_dcp.engine.storage import Location, fsync_dir, new_token

__all__ = ["atomic_directory", "atomic_file", "refuse_existing"]


def refuse_existing(out: Location, *, overwrite: bool) -> None:
    """Raise ``FileExistsError`` when ``out`` exists and ``overwrite`` is False."""
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out.url!r} already exists. Pass `overwrite=True` (CLI: --overwrite) to replace it.")


@contextlib.contextmanager
def atomic_file(out: Location) -> Iterator[IO[bytes]]:
    """Open ``out`` for writing so that it appears only complete, once the ``with`` block exits without error.

    An existing file (or directory) at ``out`` is replaced only then.
    """
    if not out.local:
        f = out.fs.open(out.path, "wb")
        try:
            yield f
        except BaseException:
            discard = getattr(f, "discard", None)
            if discard is not None:
                discard()  # fsspec buffered files: drop the upload instead of committing it
            else:
                f.close()
                out.remove()
            raise
        f.close()
        return
    parent = os.path.dirname(os.path.abspath(out.path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{out.name}.tmp-{new_token()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(out.path) and not os.path.islink(out.path):
            out.remove()
        os.replace(tmp, out.path)
        fsync_dir(parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_directory(out: Location) -> Iterator[Location]:
    """Yield a staging directory that replaces ``out`` (via :meth:`Location.commit_from`) when the block succeeds."""
    staging = out.staging(new_token())
    if staging.local:
        os.makedirs(staging.path, exist_ok=True)
    else:
        staging.fs.makedirs(staging.path, exist_ok=True)
    try:
        yield staging
        out.commit_from(staging)
    finally:
        staging.remove()
