"""Writing DCP data files: which records go to which file, and each record's bytes straight from tensor memory.

A rank's write items become records in ``__{rank}_{n}.distcp`` files. :func:`assign_files` is the one place that
decides which record goes to which file (so a later save can tell which files are unchanged). Each record is
``prefix + raw bytes + suffix`` (:mod:`lightning_dcp.engine.format.records`) or a ``BYTE_IO`` blob, never serialized
through ``torch.save`` or copied in Python. The writer checksums every record (xxHash3, GIL released) piece by piece,
each piece right before it is written, and hands the pieces to an output of :mod:`lightning_dcp.engine.storage.fileout`:
direct I/O from the tensors' memory for synced local files, the page cache otherwise, an fsspec stream elsewhere.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from lightning_dcp.engine.format.records import cpu_contiguous, raw_bytes, tensor_record
from lightning_dcp.engine.save.copy_ahead import copy_ahead
from lightning_dcp.engine.save.memo import PlanMemo
from lightning_dcp.engine.storage.fileout import ALIGN, DIRECT_MIN, PIECE, StreamOut, open_local

__all__ = [
    "FileJob",
    "Record",
    "RecordResult",
    "assign_files",
    "item_nbytes",
    "make_record",
    "write_local",
    "write_stream",
]


@dataclasses.dataclass
class FileJob:
    """One data file of a rank: its name inside the checkpoint directory and its write items, in write order."""

    name: str
    items: list[WriteItem]


@dataclasses.dataclass
class RecordResult:
    """Where one record landed: ``offset`` and ``length`` in bytes inside ``file``, and its xxHash3-64."""

    item: WriteItem
    file: str
    offset: int
    length: int
    digest: int


def item_nbytes(item: WriteItem) -> int:
    """Tensor bytes of a write item (0 for ``BYTE_IO``)."""
    if item.tensor_data is None:
        return 0
    return item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize


def assign_files(
    items: Sequence[WriteItem],
    *,
    prefix: str,
    files: int,
    suffix: str,
    own_file: Callable[[WriteItem], str | None] | None = None,
) -> list[FileJob]:
    """Which record goes to which file: ``items`` spread over at most ``files`` files of similar byte size.

    Largest items first, each into the lightest file so far; blobs (``BYTE_IO``) first within a file, then tensors
    in a stable order (by key and offset), so the same state always lands in the same files. An item for which
    ``own_file`` returns a name gets a file of that name to itself (incremental saves), listed first.
    """
    key = (id(items), prefix, files, suffix)
    known = _ASSIGNED.get(items, key) if own_file is None else None
    if known is not None:
        return [FileJob(job.name, job.items) for job in known]  # the same plan as an earlier save
    own = [FileJob(name, [item]) for item in items if own_file and (name := own_file(item)) is not None]
    if own:
        mine = {id(job.items[0]) for job in own}
        items = [item for item in items if id(item) not in mine]
    jobs = [FileJob(f"{prefix}{i}{suffix}", []) for i in range(max(1, files))]
    sizes = [0] * len(jobs)
    for item in sorted(items, key=lambda i: (-item_nbytes(i), _order(i))):
        i = sizes.index(min(sizes))
        jobs[i].items.append(item)
        sizes[i] += item_nbytes(item)
    for job in jobs:
        job.items.sort(key=_order)
    assigned = own + [job for job in jobs if job.items]
    if own_file is None:
        _ASSIGNED.put(items, key, assigned)
    return assigned


_ASSIGNED = PlanMemo()  # the file assignment of the last few plans


def _order(item: WriteItem) -> tuple:
    offsets = tuple(item.index.offset) if item.index.offset is not None else ()
    return (item.type != WriteItemType.BYTE_IO, item.index.fqn, offsets)


@dataclasses.dataclass
class Record:
    """One record's bytes as views (no copy of tensor data) and what owns their memory.

    Attributes:
        parts: ``(view, address)`` in order; ``address`` is the memory address of a tensor's bytes (``None`` for
            headers and blobs), which lets direct I/O send them from where they are.
        keep: The object owning the tensor memory (alive until the record is written).
        data_offset: Offset of the tensor bytes inside the record.
    """

    parts: list[tuple[memoryview, int | None]]
    keep: Any
    data_offset: int = 0

    @property
    def address(self) -> int | None:
        """Memory address of the tensor bytes (``None`` for a blob or an empty tensor)."""
        return next((address for _, address in self.parts if address is not None), None)


def make_record(item: WriteItem, data: Any) -> Record:
    """The record of ``item`` from what the planner resolved: an ``io.BytesIO`` blob or a tensor.

    A tensor is moved to the CPU and made contiguous first if it is not; a contiguous view is written as is (only
    its own elements).
    """
    if item.type == WriteItemType.BYTE_IO:
        return Record([(data.getbuffer(), None)], data)
    tensor = cpu_contiguous(data)
    layout = tensor_record(tensor.dtype, tuple(tensor.shape))
    raw = raw_bytes(tensor)
    parts = [(memoryview(layout.prefix), None), (raw, tensor.data_ptr() if raw.nbytes else None)]
    return Record([*parts, (memoryview(layout.suffix), None)], tensor, layout.data_offset)


def write_local(
    path: str,
    job: FileJob,
    resolve: Callable[[WriteItem], Any],
    *,
    sync: bool,
    done: Callable[[WriteItem], None] | None = None,
    swap: Callable[[WriteItem], torch.Tensor | None] | None = None,
) -> list[RecordResult]:
    """Write ``job``'s records into a new local file at ``path`` (direct I/O and ``fsync`` when ``sync``).

    ``done(item)``, when given, is called once the file no longer needs the memory of ``item``'s data (written to
    the kernel or copied), record by record. ``swap(item)``, when given, is asked between two pieces of a large
    tensor record (once the file no longer needs the pieces before): a tensor it returns holds the same bytes, and
    the rest of the record is read from it.

    Raises:
        OSError: The file cannot be created or written (e.g. ``ENOSPC``); the partial file is left for the caller.
    """
    out = open_local(path, sync=sync)
    try:
        results = _write_records(job, resolve, out, done, swap)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(out.fd)
        raise
    out.close()
    return results


def write_stream(stream: IO[bytes], job: FileJob, resolve: Callable[[WriteItem], Any]) -> list[RecordResult]:
    """Write ``job``'s records into an open binary stream (an fsspec file), piece by piece."""
    out = StreamOut(stream)
    results = _write_records(job, resolve, out)
    out.close()
    return results


def _write_records(
    job: FileJob,
    resolve: Callable[[WriteItem], Any],
    out: Any,
    done: Callable[[WriteItem], None] | None = None,
    swap: Callable[[WriteItem], torch.Tensor | None] | None = None,
) -> list[RecordResult]:
    """Each record hashed right before it is written; small ones framed in the output's buffer, in place.

    A small record (a tensor under :data:`~lightning_dcp.engine.storage.fileout.DIRECT_MIN` bytes, a blob) is laid out
    directly in a region the output hands out (:meth:`~lightning_dcp.engine.storage.fileout.DirectOut.frame`): header by
    slice assignment, tensor bytes by ``memmove`` from the tensor's memory, then hashed there; a few microseconds of
    Python per record and no write call of its own. A large record is written from its own memory, read once (hashed,
    then written) piece by piece.
    """
    results: list[RecordResult] = []
    name = job.name
    hasher = xxhash.xxh3_64()
    resolve = copy_ahead(job.items, resolve)  # GPU tensors: the next record's copy to the host runs meanwhile
    for item in job.items:
        data = resolve(item)
        framed = _frame_small(item, data, out)
        if framed is not None:
            results.append(RecordResult(item, name, *framed))
            if done is not None:
                done(item)
            continue
        record = make_record(item, data)
        address = record.address
        if address is not None and record.parts[1][0].nbytes >= DIRECT_MIN:  # large enough to go direct
            out.align(address, record.data_offset)
        start = out.position
        hasher.reset()
        for view, address in record.parts:
            # Pieces after the first start on an aligned address: each goes to the disk whole.
            begin, end = 0, PIECE - (address % ALIGN if address is not None else 0)
            while begin < view.nbytes:
                piece = view[begin:end]
                hasher.update(piece)
                out.write(piece, record.keep, None if address is None else address + begin)
                begin, end = end, end + PIECE
                if swap is not None and address is not None and begin < view.nbytes:
                    out.settle()
                    copy = swap(item)
                    if copy is not None:  # the same bytes elsewhere: the rest is read from there
                        view, address, record.keep = raw_bytes(copy), copy.data_ptr(), copy
        results.append(RecordResult(item, name, start, out.position - start, hasher.intdigest()))
        if done is not None:
            out.settle()
            done(item)
    return results


_memmove = ctypes.memmove
_digest = xxhash.xxh3_64_intdigest


def _frame_small(item: WriteItem, data: Any, out: Any) -> tuple[int, int, int] | None:
    """Write a small record into ``out.frame``: ``(offset, length, checksum)``; ``None`` for any other record."""
    if item.type == WriteItemType.BYTE_IO:
        blob = data.getbuffer()
        length = blob.nbytes
        if length > DIRECT_MIN:
            return None
        position = out.position
        view, start, _ = out.frame(length)
        view[start : start + length] = blob
        return position, length, _digest(view[start : start + length])
    kind = type(data)
    if (kind is not torch.Tensor and kind is not torch.nn.Parameter) or data.device.type != "cpu":
        return None
    nbytes = data.nbytes
    if nbytes >= DIRECT_MIN:
        return None
    if not data.is_contiguous():
        data = data.contiguous()
    layout = tensor_record(data.dtype, tuple(data.shape))
    length = layout.length
    position = out.position
    view, start, address = out.frame(length)
    middle = start + layout.data_offset
    view[start:middle] = layout.prefix
    if nbytes:
        _memmove(address + layout.data_offset, data.data_ptr(), nbytes)
    view[middle + nbytes : start + length] = layout.suffix
    return position, length, _digest(view[start : start + length])
