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
old way. This module holds the format (no I/O): the writer in :mod:`lightning_dcp.engine.dcp_io` encodes it, the
restore in :mod:`lightning_dcp.engine.index_load` parses it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["INDEX_VERSION", "IndexedRecord", "encode_index", "parse_index"]

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
        shape: The tensor's shape (a whole tensor), or ``None`` for a bytes entry or a chunk.
    """

    file: str
    offset: int
    length: int
    checksum: int
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None


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


def parse_index(marker: dict[str, Any]) -> dict[str, IndexedRecord] | None:
    """The records of a parsed ``.commit`` marker by FQN, from its index; ``None`` where it cannot serve a restore.

    ``None`` when the marker has no index (written before it existed, or by the memory tier), when the index is of
    another version or malformed, when a tensor is saved in chunks, or when an FQN has two records: the caller then
    restores the general way (``.metadata`` and DCP's planning), which checks everything itself. Every record
    listed here lies inside its file as ``.commit`` records it (:func:`~lightning_dcp.engine.marker.parse_commit`
    checked the records; the index only names them).
    """
    index = marker.get("index")
    if not isinstance(index, dict) or index.get("version") != INDEX_VERSION:
        return None
    files = index.get("files")
    if not isinstance(files, dict) or set(files) != set(marker["files"]):
        return None
    found: dict[str, IndexedRecord] = {}
    dtypes, shapes, new = _DTYPES, {}, tuple.__new__  # (no NamedTuple.__new__ call per record)
    for name, entries in files.items():
        records = marker["files"][name]["records"]
        if not isinstance(entries, list) or len(entries) != len(records):
            return None
        for entry, (offset, length, digest) in zip(entries, records, strict=True):
            if type(entry) is not list or not entry or type(entry[0]) is not str:
                return None
            fqn = entry[0]
            if len(entry) == 1:
                found[fqn] = new(IndexedRecord, (name, offset, length, digest, None, None))
            elif len(entry) == 3 and type(entry[2]) is list:
                dtype = dtypes.get(entry[1]) if type(entry[1]) is str else None
                key = tuple(entry[2])
                shape = shapes.get(key)
                if shape is None:
                    if not all(type(d) is int and d >= 0 for d in key):
                        return None
                    shape = shapes[key] = key
                if dtype is None:
                    return None
                found[fqn] = new(IndexedRecord, (name, offset, length, digest, dtype, shape))
            else:  # a chunk, or something else: the general way
                return None
    if len(found) != sum(len(entries) for entries in files.values()):
        return None  # an FQN with two records
    return found
