"""Reading DCP's ``.metadata`` safely: an allow-listed unpickler, then a check of everything a reader relies on.

DCP reads ``.metadata`` with a plain ``pickle.load``, so a crafted file runs code. Here only DCP's own metadata
classes may be named, the bytes are read whole first (bounded: a claimed 16 TB string fails as truncated instead of
allocating), and the result is checked before anything uses it: entry kinds, dtypes and shapes, chunks inside their
tensor, and every storage record pointing at a plain file name inside the checkpoint directory. Any failure is a
:class:`~lightning_dcp.errors.NotACheckpointError` naming the file.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import math
import pickle
import threading
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from lightning_dcp._compat import StorageInfo
from lightning_dcp.engine.gc_pause import gc_paused
from lightning_dcp.engine.marker import METADATA_FILE, is_plain_name
from lightning_dcp.engine.storage import Location
from lightning_dcp.errors import CheckpointError, NotACheckpointError

__all__ = ["MAX_METADATA_BYTES", "load_metadata", "read_metadata"]

MAX_METADATA_BYTES = 1 << 30
"""Largest ``.metadata`` accepted (DCP writes ~200 bytes per tensor chunk: 1 GiB is millions of chunks)."""

_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global (a callable that would run code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise NotACheckpointError(
            f"The DCP metadata refers to {module}.{name}, which is not part of DCP's metadata format; refusing to"
            " load it (a crafted checkpoint could run code this way)."
        )


def load_metadata(data: bytes, *, where: str = METADATA_FILE) -> Metadata:
    """Unpickle DCP's ``.metadata`` from its bytes, allowing only DCP's metadata classes, and check it.

    Args:
        data: The whole file.
        where: The file, for messages (a URL or name).

    The last few results are remembered by the bytes' checksum (a load reads the same ``.metadata`` when it checks
    the checkpoint and again when DCP plans the read; unpickling DCP's metadata costs ~0.1 ms per tensor): a
    repeated call returns a copy of the checked result whose ``storage_meta`` is its own.

    Raises:
        NotACheckpointError: The bytes name anything else, are not DCP metadata, or describe records a reader
            could not trust (see the module docstring).
    """
    key = (len(data), xxhash.xxh3_128_digest(data))
    with _PARSED_LOCK:
        cached = _PARSED.get(key)
    if cached is not None:
        storage_meta = copy.copy(cached.storage_meta) if cached.storage_meta is not None else None
        return dataclasses.replace(cached, storage_meta=storage_meta)
    metadata = _parse(data, where)
    with _PARSED_LOCK:
        _PARSED[key] = metadata
        while len(_PARSED) > _MAX_PARSED:
            _PARSED.pop(next(iter(_PARSED)))
    return load_metadata(data, where=where)


_PARSED: dict[tuple[int, bytes], Metadata] = {}
_PARSED_LOCK = threading.Lock()
_MAX_PARSED = 4


def _parse(data: bytes, where: str) -> Metadata:
    with gc_paused():  # ~10 objects per tensor: collections would cost 10x the unpickling and the checks
        return _parse_checked(data, where)


def _parse_checked(data: bytes, where: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as err:  # a refused global: name the file it came from
        raise NotACheckpointError(f"{where}: {err}") from None
    except (Exception, RecursionError, MemoryError) as err:  # crafted pickles raise many types
        raise NotACheckpointError(f"{where} is not DCP metadata ({type(err).__name__}: {err}).") from None
    if not isinstance(metadata, Metadata):
        raise NotACheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP metadata.")
    try:
        problem = _problem(metadata)
    except (AttributeError, TypeError, ValueError) as err:  # an object built without (or with odd) fields
        problem = f"a field is missing or of the wrong type ({type(err).__name__}: {err})"
    if problem is not None:
        raise NotACheckpointError(f"{where} is not valid DCP metadata: {problem}.")
    return metadata


def read_metadata(location: Location) -> Metadata:
    """Read and check the DCP metadata of the checkpoint directory at ``location`` (:func:`load_metadata`).

    Rank 0 only (or any single process).

    Raises:
        NotACheckpointError: It cannot be read, is larger than :data:`MAX_METADATA_BYTES`, or is not valid.
    """
    try:
        with location.open(METADATA_FILE) as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except CheckpointError:
        raise
    except Exception as err:
        raise NotACheckpointError(f"Cannot read the DCP metadata of {location.url!r}: {err}") from err
    if len(data) > MAX_METADATA_BYTES:
        raise NotACheckpointError(f"{location.url}/{METADATA_FILE} is larger than {MAX_METADATA_BYTES} bytes.")
    return load_metadata(data, where=f"{location.url}/{METADATA_FILE}")


def _problem(metadata: Metadata) -> str | None:
    """What makes ``metadata`` untrustworthy for a reader, or ``None``.

    One pass per collection, with the common case (one chunk covering its tensor, a few file names) checked first:
    a checkpoint of 7,600 small tensors is checked in ~30 ms.
    """
    entries = metadata.state_dict_metadata
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        return f"'storage_meta' is a {type(metadata.storage_meta).__name__}"
    if not isinstance(entries, dict):
        return "'state_dict_metadata' is not a dict"
    for key, meta in entries.items():
        if type(key) is not str:
            return f"entry key {key!r} is not a string"
        if isinstance(meta, TensorStorageMetadata):
            problem = _tensor_problem(meta)
            if problem is not None:
                return f"entry {key!r}: {problem}"
        elif not isinstance(meta, BytesStorageMetadata):
            return f"entry {key!r} is a {type(meta).__name__}"
    mappings = metadata.planner_data
    if mappings is not None:
        problem = _mappings_problem(mappings, len(entries))
        if problem is not None:
            return problem
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        return "'storage_data' is not a dict"
    plain: dict[object, bool] = {}  # file name -> is_plain_name (a checkpoint has a few files, many records)
    spans = []
    lengths = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or index.fqn not in entries:
            return f"a storage record names {getattr(index, 'fqn', index)!r}, which has no entry"
        offsets = index.offset
        if offsets is not None and not (isinstance(offsets, (tuple, list)) and _uints(offsets)):
            return f"the storage record of {index.fqn!r} is at offset {offsets!r}"
        if not isinstance(info, StorageInfo):
            return f"the storage record of {index.fqn!r} is a {type(info).__name__}"
        name = info.relative_path
        ok = plain.get(name) if type(name) is str else False
        if ok is None:
            ok = plain[name] = is_plain_name(name)
        if not ok:
            return f"the record of {index.fqn!r} points at {name!r}, outside the checkpoint directory"
        if not (_uint(info.offset) and _uint(info.length)):
            return f"the record of {index.fqn!r} has offset {info.offset!r} and length {info.length!r}"
        spans.append((name, info.offset, info.length, index.fqn))
        if offsets is not None:
            lengths[(index.fqn, tuple(offsets))] = info.length
    # Records never share bytes (DCP writes each item once): a crafted metadata pointing many chunks at one record
    # would make a reader allocate and read it many times over.
    spans.sort()
    for (name, offset, length, fqn), (next_name, next_offset, _, next_fqn) in itertools.pairwise(spans):
        if name == next_name and offset + length > next_offset:
            return f"the records of {fqn!r} and {next_fqn!r} overlap in {name}"
    # Every tensor chunk has a record that can hold its bytes: this bounds what a reader allocates by what the
    # files hold (a crafted entry cannot make a reader allocate terabytes for a tiny file).
    for key, meta in entries.items():
        if not isinstance(meta, TensorStorageMetadata):
            if MetadataIndex(key) not in storage:
                return f"the entry {key!r} has no storage record"
            continue
        itemsize = meta.properties.dtype.itemsize
        for chunk in meta.chunks:
            length = lengths.get((key, tuple(chunk.offsets)))
            nbytes = math.prod(chunk.sizes) * itemsize
            if length is None or length < nbytes:
                return f"a chunk of {key!r} at {tuple(chunk.offsets)} ({nbytes} bytes) has no record that holds it"
    return None


def _mappings_problem(mappings: Any, entries: int) -> str | None:
    """Check ``planner_data``: each flat key's path in the nested state dict, as DCP's flattening writes it.

    A path joins to its key (``("optimizer_states", 0, "state")`` is ``"optimizer_states.0.state"``), and the list
    indices in it stay small: the lists a load rebuilds from them hold at most a few slots per entry (an index of
    10**9 would make a reader append a billion placeholders).
    """
    if not isinstance(mappings, dict):
        return "'planner_data' is not a dict"
    slots: dict[tuple, int] = {}
    for key, path in mappings.items():
        types = set(map(type, path)) if isinstance(path, (tuple, list)) else None
        indexed = types is not None and int in types
        if (
            not path
            or types is None
            or not types <= _STR_INT
            or (indexed and not all(_uint(p) for p in path if type(p) is int))
            or ".".join(map(str, path)) != key
        ):
            return f"the path of {key!r} in 'planner_data' is {path!r}, not the names and indices of that key"
        if indexed:
            for depth, part in enumerate(path):
                if type(part) is int:
                    slots[tuple(path[:depth])] = max(slots.get(tuple(path[:depth]), 0), part + 1)
    if sum(slots.values()) > 16 * entries + 1024:
        return f"'planner_data' rebuilds lists of {sum(slots.values())} slots for {entries} entries"
    return None


def _tensor_problem(meta: TensorStorageMetadata) -> str | None:
    dtype = getattr(meta.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return f"dtype {dtype!r} is not a torch dtype"
    size = meta.size
    if not isinstance(size, (tuple, list)) or not _uints(size):
        return f"shape {size!r} is not a sequence of non-negative integers"
    if not isinstance(meta.chunks, list):
        return "its chunks are not a list"
    if len(meta.chunks) == 1 and type(meta.chunks[0]) is ChunkStorageMetadata:  # the whole tensor in one chunk
        offsets, sizes = meta.chunks[0].offsets, meta.chunks[0].sizes
        if (
            isinstance(offsets, (tuple, list))
            and isinstance(sizes, (tuple, list))
            and len(offsets) == len(sizes) == len(size)
            and set(map(type, offsets)) <= _INT
            and not any(offsets)
            and set(map(type, sizes)) <= _INT
            and tuple(sizes) == tuple(size)
        ):
            return None
    covered = 0
    for chunk in meta.chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            return f"a chunk is a {type(chunk).__name__}"
        offsets, sizes = chunk.offsets, chunk.sizes
        if not (isinstance(offsets, (tuple, list)) and isinstance(sizes, (tuple, list))):
            return "a chunk's offsets or sizes are not sequences"
        if len(offsets) != len(size) or len(sizes) != len(size):
            return f"a chunk has {len(offsets)} offsets and {len(sizes)} sizes for a {len(size)}-d tensor"
        for o, s, d in zip(offsets, sizes, size, strict=True):
            if not (_uint(o) and _uint(s)) or o + s > d:
                return f"a chunk at {tuple(offsets)} of size {tuple(sizes)} lies outside the shape {tuple(size)}"
        covered += math.prod(sizes)
    if covered != math.prod(size):  # DCP's chunks tile a tensor exactly: a reader allocates what they cover
        return f"its chunks hold {covered} of the {math.prod(size)} elements of its shape {tuple(size)}"
    return None


def _uint(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**63  # not bool (an int subclass), nor any other subclass


def _uints(values: tuple | list) -> bool:
    """Whether every item of ``values`` passes :func:`_uint` (C-level loops: shapes and offsets are many)."""
    return set(map(type, values)) <= _INT and (not values or (min(values) >= 0 and max(values) < 2**63))


_INT = {int}
_STR_INT = {str, int}
