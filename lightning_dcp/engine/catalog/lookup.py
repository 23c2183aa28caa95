"""Which checkpoint a path designates: the one door every reader goes through before it opens anything.

A path names one checkpoint directly (a directory, a single file), through a local symlink, or through a pointer
object (:meth:`~lightning_dcp.engine.storage.location.Location.resolve`). A ``last*`` name (``ModelCheckpoint``'s
``last.ckpt``, ``last-v1.ckpt``) or a checkpoint's ``.commit`` marker instead asks for "the newest valid checkpoint
of this run in this directory": of the committed checkpoints of the run that saved the checkpoint the entry names
(:func:`~lightning_dcp.engine.format.marker.run_of`), the newest (in the order recorded at save,
:func:`~lightning_dcp.engine.format.marker.order_key`) that passes the fast checks, also when the link or pointer
lags behind it or names one that is gone, with a warning naming both when they differ. Checkpoints another run saved
into the same directory are never chosen for it. An entry that names no committed checkpoint (missing, dangling)
takes the run of the directory's newest checkpoint, with a warning when other runs saved there too. The loader
(``Checkpointer.load``), ``probe``, the tools (``load_checkpoint``, ``consolidate``, ``inspect``, ``verify``) and the
Lightning hooks all ask here, so a dangling or stale ``last`` falls back the same way everywhere.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from typing import Any

from fsspec.core import split_protocol

from lightning_dcp.engine.catalog.integrity import (
    Committed,
    check_checkpoint,
    committed_checkpoints,
    not_one_checkpoint,
)
from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.location import POINTER_HEADER, Location
from lightning_dcp.errors import CheckpointError, NotACheckpointError, checkpoint_not_found

__all__ = [
    "candidates",
    "designated",
    "designates_last",
    "of_named_run",
    "source_of",
    "verify_checkpoint",
]

_LAST_NAME = re.compile(r"^last(-v\d+)?(\.ckpt)?$")
"""Names ``ModelCheckpoint`` gives its last checkpoint (``last.ckpt``, ``last-v1.ckpt``)."""


def designates_last(location: Location) -> bool:
    """Whether ``location`` asks for "the newest valid checkpoint of its directory" rather than one checkpoint.

    That is a ``last*`` name (what ``ckpt_path="last"`` resolves to under ``ModelCheckpoint``), or a checkpoint's
    ``.commit`` marker (what ``DCPModelCheckpoint`` hands Lightning when no ``last*`` entry can be stat-ed).
    """
    return bool(_LAST_NAME.match(location.name)) or location.name == COMMIT_FILE


def candidates(location: Location) -> list[str]:
    """The checkpoints to try, in order, for a load of ``location``.

    For a path that :func:`designates_last`, the committed checkpoint directories of its directory that belong to the
    run it designates (:func:`of_named_run`), newest first (a dangling, stale or escaping link is never trusted over
    what is on disk, and a warning names both when they differ); a single-file ``last.ckpt`` comes first, and a
    ``last`` directory in Lightning's own sharded layout is tried when nothing committed exists. Any other path:
    itself, through pointers.

    Rank 0 only: the caller broadcasts the result so every rank loads the same checkpoint.

    Raises:
        CheckpointNotFoundError: Nothing exists there (Lightning's ``"Checkpoint file not found"`` case).
        NotACheckpointError: A ``last`` entry exists but no committed checkpoint beside it; a malformed pointer.
    """
    if not designates_last(location):
        resolved = location.resolve()
        if not resolved.exists():
            raise checkpoint_not_found(
                resolved.url, designated_by=None if resolved.url == location.url else location.url
            )
        return [resolved.url]
    directory = location.parent().parent() if location.name == COMMIT_FILE else location.parent()
    committed = committed_checkpoints(directory, whole=False)  # the one opened is checked whole
    found = [candidate.url for _, candidate in committed]
    entry = location.parent() if location.name == COMMIT_FILE else location
    if entry.local and os.path.isfile(entry.path) and not _is_pointer(entry):  # a single file (TorchCheckpointIO)
        return [entry.url, *found]
    if found:
        chosen = [candidate.url for _, candidate in of_named_run(committed, entry)]
        if location.name != COMMIT_FILE:
            _warn_if_link_differs(entry, chosen[0])
        return chosen
    if entry.exists() and entry.isdir() and entry.is_lightning_sharded():
        return [entry.url]
    if not entry.exists():
        raise checkpoint_not_found(entry.url)
    target = entry.resolve()  # a link or pointer to a checkpoint that is gone: Lightning's "not found" case
    if target.url != entry.url and not target.exists():
        raise checkpoint_not_found(target.url, designated_by=entry.url)
    raise NotACheckpointError(
        f"{entry.url!r} designates the newest checkpoint of {directory.url!r}, but no checkpoint there is committed"
        " (every save into it was interrupted). Start without `ckpt_path`, or remove the directory's uncommitted"
        " entries; `DCPModelCheckpoint` does both on its own."
    )


def of_named_run(found: list[Committed], entry: Location) -> list[Committed]:
    """Of ``found`` (a directory's committed checkpoints, newest first), those a ``last`` ``entry`` designates.

    The run of the checkpoint ``entry`` names (a symlink's target, a pointer's name, the entry itself for
    ``save_last=True`` copies and for a checkpoint named by its ``.commit``) and, as fallbacks behind them,
    checkpoints that recorded no run (saved before runs were recorded); newest first. An entry that names none of
    ``found`` takes the run of the newest, with a warning naming the runs passed over. When the named checkpoint
    recorded no run, every checkpoint of ``found``. Rank 0 only (or any single process).
    """
    if not found:
        return found
    named = _named_url(entry)
    run = next((c.run for c in found if _same(c[1], named)), _UNNAMED)
    if run is None:
        return found
    if run is _UNNAMED:
        run = found[0].run
        others = sorted({c.run for c in found if c.run not in (run, None)})
        if run is not None and others:
            warnings.warn(
                f"lightning_dcp: {entry.url!r} names no committed checkpoint, and {len(others) + 1} runs saved into"
                f" its directory; resuming the run of the newest checkpoint, {found[0][1].url!r} (run {run}), and"
                f" passing over the checkpoints of run(s) {', '.join(others)}. Pass one of them as `ckpt_path` to"
                " resume it instead.",
                stacklevel=3,
            )
        if run is None:
            return found
    return [c for c in found if c.run in (run, None)]


_UNNAMED = object()


def _same(checkpoint: Location, url: str | None) -> bool:
    if url is None:
        return False
    if checkpoint.local:
        return os.path.realpath(checkpoint.path) == os.path.realpath(Location(url).path)
    return checkpoint.url == url


def _named_url(entry: Location) -> str | None:
    """The URL of the checkpoint a ``last`` entry names (without checking it exists); ``None`` when it names none."""
    if entry.local and os.path.islink(entry.path):
        return Location(os.path.realpath(entry.path)).url
    try:
        name = entry.read_pointer()
    except CheckpointError:
        return None  # a malformed pointer: its own error is raised where it is followed
    if name is not None:
        return entry.sibling(name).url
    return entry.url  # the entry itself: a checkpoint directory (save_last=True), or absent


def designated(location: Location) -> Location:
    """The one checkpoint a read of ``location`` opens: what every reader (tools, CLIs, hooks) asks first.

    A ``last*`` name (or a checkpoint's ``.commit``) designates the newest committed checkpoint of its directory that
    passes the fast checks (:func:`~lightning_dcp.engine.catalog.integrity.check_checkpoint`), whatever the link or
    pointer says; a warning names the ones passed over. Any other path: itself, through pointers and links.

    Rank 0 only (or any single process).

    Raises:
        CheckpointNotFoundError: Nothing exists there.
        NotACheckpointError: A ``last`` entry with no loadable checkpoint beside it (the message lists what failed).
    """
    if not designates_last(location):
        return location.at(candidates(location)[0])
    failures: list[tuple[str, CheckpointError]] = []
    for url in candidates(location):
        candidate = location.at(url)
        try:
            if candidate.isdir() and (candidate.is_committed() or not candidate.is_lightning_sharded()):
                check_checkpoint(candidate)
        except CheckpointError as err:
            failures.append((url, err))
            continue
        if failures:
            tried = "; ".join(f"{u!r} ({err})" for u, err in failures)
            warnings.warn(
                f"lightning_dcp: the newest checkpoint(s) designated by {location.url!r} cannot be read: {tried}."
                f" Reading the newest valid checkpoint instead: {url!r}.",
                stacklevel=2,
            )
        return candidate
    raise NotACheckpointError(
        f"No checkpoint designated by {location.url!r} can be read; tried, newest first: "
        + "; ".join(f"{u!r}: {err}" for u, err in failures)
    )


def _warn_if_link_differs(entry: Location, newest: str) -> None:
    """Warn when the ``last`` link or pointer ``entry`` names another checkpoint than ``newest`` (which is used)."""
    if entry.local and os.path.islink(entry.path):
        target = os.path.realpath(entry.path)
        shown, gone = target, not os.path.isdir(target)
        same = os.path.realpath(Location(newest).path) == target
    else:
        try:
            name = entry.read_pointer() if not entry.isdir() else None
        except CheckpointError:
            name = None  # a malformed pointer: its own error is raised where it is followed
        if name is None:
            return  # no link: the entry is a checkpoint itself (``save_last=True``) or absent
        shown, gone = entry.sibling(name).url, not entry.sibling(name).is_committed()
        same = shown == newest
    if not same:
        why = "which is missing or was never committed" if gone else "but a newer checkpoint is committed"
        warnings.warn(
            f"lightning_dcp: {entry.url!r} designates {shown!r}, {why}; using the newest committed checkpoint"
            f" {newest!r} instead.",
            stacklevel=3,
        )


def _is_pointer(location: Location) -> bool:
    """Whether the local file at ``location`` is a checkpoint pointer (whatever it names)."""
    try:
        with open(location.path, "rb") as f:
            return f.read(len(POINTER_HEADER)) == POINTER_HEADER
    except OSError:
        return False


def verify_checkpoint(
    path: str | os.PathLike,
    *,
    full: bool = True,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Check that the checkpoint at ``path`` is committed and every byte matches what was saved.

    Args:
        path: Checkpoint directory (local path or fsspec URL).
        full: Read every record of every data file and check its checksum (default). ``False``: the fast checks that
            also run before every load (commit marker, ``.metadata`` checksum, data file sizes).
        storage_options: fsspec options for remote storage.
        progress: With ``full``, called with ``(0, total)`` before the first record is read and then after each
            record is checked with its bytes and ``total``, the bytes of all records (a progress bar; ``python -m
            lightning_dcp.verify`` draws one).

    A ``last*`` name verifies the newest committed checkpoint of its directory that passes the fast checks (see
    ``designated``), with a warning naming any passed over.

    Rank 0 only (or any single process).

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        NotACheckpointError: No commit marker (an incomplete save), a single file (a ``.ckpt`` has no recorded
            checksums) or a folder of checkpoints (a run's dirpath) rather than one.
        CorruptCheckpointError: A file is missing, truncated or altered; ``err.file`` names it.
    """
    given = Location(path, storage_options=storage_options)
    location = designated(given)
    if not location.exists():
        raise checkpoint_not_found(location.url, designated_by=None if location.url == given.url else given.url)
    not_one = not_one_checkpoint(location)
    if not_one is not None:
        raise not_one
    check_checkpoint(location, full=full, progress=progress)


def source_of(loaded: Any, *, local_dir: Location | None = None) -> str:
    """Where a load really read ``loaded`` from, in words for a log line: the tier and a location that exists.

    A memory-tier load (``loaded.source`` set by the tier: its areas, and whether a peer's replica served) is named
    as such, never by the durable path it would be persisted to; a copy in ``local_dir`` (the plugin's local tier)
    as the local tier; any other local path as the directory it is in; a URL as the remote store's.
    """
    source = getattr(loaded, "source", None)
    if source is not None:
        return source
    protocol, path = split_protocol(loaded.url)  # no Location: some stores (adlfs) connect when one is made
    if protocol not in (None, "file", "local"):
        return f"{loaded.url!r} (the remote store)"
    path = os.path.abspath(path)
    if local_dir is not None and path.startswith(local_dir.path.rstrip("/") + "/"):
        return f"{path!r} (local_dir, the local tier)"
    return repr(path)
