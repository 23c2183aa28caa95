"""Checking parsed DCP metadata before anything reads with it: what a crafted ``.metadata`` must not get past.

Entry kinds, dtypes and shapes; chunks inside their tensor and tiling it; every storage record naming a plain file
inside the checkpoint directory, at a valid offset, without overlapping another, and large enough for its chunk;
``planner_data`` paths that join to their keys. :func:`metadata_problem` says what is wrong, or ``None``.

A checkpoint holds thousands of small entries: the common layout (every tensor one chunk, every field of the type
DCP writes) is checked first with C-level passes over all entries at once (:func:`_plainly_valid`, ~5x faster than
the per-entry checks on 7,600 tensors); anything else, valid or not, goes through the per-entry checks
(:func:`_problem`), which name what is wrong. The fast pass only ever accepts what the per-entry checks accept
(property-tested in ``tests/unit/engine/format/test_metadata_check.py``).
"""

from __future__ import annotations

import itertools
import math
import operator
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from lightning_dcp._compat.torch_dcp import StorageInfo
from lightning_dcp.engine.format.marker import is_plain_name

__all__ = ["metadata_problem"]


def metadata_problem(metadata: Metadata) -> str | None:
    """What makes ``metadata`` (unpickled from an untrusted ``.metadata``) untrustworthy for a reader, or ``None``.

    Raises:
        AttributeError, TypeError, ValueError: An object built without (or with odd) fields; the caller reports it
            as invalid metadata.
    """
    try:
        if _plainly_valid(metadata):
            return None
    except Exception:  # an odd field anywhere: the per-entry checks find and name it
        pass
    return _problem(metadata)


_MAX_UINT = 2**63
_FIELD = operator.attrgetter


def _plainly_valid(metadata: Metadata) -> bool:
    """Whether ``metadata`` is in the common layout and passes every check of :func:`_problem`.

    ``False`` means only "not shown here": the per-entry checks decide. Each test is a C-level pass (``map``, ``set``,
    list equality) over all entries; only the overlap and size comparisons loop in Python, on ints.
    """
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        return False
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        return False
    if not (set(map(type, entries)) <= _STR and set(map(type, entries.values())) <= _ENTRY_TYPES):
        return False
    tensor_keys = [key for key, meta in entries.items() if type(meta) is TensorStorageMetadata]
    tensors = list(map(entries.__getitem__, tensor_keys))
    dtypes = list(map(_FIELD("properties.dtype"), tensors))
    shapes = list(map(_FIELD("size"), tensors))
    chunks = list(map(_FIELD("chunks"), tensors))
    if not (
        set(map(type, dtypes)) <= _DTYPE
        and set(map(type, shapes)) <= _SHAPE
        and set(map(type, chunks)) <= _LIST
        and set(map(len, chunks)) <= _ONE
    ):
        return False
    chunks = list(map(operator.itemgetter(0), chunks))
    if not set(map(type, chunks)) <= _CHUNK:
        return False
    offsets, sizes = list(map(_FIELD("offsets"), chunks)), list(map(_FIELD("sizes"), chunks))
    if not (
        set(map(type, offsets)) <= _SHAPE
        and set(map(type, sizes)) <= _SHAPE
        and _all_uints(itertools.chain.from_iterable(shapes))
        and sizes == shapes  # each tensor's one chunk is the whole tensor (its ints: equal, so in range)
        and set(map(type, itertools.chain.from_iterable(sizes))) <= _INT
        and set(map(type, itertools.chain.from_iterable(offsets))) <= _INT
        and not any(map(any, offsets))  # at offset 0
        and list(map(len, offsets)) == list(map(len, shapes))
    ):
        return False
    if metadata.planner_data is not None and not _plain_mappings(metadata.planner_data, len(entries)):
        return False
    indexes, infos = list(storage), list(storage.values())
    if not (set(map(type, indexes)) <= _INDEX and set(map(type, infos)) <= _INFO):
        return False
    fqns, record_offsets = list(map(_FIELD("fqn"), indexes)), list(map(_FIELD("offset"), indexes))
    names, starts, lengths = (list(map(_FIELD(f), infos)) for f in ("relative_path", "offset", "length"))
    if not (
        entries.keys() >= set(fqns)
        and set(map(type, record_offsets)) <= _SHAPE_OR_NONE
        and len(set(zip(fqns, record_offsets, strict=True))) == len(indexes)  # one record per chunk start
        and _all_uints(itertools.chain.from_iterable(filter(None, record_offsets)))
        and set(map(type, names)) <= _STR
        and all(map(is_plain_name, set(names)))
        and _all_uints(starts)
        and _all_uints(lengths)
    ):
        return False
    spans = sorted(zip(names, starts, lengths, strict=True))
    for (name, start, length), (next_name, next_start, _) in itertools.pairwise(spans):
        if name == next_name and start + length > next_start:
            return False
    # Each tensor's chunk (at offset 0) needs a record at offset 0 of its rank that can hold its bytes; the last such
    # record of each key is the one the per-entry checks look up.
    held = {
        fqn: (len(where), length)
        for fqn, where, length in zip(fqns, record_offsets, lengths, strict=True)
        if where is not None and not any(where)
    }
    needed = map(operator.mul, map(math.prod, shapes), map(_FIELD("itemsize"), dtypes))
    for record, shape, nbytes in zip(map(held.get, tensor_keys), shapes, needed, strict=True):
        if record is None or record[0] != len(shape) or record[1] < nbytes:
            return False
    blobs = (key for key, meta in entries.items() if type(meta) is BytesStorageMetadata)
    return all(MetadataIndex(key) in storage for key in blobs)


def _plain_mappings(mappings: Any, entries: int) -> bool:
    """Whether ``planner_data`` passes :func:`_mappings_problem`, shown with C-level passes (``False``: not shown)."""
    if type(mappings) is not dict:
        return False
    paths = list(mappings.values())
    if not (set(map(type, paths)) <= _TUPLE and all(paths)):
        return False
    parts = list(itertools.chain.from_iterable(paths))
    if not set(map(type, parts)) <= _STR_INT:
        return False
    indices = [part for part in parts if type(part) is int]
    if not _all_uints(indices):
        return False
    # The lists a load rebuilds hold at most (largest index + 1) slots per indexed prefix, and there are at most as
    # many indexed prefixes as indices: a bound within _mappings_problem's limit passes it.
    if indices and (max(indices) + 1) * len(indices) > 16 * entries + 1024:
        return False
    return list(map(".".join, map(partial(map, str), paths))) == list(mappings)


def _all_uints(values: Any) -> bool:
    """Whether every item of the iterable ``values`` is an ``int`` (not a bool) in ``[0, 2**63)``."""
    values = list(values)
    return set(map(type, values)) <= _INT and (not values or (min(values) >= 0 and max(values) < _MAX_UINT))


_STR, _INT, _TUPLE, _LIST, _ONE = {str}, {int}, {tuple}, {list}, {1}
_STR_INT = {str, int}

_DTYPE, _CHUNK, _INDEX, _INFO = {torch.dtype}, {ChunkStorageMetadata}, {MetadataIndex}, {StorageInfo}
_SHAPE = {torch.Size, tuple}
_SHAPE_OR_NONE = {torch.Size, tuple, type(None)}
_ENTRY_TYPES = {TensorStorageMetadata, BytesStorageMetadata}


def _problem(metadata: Metadata) -> str | None:
    """What makes ``metadata`` untrustworthy for a reader, or ``None``.

    One pass per collection, entry by entry, naming the first problem found.
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
    seen: set[tuple[str, tuple | None]] = set()
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
        where = None if offsets is None else tuple(offsets)
        if (index.fqn, where) in seen:  # equal keys of one dict (edited after insertion): a lookup gets either
            return f"two storage records of {index.fqn!r} start at offset {where}"
        seen.add((index.fqn, where))
        if where is not None:
            lengths[(index.fqn, where)] = info.length
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
