"""Restoring from the record index in ``.commit``: no ``.metadata``, no DCP planning, one pass over each file.

A resume of a local checkpoint into a target that matches it exactly (the same FQNs, dtypes and shapes; plain,
contiguous CPU tensors: DDP and single-device state) needs none of DCP's machinery: the index in ``.commit``
(:mod:`lightning_dcp.engine.format.record_index`) says which record holds each entry. Each rank then reads its files in
one order, in runs of up to 2 MiB, and for each record checks its checksum against ``.commit`` and its bytes around
the tensor data against the exact layout the writer uses (:func:`~lightning_dcp.engine.format.records.record_frame`,
which fixes dtype and shape), and copies the tensor data into the target; bytes entries (the Trainer state, optimizer
hyperparameters) are unpickled as the general path does (``weights_only``). A record in another framing is decoded
with ``torch.load`` instead. What stock ``dcp.load`` reads from the same files is what lands here.

A tensor the planner saved in row chunks lands chunk by chunk in the rows of its target that each chunk holds.
Anything else (no index, an entry the target lacks or has in another shape or dtype, DTensor or GPU targets,
chunks that do not tile their tensor by rows, object stores) declines before a byte is read, on every rank alike,
and the caller restores the general way (:mod:`lightning_dcp.engine.load.local_load`).

Measured (``small`` mix, 4,815 records, 73 MB, 2 ranks, warm page cache; ``benchmarks.bench_trainer --mix small
--tasks load``): see ``benchmarks/results/TRAINER.md`` and the README's restore table.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import torch
import xxhash

from lightning_dcp._compat.torch_dcp import set_element
from lightning_dcp.engine.agreement import agree
from lightning_dcp.engine.dist import all_true
from lightning_dcp.engine.format.archive import load_checked
from lightning_dcp.engine.format.keys import flatten
from lightning_dcp.engine.format.layout import EXTRA_KEY, RANK_KEY
from lightning_dcp.engine.format.marker import checksum
from lightning_dcp.engine.format.plain_values import NOT_PLAIN, plain_value
from lightning_dcp.engine.format.record_index import IndexedRecord, IndexEntry
from lightning_dcp.engine.format.records import record_frame, tensor_record
from lightning_dcp.engine.load.reading import (
    SMALL_RECORD,
    Source,
    corrupt_record,
    land_run,
    read_raw,
    runs,
    undecodable_record,
)
from lightning_dcp.errors import CorruptCheckpointError

__all__ = ["load_indexed"]

_SPAN = 2 << 20
"""Bytes per read of a run of small records: a span this size stays in the CPU caches while its records are checked
and copied (``small`` mix, cold page cache, 2 ranks: ~0.13 s with 2 MiB spans, ~0.16 s with 16 MiB)."""
_RUN_RECORDS = 1024 // 3
"""Records per ``preadv`` at most: three buffers each, and ``IOV_MAX`` is 1024 on Linux."""
_MEMORY = memoryview((ctypes.c_char * sys.maxsize).from_address(0)).cast("B")
"""The process's memory as bytes (no copy, no bounds): ``_MEMORY[a : a + n]`` is the ``n`` bytes at address ``a``.
Only ever sliced at a target tensor's ``data_ptr()`` for its ``nbytes``, as ``ctypes.memmove`` is given them."""


def load_indexed(
    path: str,
    state: dict[str, Any],
    records: dict[str, IndexEntry] | None,
    *,
    weights_only: bool,
    distributed: bool,
    whole: bool = True,
) -> bool:
    """Fill ``state`` in place from the local checkpoint directory ``path`` through its record index.

    Args:
        path: The checkpoint directory (a local path).
        state: The nested target (``{"state_dict": ..., "optimizer_states": [...], "lightning": b"",
            "rank_states": {rank: b""}}``): tensors are filled in place, every other leaf is replaced by the object
            its bytes entry holds.
        records: The checkpoint's index (:func:`~lightning_dcp.engine.format.record_index.parse_index`), ``None`` when
            it has none.
        weights_only: Passed to ``torch.load`` for every bytes entry.
        distributed: Whether the default process group takes part.
        whole: The target must have a place for every saved entry besides the blobs (a resume); ``False`` reads
            what the target names and nothing else (the blobs alone, for a target of only them).

    Returns:
        False when the index cannot serve this target on some rank (nothing was read: restore the general way);
        True when ``state`` was filled.

    Collective: call on all ranks when ``distributed`` (one all-reduce before reading, one after).

    Raises:
        RankFailure: Reading failed on some rank (on every rank; the lowest failing rank's error, a
            ``CorruptCheckpointError`` naming the file for a record that does not match ``.commit``).
    """
    flat, mappings = flatten(state)
    plan = _plan(flat, records, whole=whole) if records is not None else None
    if not (all_true(plan is not None) if distributed else plan is not None):
        return False
    error: BaseException | None = None
    try:
        for name in sorted(plan):
            _read_file(path, name, plan[name], state, mappings, weights_only)
    except Exception as err:  # raised on every rank below
        error = err
    agree(error, group=None, distributed=distributed)
    return True


def _plan(flat: dict[str, Any], records: dict[str, IndexEntry], *, whole: bool) -> dict[str, list[tuple]] | None:
    """Per data file, ``(offset, length, checksum, frame, address, fqn, target)`` of each record to read, by offset.

    ``target`` is the tensor to fill at ``address`` (``frame``:
    :func:`~lightning_dcp.engine.format.records.record_frame` of its record), or ``None`` for a bytes entry (and
    ``frame`` too, ``address`` 0). The first five fields are a :data:`~lightning_dcp.engine.load.reading.Landing`'s.

    ``None`` when the index cannot serve ``flat``: an entry the checkpoint lacks or holds as another kind, dtype or
    shape, a target that is not a plain contiguous CPU tensor, or a saved entry besides the blobs (the Trainer
    state and rank states) that the target lacks: so the target lacks none of the saved model and optimizer
    entries, and the checkpoint holds no other state dict (those load as new tensors, the general way). Unless
    ``whole``: then any saved entry the target lacks is left unread.
    """
    tensor, parameter = torch.Tensor, torch.nn.Parameter
    per_file: dict[str, list[tuple]] = {}
    unsorted: set[str] = set()  # files whose entries were not appended by offset (chunks come last in the index)
    frames: dict[tuple, tuple] = {}  # record_frame per (dtype, shape): thousands of keys, a few shapes
    if not whole:  # the target's keys, each saved
        pairs = ((key, value, records.get(key)) for key, value in flat.items())
    else:  # every saved entry, in the index's order (each file's by offset): each in the target, or a blob
        get, missing, rank_blobs = flat.get, _MISSING, RANK_KEY + "."
        pairs = ((key, get(key, missing), record) for key, record in records.items())
    matched = 0
    for key, value, record in pairs:
        if record is None:
            return None
        if value is _MISSING:
            if key == EXTRA_KEY or key.startswith(rank_blobs):  # another rank's blob
                continue
            return None  # a saved model or optimizer entry, or another state dict, the target lacks
        matched += 1
        if type(record) is tuple:  # a tensor saved in row chunks
            chunks = _chunk_entries(key, value, record, frames)
            if chunks is None:
                return None
            for file, entry in chunks:
                per_file.setdefault(file, []).append(entry)
                unsorted.add(file)
            continue
        file, offset, length, digest, dtype, shape, _ = record
        kind = type(value)
        if kind is tensor or kind is parameter:
            if shape is None or value.dtype is not dtype or value.shape != shape:
                return None
            if not value.is_cpu or not value.is_contiguous():
                return None
            frame = frames.get((dtype, shape))
            if frame is None:
                frame = frames[dtype, shape] = record_frame(dtype, shape)
            entry = (offset, length, digest, frame, value.data_ptr(), key, value)
        elif dtype is not None or isinstance(value, tensor):  # a tensor saved; or a DTensor, a subclass
            return None
        else:
            entry = (offset, length, digest, None, 0, key, None)
        files = per_file.get(file)
        if files is None:
            files = per_file[file] = []
        elif files[-1][0] > offset:
            unsorted.add(file)
        files.append(entry)
    if matched != len(flat):  # a target entry the checkpoint lacks
        return None
    for file in unsorted:
        per_file[file].sort(key=_offset)
    return per_file


_MISSING = object()


def _chunk_entries(
    key: str, value: Any, chunks: tuple[IndexedRecord, ...], frames: dict[tuple, tuple]
) -> list[tuple[str, tuple]] | None:
    """``(file, entry)`` per chunk of a tensor saved in row chunks (the planner's split of a large tensor).

    ``None`` unless ``value`` is a plain contiguous CPU tensor of their dtype that the chunks tile exactly: each a
    range of whole rows (offsets and sizes of the other dimensions 0 and full), together every row once. Each
    chunk's tensor bytes are then one contiguous range of ``value``'s, where its entry lands them.
    """
    kind = type(value)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return None
    if not value.is_cpu or not value.is_contiguous() or value.dim() == 0:
        return None
    dtype, shape = value.dtype, tuple(value.shape)
    row = value.nbytes // shape[0] if shape[0] else 0
    base, rows = value.data_ptr(), 0
    out = []
    for chunk in sorted(chunks, key=_chunk_start):
        file, offset, length, digest, chunk_dtype, sizes, offsets = chunk
        if chunk_dtype is not dtype or len(sizes) != len(shape) or sizes[1:] != shape[1:]:
            return None
        if offsets[0] != rows or any(offsets[1:]) or not sizes[0]:
            return None
        frame = frames.get((dtype, sizes))
        if frame is None:
            frame = frames[dtype, sizes] = record_frame(dtype, sizes)
        view = value.detach().narrow(0, rows, sizes[0])
        out.append((file, (offset, length, digest, frame, base + rows * row, key, view)))
        rows += sizes[0]
    return out if rows == shape[0] else None


def _chunk_start(chunk: IndexedRecord) -> int:
    return chunk.chunk[0]


def _offset(entry: tuple) -> int:
    return entry[0]


def _read_file(
    path: str, name: str, entries: list[tuple], state: dict, mappings: dict[str, tuple], weights_only: bool
) -> None:
    """Read ``entries`` of the data file ``name``: runs of small records with one call each, large ones in place."""
    where = os.path.join(path, name)
    with open(where, "rb", buffering=0) as stream:
        size = os.fstat(stream.fileno()).st_size
        last = entries[-1]
        if last[0] + last[1] > size:
            raise CorruptCheckpointError(
                f"{where} is truncated: it ends at byte {size}, its records at {last[0] + last[1]}.", file=name
            )
        source = Source(stream)
        offsets, lengths = [entry[0] for entry in entries], [entry[1] for entry in entries]
        try:
            for i, j, end in runs(offsets, lengths, span=_SPAN, most=_RUN_RECORDS):
                if lengths[i] > SMALL_RECORD:
                    _read_large(source, where, name, entries[i], state, mappings, weights_only)
                    continue
                offset = offsets[i]
                if not _scatter_run(source, where, name, entries[i:j], state, mappings, weights_only):
                    span, address = source.read_span(offset, end - offset)
                    if span.nbytes != end - offset:
                        raise CorruptCheckpointError(f"{where} is truncated: it ends before byte {end}.", file=name)
                    _take_run(where, name, entries[i:j], offset, span, address, state, mappings, weights_only)
        finally:
            source.close()


def _scatter_run(
    source: Source,
    where: str,
    name: str,
    entries: list[tuple],
    state: dict,
    mappings: dict[str, tuple],
    weights_only: bool,
) -> bool:
    """Read a run of small records with one ``preadv``: each tensor's bytes straight into its target.

    A record framed as ours (its length is its frame's) is read as three buffers: its prefix and suffix one after
    the other from the start of the source's span buffer, its tensor bytes into the target's memory. Other records,
    and the bytes between records, go whole to the buffer's second half. Each record's checksum is then checked
    over its bytes in order, and all the framing bytes read against the frames with one comparison. A record whose
    framing differs after all (another writer's, of the same length) is read again whole and decoded.

    Against reading the run into the buffer and copying each tensor out (:func:`_take_run`), the tensor bytes are
    copied once instead of twice (``conv`` mix, 3,800 records and 93 MB per file, warm, one process: ~19.4 ms a
    file instead of ~21.5).

    Returns False when nothing was concluded (no descriptor, or a short read): the caller reads the run as a span.
    """
    fd = source.fd
    if fd is None:
        return False
    scratch = source.span_buffer()
    if len(scratch) < 4 * _SPAN:  # room for a run's framing and, in the second half, its other bytes
        return False
    memory = _MEMORY
    start = end = entries[0][0]
    buffers: list[memoryview] = []
    framing: list[bytes] = []  # what the framing bytes read must be, in order
    at: list[int] = []  # per record: its first buffer's index in buffers
    pos, whole = 0, len(scratch) // 2  # framing bytes from the start of the buffer, other bytes from its middle
    for offset, length, _, frame, into, _, target in entries:
        if offset > end:  # bytes between records
            buffers.append(scratch[whole : whole + offset - end])
            whole += offset - end
        at.append(len(buffers))
        if target is not None and length == frame[0]:
            full, begin, stop, prefix, suffix = frame
            tail = pos + begin
            buffers += (scratch[pos:tail], memory[into : into + stop - begin], scratch[tail : tail + full - stop])
            framing += (prefix, suffix)
            pos = tail + full - stop
        else:
            buffers.append(scratch[whole : whole + length])
            whole += length
        end = offset + length
    if _preadv(fd, buffers, start) != end - start:
        return False
    ours = bytes(scratch[:pos]) == b"".join(framing)  # every framing as expected (else: checked one by one)
    new, digest = xxhash.xxh3_64, checksum
    for (offset, length, expected, frame, _, fqn, target), k in zip(entries, at, strict=True):
        if target is None or length != frame[0]:  # read whole into the buffer
            record = buffers[k]
            if digest(record) != expected:
                raise corrupt_record(where, name, fqn)
            if target is None:
                _land_object(where, name, fqn, record, state, mappings, weights_only)
            else:  # another writer's framing
                _land_decoded(where, name, fqn, record, target)
            continue
        head, data, tail = buffers[k], buffers[k + 1], buffers[k + 2]
        hasher = new()
        hasher.update(head)
        hasher.update(data)
        hasher.update(tail)
        if hasher.intdigest() != expected:
            raise corrupt_record(where, name, fqn)
        if not ours and (head != frame[3] or tail != frame[4]):  # not our framing after all: torch.load decides
            record = memoryview(source.read(offset, length))
            if len(record) != length or digest(record) != expected:
                raise corrupt_record(where, name, fqn)
            _land_decoded(where, name, fqn, record, target)
    return True


def _preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    """``os.preadv`` of ``buffers`` from ``offset``; the bytes read (fewer when interrupted or at the file's end)."""
    try:
        return os.preadv(fd, buffers, offset)
    except OSError:  # the span read reports it
        return -1


def _take_run(
    where: str,
    name: str,
    entries: list[tuple],
    start: int,
    span: memoryview,
    address: int,
    state: dict,
    mappings: dict[str, tuple],
    weights_only: bool,
) -> None:
    """Check and land a run of records read in one call (``span``, from file offset ``start``, at ``address``)."""

    def failed(entry: tuple, record: memoryview) -> None:
        raise corrupt_record(where, name, entry[5])

    def other(entry: tuple, record: memoryview) -> None:
        fqn, target = entry[5], entry[6]
        if target is None:
            _land_object(where, name, fqn, record, state, mappings, weights_only)
        else:  # another writer's framing of the same tensor: torch.load decides
            _land_decoded(where, name, fqn, record, target)

    land_run(span, address, start, entries, failed=failed, other=other)


def _read_large(
    source: Source, where: str, name: str, entry: tuple, state: dict, mappings: dict, weights_only: bool
) -> None:
    """One record over :data:`~lightning_dcp.engine.load.reading.SMALL_RECORD`: into its target, or decoded.

    Straight into the target when it is framed as ours, else read whole and decoded.
    """
    offset, length, expected, _, _, fqn, target = entry
    if target is not None:
        digest = read_raw(source, offset, length, tensor_record(target.dtype, tuple(target.shape)), target)
        if digest is not None:
            if digest != expected:
                raise corrupt_record(where, name, fqn)
            return
    record = source.read(offset, length)
    if len(record) != length:
        raise CorruptCheckpointError(f"{where} is truncated: it ends before byte {offset + length}.", file=name)
    if checksum(record) != expected:
        raise corrupt_record(where, name, fqn)
    if target is None:
        _land_object(where, name, fqn, memoryview(record), state, mappings, weights_only)
    else:
        _land_decoded(where, name, fqn, memoryview(record), target)


def _land_object(
    where: str, name: str, fqn: str, record: memoryview, state: dict, mappings: dict, weights_only: bool
) -> None:
    """A bytes entry: unpickled as DCP's planner does (``weights_only``), into its place in ``state``."""
    data = record.tobytes()
    value = plain_value(data)
    if value is NOT_PLAIN:
        try:
            value = load_checked(data, weights_only=weights_only)  # nothing allocated beyond what it holds
        except Exception as err:  # as the general path: a record that is not what the index says
            raise _undecodable(where, name, fqn, err) from None
    set_element(state, mappings[fqn], value)


def _land_decoded(where: str, name: str, fqn: str, record: memoryview, target: torch.Tensor) -> None:
    """A tensor record in another framing: ``torch.load`` it and copy it into ``target`` if it is what was indexed."""
    data = record.tobytes()
    try:
        tensor = load_checked(data)
    except Exception as err:
        raise _undecodable(where, name, fqn, err) from None
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != target.dtype or tensor.shape != target.shape:
        kind = f"{tensor.dtype}{tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CorruptCheckpointError(
            f"{where}: record {fqn!r} holds {kind} where the index in .commit says"
            f" {target.dtype}{tuple(target.shape)}.",
            file=name,
        )
    target.detach().copy_(tensor)


def _undecodable(where: str, name: str, fqn: str, err: Exception) -> CorruptCheckpointError:
    return undecodable_record(where, name, fqn, err, described_by="the index in .commit")
