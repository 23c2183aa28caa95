"""The memory tier's storage writer: each rank's records copied straight from its tensors into a mapped tmpfs file.

A rank writes one data file, ``__{rank}_0.distcp``, in DCP's format (:mod:`lightning_dcp.engine.format.records`: every
tensor record is ``prefix + raw bytes + suffix``, so any DCP reader loads it and reshards it). The file is mapped
into the process and each tensor is copied into its place with one ``copy_`` in its own dtype (:meth:`ShmWriter.stage`:
what a save's stall waits for); each record is then hashed where it lies (xxHash3-64, as every writer of this library
records in ``.commit``), which costs a second read of the bytes but none of the stall: copying and hashing 1 MiB
pieces in one pass took 1.27x a plain copy here, a copy then a background hash 1.0x in the call.

Tensors come first, in a stable order, then the serialized objects (their size changes from save to save), so a
file's tensor records keep their offsets from one save to the next. The file is exactly as long as its records, its
memory reserved before anything is copied (a full area fails the save with ``ENOSPC``, never with SIGBUS), and
reused: a save overwrites the file of an evicted part (:class:`~lightning_dcp.engine.tiers.parts.PartStore` free
slots) through the mapping this process already holds (:class:`Mappings`, which maps some room beyond the file's end
so the file can grow in place), at the speed of a memory copy, with no page to allocate or fault in.

The coordinator's :meth:`ShmWriter.finish` writes ``.metadata`` and keeps the ``.commit`` marker in
:attr:`ShmWriter.marker` instead of writing it: the memory tier commits each node's part itself.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_dcp._compat.torch_dcp import StorageInfo
from lightning_dcp.engine.format.marker import DATA_SUFFIX, METADATA_FILE, encode_commit
from lightning_dcp.engine.format.records import cpu_contiguous, tensor_record
from lightning_dcp.engine.save.dcp_io import compact_result

__all__ = ["Mappings", "ShmWriter", "data_file"]

_ALIGN = 64
_ROOM = 4 << 20  # spare room for the objects to grow without a new mapping
_GRANULE = 1 << 20


def data_file(rank: int) -> str:
    """The name of the data file rank ``rank`` writes."""
    return f"__{rank}_0{DATA_SUFFIX}"


class Mappings:
    """Writable shared mappings of this process's tmpfs files, by inode, kept across saves.

    Mapping a file anew costs a page fault per 4 KiB on first touch (3-4x a memory copy here); a file reused
    through the mapping already held costs a copy only. Each mapping keeps its file open, so a file deleted since
    (an evicted part) is noticed and unmapped by :meth:`prune`.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, int]] = {}

    def open(self, path: str, size: int) -> mmap.mmap:
        """A writable mapping of ``path`` whose first ``size`` bytes are backed by memory reserved in the area.

        The file is given exactly ``size`` bytes, reserved up front (``posix_fallocate``): a full area fails here
        with ``ENOSPC`` (an ``OSError``), never later with SIGBUS on a write into the mapping, and ``ls``/``du``
        show what the records take. The mapping itself spans some room beyond (virtual only), so a file whose
        objects grow from one save to the next is grown in place, without a new mapping.

        Raises:
            OSError: The area is full (``ENOSPC``) or cannot be written.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        cached = self._maps.get(key)
        if cached is not None and len(cached[0]) >= size:
            os.close(fd)
            _fit(cached[1], size, st.st_size, reserved=min(st.st_size, size))
            return cached[0]
        try:
            capacity = -(-(size + _ROOM) // _GRANULE) * _GRANULE
            if st.st_size < capacity:
                os.ftruncate(fd, capacity)  # Python maps no further than the file's end
            mapped = mmap.mmap(fd, max(capacity, st.st_size), flags=mmap.MAP_SHARED)
            _fit(fd, size, max(capacity, st.st_size), reserved=0)
        except BaseException:
            os.close(fd)
            raise
        if cached is not None:
            self._drop(key)
        self._maps[key] = (mapped, fd)
        return mapped

    def prune(self) -> None:
        """Unmap the files deleted since they were mapped (their memory goes back to the system)."""
        for key, (_, fd) in list(self._maps.items()):
            if os.fstat(fd).st_nlink == 0:
                self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        mapped, fd = self._maps.pop(key)
        try:
            mapped.close()
        except BufferError:  # a view is still alive: the mapping goes with it
            pass
        os.close(fd)

    def close(self) -> None:
        """Unmap everything (views handed out must be gone)."""
        for key in list(self._maps):
            self._drop(key)


def _fit(fd: int, size: int, length: int, *, reserved: int) -> None:
    """Give the file ``fd`` (now ``length`` bytes, the first ``reserved`` reserved) exactly ``size`` bytes, reserved.

    A file reused through its mapping had every byte of its last size reserved by the save that wrote it; only what
    it grows by is reserved anew.
    """
    if length != size:
        os.ftruncate(fd, size)
    if size > reserved:
        os.posix_fallocate(fd, reserved, size - reserved)  # ENOSPC here, not SIGBUS on a write into the mapping


@dataclasses.dataclass
class _Slot:
    item: WriteItem
    data: Any  # a CPU tensor (contiguous) or the bytes of a serialized object
    offset: int  # of the record in the file
    length: int
    prefix: bytes
    suffix: bytes


class ShmWriter(FileSystemWriter):
    """DCP storage writer of the memory tier: one mapped data file per rank in a (tmpfs) directory.

    Args:
        path: The directory (a part's staging directory; it must exist before :meth:`write_data`).
        mappings: The process's mappings (reused across saves).
        on_copied: Called on this rank once its tensors are copied (before they are hashed): what an
            async save's optimizer steps wait for.

    Attributes:
        order: ``{"counter", "step"}`` recorded in ``.commit`` (set before the save).
        on_setup: Called in DCP's set-up of the writer (the staging directory is made there: a failure is every
            rank's failure at planning, in planning's own exchange).
        metadata_bytes: The coordinator's ``.metadata`` after :meth:`finish`.
        marker: The coordinator's ``.commit`` bytes after :meth:`finish` (not written to disk).
        written: This rank's data file name and the bytes its records span, after :meth:`write_data`.
    """

    def __init__(self, path: str, *, mappings: Mappings, on_copied: Callable[[], None] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True)
        self.mappings = mappings
        self.on_copied = on_copied
        self.order: dict[str, Any] | None = None
        self.on_setup: Callable[[], None] | None = None
        self.metadata_bytes: bytes | None = None
        self.marker: bytes | None = None
        self.written: tuple[str, int] | None = None
        self._staged: tuple[str, list[_Slot], int, mmap.mmap] | None = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """DCP's set-up, then :attr:`on_setup` (a failure there fails the save on every rank at planning)."""
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if self.on_setup is not None:
            self.on_setup()

    def stage(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Copy this rank's items into its data file, then call ``on_copied``: the part a save's stall waits for.

        A synchronous save calls it in the save's call; otherwise :meth:`write_data` does. The digests are computed
        afterwards from the file (nothing writes it until the save is committed), off the stall.
        """
        name, slots, end, mapped = self._open(plan, planner)
        view = memoryview(mapped)
        target = torch.frombuffer(mapped, dtype=torch.uint8) if end else None
        try:
            for slot in slots:
                _copy_record(view, target, slot)
        finally:
            del target
            view.release()
        self._staged = (name, slots, end, mapped)
        if self.on_copied is not None:
            self.on_copied()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Copy this rank's items into its data file in the memory area (unless :meth:`stage` did); hash each record."""
        if self._staged is None:
            self.stage(plan, planner)
        (name, slots, end, mapped), self._staged = self._staged, None
        view = memoryview(mapped)
        results = []
        try:
            for slot in slots:
                digest = xxhash.xxh3_64_intdigest(view[slot.offset : slot.offset + slot.length])
                info = StorageInfo(name, slot.offset, slot.length)
                results.append(
                    WriteResult(index=slot.item.index, size_in_bytes=slot.length, storage_data=(info, digest))
                )
        finally:
            view.release()
        self.written = (name, end)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _open(self, plan: SavePlan, planner: SavePlanner) -> tuple[str, list[_Slot], int, mmap.mmap]:
        rank = int(plan.storage_data.prefix.strip("_").split("_")[0])
        name = data_file(rank)
        slots, end = _layout(plan.items, planner)
        return name, slots, end, self.mappings.open(os.path.join(os.fspath(self.path), name), end)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's entry point: the results as :meth:`finish_compact` takes them."""
        self.finish_compact(metadata, [[compact_result(r) for r in rank_results] for rank_results in results])

    def finish_compact(self, metadata: Metadata, results: list[list[tuple]]) -> None:
        """Write the metadata file; build the marker with each file's records (the memory tier commits it).

        ``results``: per rank, ``(fqn, offsets, size, file, offset, length, checksum)`` of each record
        (:func:`~lightning_dcp.engine.save.dcp_io.compact_result`).
        """
        files: dict[str, dict[str, Any]] = {}
        plain = []
        for rank_results in results:
            plain.append([])
            for fqn, offsets, size, name, offset, length, digest in rank_results:
                entry = files.setdefault(name, {"size": 0, "records": []})
                entry["records"].append([offset, length, digest])
                entry["size"] = max(entry["size"], offset + length)
                index = MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))
                plain[-1].append(
                    WriteResult(index=index, size_in_bytes=size, storage_data=StorageInfo(name, offset, length))
                )
        super().finish(metadata, plain)
        with open(os.path.join(os.fspath(self.path), METADATA_FILE), "rb") as f:
            self.metadata_bytes = f.read()
        self.marker = encode_commit(metadata_bytes=self.metadata_bytes, files=files, order=self.order)


def _layout(items: list[WriteItem], planner: SavePlanner) -> tuple[list[_Slot], int]:
    """Where each record goes: tensors first (stable order, raw bytes 64-byte aligned), then objects."""

    def order(item: WriteItem) -> tuple:
        offsets = tuple(item.index.offset) if item.index.offset is not None else ()
        return (item.type == WriteItemType.BYTE_IO, item.index.fqn, offsets)

    slots, position = [], 0
    for item in sorted(items, key=order):
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            slots.append(_Slot(item, raw, position, len(raw), b"", b""))
            position += len(raw)
            continue
        tensor = cpu_contiguous(data)
        record = tensor_record(tensor.dtype, tuple(tensor.shape))
        position += -(position + record.data_offset) % _ALIGN
        slots.append(_Slot(item, tensor, position, record.length, record.prefix, record.suffix))
        position += record.length
    return slots, position


def _copy_record(view: memoryview, target: torch.Tensor | None, slot: _Slot) -> None:
    """Copy one record into the mapping at its offset, the tensor's elements in one ``copy_`` in their dtype."""
    at = slot.offset
    if isinstance(slot.data, bytes):
        view[at : at + len(slot.data)] = slot.data
        return
    view[at : at + len(slot.prefix)] = slot.prefix
    at += len(slot.prefix)
    tensor = slot.data
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        if at % tensor.element_size() == 0 and not tensor.is_quantized:
            target[at : at + nbytes].view(tensor.dtype).copy_(tensor.reshape(-1))
        else:
            target[at : at + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
    at += nbytes
    view[at : at + len(slot.suffix)] = slot.suffix
