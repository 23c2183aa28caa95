"""The record index in ``.commit``: which state dict entry every record holds, so a restore needs no ``.metadata``.

DCP's ``.metadata`` is one pickle of per-entry objects: a checkpoint of 4,800 small tensors unpickles ~24,000 objects
(~22 ms) and checking them costs as much again, on every rank of every restore. The coordinator already knows, when
it writes ``.commit``, what each record it lists holds; it writes that beside the checksums:

.. code-block:: text

    "index": {"version": 1, "files": {"__0_0.distcp": [ENTRY, ...], ...}}

with one ``ENTRY`` per record of that file, in the order of the file's ``records`` list:

- ``[fqn]``: a DCP bytes entry (``torch.save`` of an object);
- ``[fqn, dtype, shape]``: a whole tensor (``dtype`` as ``str(torch.float32)[6:]``, ``shape`` a list of ints);
- ``[fqn, dtype, sizes, offsets]``: one chunk of a tensor saved in several (row chunks, DTensor shards).

Stock readers ignore it (``.metadata`` is still written and read by ``dcp.load``); a marker without it is read the
old way. This module holds the format (no I/O): the writer in :mod:`lightning_dcp.engine.save.dcp_io` encodes it, the
restore in :mod:`lightning_dcp.engine.load.index_load` parses it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_dcp.engine.format.marker import SEAL_KEY

__all__ = [
    "INDEX_VERSION",
    "IndexEntry",
    "IndexedRecord",
    "disagreement",
    "encode_index",
    "parse_index",
    "record_ends",
    "records_of",
]

INDEX_VERSION = 1

_DTYPES: dict[str, torch.dtype] = {
    str(d)[6:]: d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex128,
        torch.complex64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
"""The dtypes the index names (others are left out of the index: such a checkpoint restores the general way)."""


class IndexedRecord(NamedTuple):
    """One record of the index.

    Attributes:
        file: The data file's name (a plain name inside the checkpoint directory, as ``.commit`` checks).
        offset: Where the record starts in the file (bytes).
        length: The record's length (bytes).
        checksum: Its xxHash3-64 recorded in ``.commit``.
        dtype: The tensor's dtype; ``None`` for a bytes entry.
        shape: The tensor's shape (a whole tensor) or the chunk's sizes (a chunk); ``None`` for a bytes entry.
        chunk: The chunk's offsets in the whole tensor (elements per dimension); ``None`` for a whole tensor or a
            bytes entry.
    """

    file: str
    offset: int
    length: int
    checksum: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    chunk: tuple[int, ...] | None = None


IndexEntry = IndexedRecord | tuple[IndexedRecord, ...]
"""What the index holds for one FQN: its one record, or the records of its chunks (a tuple, in the index's order)."""


def encode_index(metadata: Metadata, per_file: dict[str, list[str]], offsets: dict[str, list[Any]]) -> dict | None:
    """The ``"index"`` value of ``.commit`` (coordinator only).

    Args:
        metadata: The global plan's metadata (``state_dict_metadata``: each entry's dtype and size).
        per_file: ``{file: [fqn of each record, in the order of the file's records]}``.
        offsets: ``{file: [chunk offsets of each record (``None`` for bytes)]}``, aligned with ``per_file``.

    Returns:
        The index, or ``None`` when some entry cannot be described (a dtype it does not name).
    """
    entries = metadata.state_dict_metadata
    files: dict[str, list[list[Any]]] = {}
    described: dict[str, tuple[str, list[int]]] = {}  # per tensor FQN: its dtype name and size, computed once
    for name, fqns in per_file.items():
        out = files[name] = []
        for fqn, chunk in zip(fqns, offsets[name], strict=True):
            meta = entries.get(fqn)
            if not isinstance(meta, TensorStorageMetadata):
                out.append([fqn])
                continue
            known = described.get(fqn)
            if known is None:
                dtype = str(meta.properties.dtype)[6:]
                if dtype not in _DTYPES:
                    return None
                known = described[fqn] = (dtype, list(meta.size))
            sizes = _chunk_sizes(meta, chunk)
            if sizes is None:
                return None
            if sizes == known[1] and (chunk is None or not any(chunk)):
                out.append([fqn, known[0], known[1]])
            else:
                out.append([fqn, known[0], sizes, [0] * len(sizes) if chunk is None else list(chunk)])
    return {"version": INDEX_VERSION, "files": files}


def _chunk_sizes(meta: TensorStorageMetadata, offsets: Any) -> list[int] | None:
    key = tuple(offsets) if offsets is not None else (0,) * len(meta.size)
    for chunk in meta.chunks:
        if tuple(chunk.offsets) == key:
            return list(chunk.sizes)
    return None


def parse_index(marker: dict[str, Any]) -> dict[str, IndexEntry] | None:
    """The records of a parsed ``.commit`` marker by FQN, from its index; ``None`` where it cannot serve a restore.

    A tensor saved whole or a bytes entry maps to its :class:`IndexedRecord`; a tensor saved in chunks maps to the
    tuple of its chunks' records (whether they tile the tensor is for the restore to check against its target).
    ``None`` when the marker has no index (written before it existed, or by the memory tier), when the marker carries
    no checksum of its own (:data:`~lightning_dcp.engine.format.marker.SEAL_KEY`: nothing vouches that the index is the
    one written at save, so ``.metadata`` is read instead; a sealed marker was checked against it by
    :func:`~lightning_dcp.engine.format.marker.parse_commit`), when the index is of
    another version or malformed, or when an FQN has a whole record beside another record: the caller then restores
    the general way (``.metadata`` and DCP's planning), which checks everything itself. Every record listed here lies
    inside its file as ``.commit`` records it (:func:`~lightning_dcp.engine.format.marker.parse_commit` checked the
    records; the index only names them).
    """
    index = marker.get("index")
    if SEAL_KEY not in marker or not isinstance(index, dict) or index.get("version") != INDEX_VERSION:
        return None
    files = index.get("files")
    if not isinstance(files, dict) or set(files) != set(marker["files"]):
        return None
    found: dict[str, IndexEntry] = {}
    chunked: dict[str, list[IndexedRecord]] = {}
    count = 0
    dtypes, shapes, new = _DTYPES, {}, tuple.__new__  # (no NamedTuple.__new__ call per record)
    for name, entries in files.items():
        records = marker["files"][name]["records"]
        if not isinstance(entries, list) or len(entries) != len(records):
            return None
        count += len(entries)
        for entry, (offset, length, digest) in zip(entries, records, strict=True):
            if type(entry) is not list or not entry or type(entry[0]) is not str:
                return None
            fqn, size = entry[0], len(entry)
            if size == 1:
                found[fqn] = new(IndexedRecord, (name, offset, length, digest, None, None, None))
                continue
            if size not in (3, 4) or type(entry[2]) is not list:
                return None
            dtype = dtypes.get(entry[1]) if type(entry[1]) is str else None
            key = tuple(entry[2])
            shape = shapes.get(key)
            if shape is None:
                if not _dims(key):
                    return None
                shape = shapes[key] = key
            if dtype is None:
                return None
            if size == 3:
                found[fqn] = new(IndexedRecord, (name, offset, length, digest, dtype, shape, None))
                continue
            if type(entry[3]) is not list or len(entry[3]) != len(shape) or not _dims(entry[3]):
                return None
            chunk = new(IndexedRecord, (name, offset, length, digest, dtype, shape, tuple(entry[3])))
            chunked.setdefault(fqn, []).append(chunk)
    for fqn, chunks in chunked.items():
        if fqn in found:
            return None  # a whole record beside chunks
        found[fqn] = tuple(chunks)
    if len(found) + sum(len(chunks) - 1 for chunks in chunked.values()) != count:
        return None  # an FQN with two whole records
    return found


def _dims(values: Any) -> bool:
    return all(type(d) is int and d >= 0 for d in values)


def records_of(entry: IndexEntry) -> tuple[IndexedRecord, ...]:
    """The records of one index entry: its one record, or its chunks' records."""
    return entry if type(entry) is tuple else (entry,)


def record_ends(records: dict[str, IndexEntry]) -> dict[str, int]:
    """Where the last record of each data file ends (bytes), by file name."""
    ends: dict[str, int] = {}
    for entry in records.values():
        for record in records_of(entry):
            end = record.offset + record.length
            if end > ends.get(record.file, 0):
                ends[record.file] = end
    return ends


def disagreement(records: dict[str, IndexEntry], metadata: Metadata) -> str | None:
    """Where the record index disagrees with ``.metadata``: the first difference in words, ``None`` when none.

    Every record of the index must be the one ``.metadata`` places there: the same FQN, kind (bytes or tensor),
    dtype, shape or chunk (sizes and offsets), data file, offset and length; and every record of ``.metadata`` must
    be in the index once. A restore through the index reads tensors by it alone, so this is what ``verify`` (and
    every check that parses ``.metadata`` anyway) runs; the restore's own guard is the marker's checksum.
    """
    entries = metadata.state_dict_metadata
    placed = {
        (index.fqn, None if index.offset is None else tuple(index.offset)): info
        for index, info in metadata.storage_data.items()
    }
    matched: set[tuple] = set()
    for fqn, entry in records.items():
        meta = entries.get(fqn)
        if meta is None:
            return f"the index names {fqn!r}, which .metadata does not hold"
        for record in records_of(entry):
            if record.dtype is None:
                if isinstance(meta, TensorStorageMetadata):
                    return f"the index holds {fqn!r} as bytes, .metadata as a tensor"
                key: tuple = (fqn, None)
            else:
                if not isinstance(meta, TensorStorageMetadata):
                    return f"the index holds {fqn!r} as a tensor, .metadata as bytes"
                if meta.properties.dtype != record.dtype:
                    return f"the index gives {fqn!r} dtype {record.dtype}, .metadata {meta.properties.dtype}"
                offsets = record.chunk if record.chunk is not None else (0,) * len(record.shape or ())
                sizes = _chunk_sizes(meta, offsets)
                if sizes is None or tuple(sizes) != record.shape:
                    return f"the index gives {fqn!r} a chunk {record.shape} at {offsets} that .metadata does not hold"
                key = (fqn, offsets)
            info = placed.get(key)
            if info is None or key in matched:
                return f"the index lists the record of {fqn!r} at {key[1]} that .metadata places nowhere (or twice)"
            if (info.relative_path, info.offset, info.length) != (record.file, record.offset, record.length):
                return (
                    f"the index places {fqn!r} at {record.file} bytes {record.offset}..{record.offset + record.length},"
                    f" .metadata at {info.relative_path} bytes {info.offset}..{info.offset + info.length}"
                )
            matched.add(key)
    if len(matched) != len(placed):
        return f"{len(placed) - len(matched)} record(s) of .metadata are not in the index"
    return None
