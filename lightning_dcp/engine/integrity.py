"""Checking a checkpoint before it is loaded: committed, metadata intact, data files whole; full verification.

The records' checksums are written by :mod:`lightning_dcp.engine.dcp_io` at save into ``.commit``; its reader checks
every record it loads. Here, the cheap checks that run before every load (fast mode) and the full pass over every
record.
"""

from __future__ import annotations

import io
import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp.engine.dcp_io import load_metadata
from lightning_dcp.engine.marker import COMMIT_FILE, METADATA_FILE, checksum
from lightning_dcp.engine.storage import Location, read_commit
from lightning_dcp.errors import CorruptCheckpointError, NotACheckpointError, checkpoint_not_found

__all__ = ["check_checkpoint", "checkpoints_inside", "newest_valid_sibling", "not_one_checkpoint", "verify_checkpoint"]


def check_checkpoint(location: Location, *, full: bool = False) -> Metadata:
    """Check that ``location`` holds a complete, undamaged checkpoint and return its DCP metadata.

    Fast mode (``full=False``, run before every load): the ``.commit`` marker exists, ``.metadata`` matches its
    recorded size and checksum, and every data file exists with at least its recorded size. Records are then checked
    one by one as they are read. ``full=True`` also reads every record of every file and checks its checksum.

    Rank 0 only (or any single process).

    Raises:
        NotACheckpointError: No ``.commit`` marker: the save did not finish, or lightning_dcp did not write it.
        CorruptCheckpointError: A file is missing, truncated or altered (the error names it).
    """
    marker = read_commit(location)
    if marker is None:
        raise NotACheckpointError(
            f"{location.url!r} has no {COMMIT_FILE!r} marker: its save did not finish, or lightning_dcp did not write"
            " it. Resume from a complete checkpoint (a plain DCP checkpoint loads with"
            " `torch.distributed.checkpoint.load`)."
        )
    try:
        with location.open(METADATA_FILE) as f:
            metadata_bytes = f.read()
    except FileNotFoundError as err:
        raise CorruptCheckpointError(
            f"{location.url!r} is committed but {METADATA_FILE} is missing.", file=METADATA_FILE
        ) from err
    expected = marker["metadata"]
    if len(metadata_bytes) != expected["size"] or checksum(metadata_bytes) != expected["checksum"]:
        raise CorruptCheckpointError(
            f"{location.url!r}: {METADATA_FILE} does not match the size and checksum recorded at save.",
            file=METADATA_FILE,
        )
    sizes = _file_sizes(location)
    for name, entry in marker["files"].items():
        if name not in sizes:
            raise CorruptCheckpointError(f"{location.url!r}: data file {name} is missing.", file=name)
        if sizes[name] < entry["size"]:
            raise CorruptCheckpointError(
                f"{location.url!r}: data file {name} is truncated ({sizes[name]} of {entry['size']} bytes).", file=name
            )
    if full:
        for name, entry in marker["files"].items():
            _verify_file(location, name, entry["records"])
    return load_metadata(io.BytesIO(metadata_bytes))


def _file_sizes(location: Location) -> dict[str, int]:
    entries = location.fs.ls(location.path, detail=True)
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries if e["type"] == "file"}


def _verify_file(location: Location, name: str, records: list[list[int]]) -> None:
    with location.open(name) as f:
        for offset, length, digest in sorted(records):
            f.seek(offset)
            data = f.read(length)
            if len(data) != length or checksum(data) != digest:
                raise CorruptCheckpointError(
                    f"{location.url!r}: data file {name} is corrupt at bytes {offset}..{offset + length}.", file=name
                )


def newest_valid_sibling(location: Location, *, exclude: Location) -> tuple[Location, Metadata] | None:
    """The most recently committed checkpoint beside ``location`` that passes the fast checks, if any.

    Candidates are the directories in the same parent that carry a ``.commit`` marker, newest ``committed_at``
    first; ``exclude`` (the checkpoint that failed, and the target of a link to it) is skipped.

    Rank 0 only (or any single process).
    """
    parent = location.sibling("")
    try:
        entries = parent.fs.ls(parent.path, detail=False)
    except FileNotFoundError:
        return None
    skip = {exclude.path.rstrip("/"), location.path.rstrip("/")}
    if location.local:
        skip.add(os.path.realpath(location.path))
    candidates = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(".") or entry.rstrip("/") in skip:
            continue
        candidate = location.sibling(name)
        if location.local and os.path.realpath(candidate.path) in skip:
            continue
        try:
            marker = read_commit(candidate)
        except (NotADirectoryError, CorruptCheckpointError):
            continue
        if marker is not None:
            candidates.append((marker.get("committed_at", 0.0), candidate))
    for _, candidate in sorted(candidates, key=lambda c: c[0], reverse=True):
        try:
            return candidate, check_checkpoint(candidate)
        except NotACheckpointError:
            continue
    return None


def verify_checkpoint(
    path: str | os.PathLike, *, full: bool = True, storage_options: dict[str, Any] | None = None
) -> None:
    """Check that the checkpoint at ``path`` is committed and every byte matches what was saved.

    Args:
        path: Checkpoint directory (local path or fsspec URL).
        full: Read every record of every data file and check its checksum (default). ``False``: the fast checks that
            also run before every load (commit marker, ``.metadata`` checksum, data file sizes).
        storage_options: fsspec options for remote storage.

    Rank 0 only (or any single process).

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        NotACheckpointError: No commit marker (an incomplete save), a single file (a ``.ckpt`` has no recorded
            checksums) or a folder of checkpoints (a run's dirpath) rather than one.
        CorruptCheckpointError: A file is missing, truncated or altered; ``err.file`` names it.
    """
    given = Location(path, storage_options=storage_options)
    location = given.resolve()
    if not location.exists():
        raise checkpoint_not_found(location.url, designated_by=None if location.url == given.url else given.url)
    not_one = not_one_checkpoint(location)
    if not_one is not None:
        raise not_one
    check_checkpoint(location, full=full)


def checkpoints_inside(location: Location) -> list[str]:
    """Names of the committed checkpoint directories directly inside ``location`` (e.g. a run's dirpath), sorted.

    Rank 0 only (or any single process).
    """
    return sorted(
        name
        for name, kind in location.entries()
        if kind == "directory" and not name.startswith(".") and location.child(name).is_committed()
    )


def not_one_checkpoint(location: Location) -> NotACheckpointError | None:
    """The error for an existing path that is a single file or a folder of checkpoints, rather than one checkpoint.

    ``None`` when ``location`` is a directory that is not a folder of checkpoints (the usual checks then apply).
    """
    if not location.isdir():
        return NotACheckpointError(
            f"{location.url!r} is a single file, not a checkpoint directory: only directories carry the checksums"
            " lightning_dcp verifies (a single-file checkpoint loads with `torch.load`)."
        )
    if location.is_committed():
        return None
    inside = checkpoints_inside(location)
    if not inside:
        return None
    shown = ", ".join(inside[:4]) + (f", ... ({len(inside) - 4} more)" if len(inside) > 4 else "")
    example = location.url.rstrip("/") + "/" + inside[-1]
    return NotACheckpointError(
        f"{location.url!r} is a folder of {len(inside)} checkpoint(s) ({shown}), not one checkpoint: pass one of"
        f" them, e.g. {example!r}."
    )
