"""The output door: what a tool may write over, and outputs that appear at their final path complete or not at all.

What an output may replace (:func:`refuse_existing`), whatever the user passes:

- a single-file output (``.ckpt``, ``.safetensors``) replaces, with ``overwrite``, only a regular file (or a link,
  never what it points to). A directory, a checkpoint, a FIFO or a device at that path is refused even with
  ``overwrite``: ``--overwrite`` never deletes a directory;
- a sharded safetensors output (a directory) replaces, with ``overwrite``, only this tool's own earlier output: a
  directory holding nothing but ``model-*-of-*.safetensors`` shards and ``model.safetensors.index.json``.

Atomicity. Local disks: written under a hidden temporary sibling (``.<name>.tmp-<pid>-<token>``), ``fsync``-ed and
renamed into place; temporaries left by a run that was killed (its process is gone) are deleted by the next run for
the same output. Object stores (no rename): a file is written in place and becomes visible when it is closed (its
upload completes); a directory is staged under a hidden sibling prefix and copied into place by
:meth:`Location.commit_from`. After an error nothing is left at the final path, and the temporary file or directory is
deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Literal

from lightning_dcp.engine import Location, fsync_dir
from lightning_dcp.errors import OutputExistsError

__all__ = ["atomic_directory", "atomic_file", "refuse_existing", "remove_stale_temporaries"]

_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_INDEX = "model.safetensors.index.json"
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


def refuse_existing(out: Location, *, overwrite: bool, kind: Literal["file", "sharded"] = "file") -> None:
    """Raise unless writing ``out`` may replace what is there (see the module docstring). Rank 0 only.

    Args:
        out: The output path.
        overwrite: The user allows replacing an earlier output.
        kind: ``"file"`` for one output file, ``"sharded"`` for a directory of safetensors shards with its index.

    Raises:
        OutputExistsError: Something exists at ``out`` that is not replaceable (a directory for a file output, a
            checkpoint, a special file, a directory with other content), or ``overwrite`` is False.
    """
    if not out.exists():
        return
    what = _what_is_there(out)
    replaceable = what == "file" if kind == "file" else what == "sharded output"
    if not replaceable:
        fix = "choose another output path" + (" (a file path, e.g. model.ckpt)" if kind == "file" else "")
        raise OutputExistsError(
            f"The output {out.url!r} exists and is a {what}: it is never replaced, not even with"
            f" `overwrite=True` (--overwrite), which replaces only an earlier output of the same kind. {fix[0].upper()}"
            f"{fix[1:]}, or remove it yourself."
        )
    if not overwrite:
        raise OutputExistsError(
            f"The output {out.url!r} already exists. Pass `overwrite=True` (CLI: --overwrite) to replace it."
        )


def _what_is_there(out: Location) -> str:
    """``"file"``, ``"sharded output"``, ``"checkpoint"``, ``"directory"`` or the kind of special file at ``out``."""
    if out.local:
        mode = os.lstat(out.path).st_mode
        if stat.S_ISLNK(mode):
            return "file" if not os.path.isdir(out.path) else "link to a directory"
        if not stat.S_ISDIR(mode) and not stat.S_ISREG(mode):
            return _special(mode)
        if stat.S_ISREG(mode):
            return "file"
    elif not out.isdir():
        return "file"
    kinds = dict(out.entries(follow_links=False))
    names = set(kinds)
    if out.checkpoint_kind(names) is not None:
        return "checkpoint"
    ours = _INDEX in names and all(n == _INDEX or (_SHARD.match(n) and kinds[n] == "file") for n in names)
    return "sharded output" if ours else "directory"


def _special(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device")):
        if test(mode):
            return name
    return "special file"


def remove_stale_temporaries(out: Location) -> list[str]:
    """Delete the hidden temporaries of earlier writes of ``out`` whose process is gone (a killed run). Local only.

    Returns:
        The paths removed.
    """
    if not out.local:
        return []
    parent = os.path.dirname(os.path.abspath(out.path))
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(parent):
            match = _TMP.match(name)
            if match is None or match.group("name") != out.name or _alive(int(match.group("pid"))):
                continue
            path = os.path.join(parent, name)
            with contextlib.suppress(FileNotFoundError):
                if os.path.isfile(path) and not os.path.islink(path):
                    os.unlink(path)
                    removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_file(out: Location) -> Iterator[IO[bytes]]:
    """Open ``out`` for writing so that it appears only complete, once the ``with`` block exits without error.

    An existing file at ``out`` is replaced only then (call :func:`refuse_existing` first: a directory is never
    replaced).
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
    remove_stale_temporaries(out)
    tmp = os.path.join(parent, f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(out.path) and not os.path.islink(out.path):  # appeared meanwhile: never deleted here
            raise OutputExistsError(f"The output {out.url!r} became a directory while it was written; not replaced.")
        os.replace(tmp, out.path)
        fsync_dir(parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_directory(out: Location) -> Iterator[Location]:
    """Yield a staging directory that replaces ``out`` (via :meth:`Location.commit_from`) when the block succeeds."""
    staging = out.staging()
    if staging.local:
        os.makedirs(staging.path, exist_ok=True)
    else:
        staging.fs.makedirs(staging.path, exist_ok=True)
    try:
        yield staging
        out.commit_from(staging)
    finally:
        staging.remove()
