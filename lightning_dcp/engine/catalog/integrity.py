"""Checking a checkpoint before it is loaded: committed, metadata intact, data files whole; full verification.

A committed checkpoint is exactly what its ``.commit`` marker says (:mod:`lightning_dcp.engine.format.marker`): the
marker must be valid, ``.metadata`` must match its recorded size and checksum, every record the metadata points at must
be listed in the marker, and every data file must be at least its recorded size. Records are then checked one by one as
they are read (:mod:`lightning_dcp.engine.save.dcp_io`); ``full=True`` reads them all here.

This module also lists the committed checkpoints of a directory, newest first: what ``ckpt_path="last"`` chooses
from. Links and pointers are never candidates: only real checkpoint directories inside the directory are.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp.engine.catalog.metadata import MAX_METADATA_BYTES, load_metadata
from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE, checksum, order_key, run_of
from lightning_dcp.engine.format.record_index import IndexEntry, disagreement, parse_index
from lightning_dcp.engine.storage.commit_reads import read_commit_orders
from lightning_dcp.engine.storage.localfs import is_internal_name
from lightning_dcp.engine.storage.location import Location, read_commit, unreadable
from lightning_dcp.errors import (
    BucketNotFoundError,
    CheckpointError,
    CorruptCheckpointError,
    InvalidPathError,
    NotACheckpointError,
    StorageUnavailableError,
)

__all__ = [
    "Committed",
    "check_checkpoint",
    "check_indexed",
    "checkpoints_inside",
    "committed_checkpoints",
    "newest_valid",
    "not_one_checkpoint",
]


def check_checkpoint(
    location: Location, *, full: bool = False, progress: Callable[[int, int], None] | None = None
) -> Metadata:
    """Check that ``location`` holds a complete, undamaged checkpoint and return its DCP metadata.

    Fast mode (``full=False``, run before every load) reads only ``.commit``, ``.metadata`` and the directory
    listing; ``full=True`` also reads every record of every data file and checks its checksum, calling ``progress``
    (if given) with ``(0, total)`` first and then after each record with its bytes and ``total``, the bytes of all
    records.

    Rank 0 only (or any single process).

    Raises:
        NotACheckpointError: No ``.commit`` marker: the save did not finish, or lightning_dcp did not write it.
        CorruptCheckpointError: The marker is invalid, or a file is missing, truncated or altered (the error names
            it), or the metadata points at records the marker does not list, or the marker's record index
            disagrees with ``.metadata``.
    """
    marker, metadata_bytes = _marker_and_metadata(location)
    try:
        metadata = load_metadata(metadata_bytes, where=f"{location.url}/{METADATA_FILE}")
    except NotACheckpointError as err:  # checksum-consistent yet invalid: a crafted or buggy writer
        raise CorruptCheckpointError(str(err), file=METADATA_FILE) from None
    _check_records(location, marker, metadata)
    _check_index(location, marker, metadata)
    _check_sizes(location, marker)
    if full:
        total = sum(record[1] for entry in marker["files"].values() for record in entry["records"])
        if progress is not None:
            progress(0, total)  # before the first record's read (a bar shows from the start, also for no records)
        for name, entry in marker["files"].items():
            _verify_file(location, name, entry["records"], progress, total)
    return metadata


def check_indexed(location: Location) -> tuple[dict[str, Any], dict[str, IndexEntry]] | None:
    """:func:`check_checkpoint` (fast mode) for a restore through the record index, without parsing ``.metadata``.

    The marker, the size and checksum of ``.metadata`` and the data files' sizes are checked as there; instead of
    the parsed metadata, returns ``(marker, records)``: the marker and its record index
    (:func:`~lightning_dcp.engine.format.record_index.parse_index`). ``None`` when the marker has no usable index (then
    call :func:`check_checkpoint`).

    Rank 0 only (or any single process).

    Raises:
        NotACheckpointError, CorruptCheckpointError: As :func:`check_checkpoint`.
    """
    marker, _ = _marker_and_metadata(location)
    records = parse_index(marker)
    if records is None:
        return None
    _check_sizes(location, marker)
    return marker, records


def _marker_and_metadata(location: Location) -> tuple[dict[str, Any], bytes]:
    """The checkpoint's parsed ``.commit`` and the bytes of its ``.metadata``, which must match the marker."""
    marker = read_commit(location)
    if marker is None:
        raise NotACheckpointError(
            f"{location.url!r} has no {COMMIT_FILE!r} marker: its save did not finish, or lightning_dcp did not write"
            " it. Resume from a complete checkpoint (a plain DCP checkpoint loads with"
            " `torch.distributed.checkpoint.load`)."
        )
    try:
        with location.open(METADATA_FILE) as f:
            metadata_bytes = f.read(MAX_METADATA_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError) as err:
        raise CorruptCheckpointError(
            f"{location.url!r} is committed but {METADATA_FILE} is missing.", file=METADATA_FILE
        ) from err
    except OSError as err:
        raise unreadable(location, METADATA_FILE, err) from err
    expected = marker["metadata"]
    if len(metadata_bytes) != expected["size"] or checksum(metadata_bytes) != expected["checksum"]:
        raise CorruptCheckpointError(
            f"{location.url!r}: {METADATA_FILE} does not match the size and checksum recorded at save.",
            file=METADATA_FILE,
        )
    return marker, metadata_bytes


def _check_sizes(location: Location, marker: dict[str, Any]) -> None:
    """Every data file the marker lists exists and is at least its recorded size."""
    sizes = location.sizes()
    for name, entry in marker["files"].items():
        if name not in sizes:
            raise CorruptCheckpointError(f"{location.url!r}: data file {name} is missing.", file=name)
        if sizes[name] < entry["size"]:
            raise CorruptCheckpointError(
                f"{location.url!r}: data file {name} is truncated ({sizes[name]} of {entry['size']} bytes).", file=name
            )


def _check_records(location: Location, marker: dict[str, Any], metadata: Metadata) -> None:
    """Every record the metadata points at is listed, with the same length, in the marker."""
    listed = {
        (name, offset): length for name, entry in marker["files"].items() for offset, length, _ in entry["records"]
    }
    for index, info in metadata.storage_data.items():
        if listed.get((info.relative_path, info.offset)) != info.length:
            raise CorruptCheckpointError(
                f"{location.url!r}: the metadata's record of {index.fqn!r} ({info.relative_path}, bytes"
                f" {info.offset}..{info.offset + info.length}) has no checksum in {COMMIT_FILE}: the checkpoint's"
                " files and its commit marker disagree.",
                file=COMMIT_FILE,
            )


def _check_index(location: Location, marker: dict[str, Any], metadata: Metadata) -> None:
    """The record index, where a restore would use it, names what ``.metadata`` holds at every record."""
    records = parse_index(marker)
    found = None if records is None else disagreement(records, metadata)
    if found is not None:
        raise CorruptCheckpointError(
            f"{location.url!r}: the record index in {COMMIT_FILE} disagrees with {METADATA_FILE} ({found}): a restore"
            " through it would load tensors into the wrong entries. Resume from another checkpoint, or read this one"
            f' the general way after removing the "index" key of {COMMIT_FILE} (`torch.distributed.checkpoint.load`'
            " reads it by .metadata alone).",
            file=COMMIT_FILE,
        )


def _verify_file(
    location: Location,
    name: str,
    records: list[list[int]],
    progress: Callable[[int, int], None] | None,
    total: int,
) -> None:
    try:
        f = location.open(name)
    except OSError as err:
        raise unreadable(location, name, err) from err
    with f:
        for offset, length, digest in sorted(records):
            f.seek(offset)
            data = f.read(length)
            if len(data) != length or checksum(data) != digest:
                raise CorruptCheckpointError(
                    f"{location.url!r}: data file {name} is corrupt at bytes {offset}..{offset + length}.", file=name
                )
            if progress is not None:
                progress(length, total)


class Committed(tuple):
    """``(order key, checkpoint)``: one committed checkpoint of a listing, with the run that saved it (``run``).

    A pair, so that ``for key, checkpoint in committed_checkpoints(d)`` reads it; ``run`` is
    :func:`~lightning_dcp.engine.format.marker.run_of` of its marker (``None``: recorded none).
    """

    run: str | None

    def __new__(cls, key: tuple, location: Location, run: str | None = None) -> Committed:
        """The entry ``(key, location)`` of a checkpoint that ``run`` saved."""
        entry = super().__new__(cls, (key, location))
        entry.run = run
        return entry


def committed_checkpoints(directory: Location, *, whole: bool = True) -> list[Committed]:
    """``(order key, checkpoint)`` of every committed checkpoint directly inside ``directory``, newest first.

    The order is the one recorded in each ``.commit`` (:func:`~lightning_dcp.engine.format.marker.order_key`: the
    directory's save counter, then the global step), never a wall clock.

    Only real directories with a ``.commit`` marker count: this library's hidden entries (staging, upload
    snapshots), symlinks (``save_last="link"``)
    and pointer objects are skipped, so a link can never lead the choice outside ``directory``. A directory whose
    marker is malformed is skipped with a warning. Rank 0 only (or any single process).

    Args:
        directory: The directory to list.
        whole: Read and check every marker whole. ``False`` reads only the order at each marker's end
            (:func:`~lightning_dcp.engine.storage.commit_reads.read_commit_orders`; 4 KB instead of the whole marker,
            e.g. 840 KB for 2,800 tensors with their optimizer state): for callers that only rank checkpoints and
            check whole whatever they then open (a load's candidates, :func:`newest_valid`, save counters). A
            marker damaged before its end is then listed, and refused when it is opened.
    """
    candidates = []
    for name, kind in directory.entries(follow_links=False):
        if kind != "directory" or is_internal_name(name):
            continue
        try:
            candidates.append(directory.child(name))
        except InvalidPathError:
            continue  # a name no checkpoint of ours can have (another tool's object, e.g. "notes?v=1")
    if whole:
        markers = [_whole_marker(candidate) for candidate in candidates]
    else:
        markers = read_commit_orders(directory, [candidate.name for candidate in candidates])
    found = []
    for candidate, marker in zip(candidates, markers, strict=True):
        if isinstance(marker, CheckpointError):
            warnings.warn(f"lightning_dcp: skipping {candidate.url!r}: {marker}", stacklevel=2)
        elif marker is not None:
            found.append(Committed(order_key(marker), candidate, run_of(marker)))
    return sorted(found, key=lambda entry: (entry[0], entry[1].name), reverse=True)


def _whole_marker(location: Location) -> dict[str, Any] | CheckpointError | None:
    """:func:`read_commit` of ``location``, its ``CheckpointError`` returned rather than raised.

    Raises:
        StorageUnavailableError, BucketNotFoundError: The store, not this checkpoint (never an empty-looking listing).
    """
    try:
        return read_commit(location)
    except (StorageUnavailableError, BucketNotFoundError):
        raise
    except CheckpointError as err:
        return err


def newest_valid(
    directory: Location, found: list[tuple[tuple, Location]] | None = None
) -> tuple[Location, Metadata] | None:
    """The newest committed checkpoint in ``directory`` that passes the fast checks, with its metadata; ``None``.

    ``found``: the committed checkpoints to choose from, newest first, when the caller listed them already (both
    tiers of a local tier); by default :func:`committed_checkpoints` of ``directory``. Rank 0 only (or any single
    process).
    """
    for _, candidate in committed_checkpoints(directory, whole=False) if found is None else found:
        try:
            return candidate, check_checkpoint(candidate)
        except NotACheckpointError:
            continue
    return None


def checkpoints_inside(location: Location) -> list[str]:
    """Names of the committed checkpoint directories directly inside ``location`` (e.g. a run's dirpath), sorted.

    Rank 0 only (or any single process).
    """
    return sorted(checkpoint.name for _, checkpoint in committed_checkpoints(location))


def not_one_checkpoint(location: Location) -> CheckpointError | None:
    """The error for an existing path that is a single file or a folder of checkpoints, rather than one checkpoint.

    ``None`` when ``location`` is a directory that is not a folder of checkpoints (the usual checks then apply). A
    local path that exists but cannot be followed (a symlink loop) is a ``CorruptCheckpointError``.
    """
    if location.local:
        try:
            os.stat(location.path)
        except OSError as err:
            return unreadable(location, os.path.basename(location.path.rstrip("/")), err)
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
