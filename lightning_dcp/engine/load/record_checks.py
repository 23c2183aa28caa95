"""One record of a DCP load, checked and landed: its place in its file, its checksum against ``.commit``, its frame.

:class:`RecordChecks` is the part of the verifying reader (:mod:`lightning_dcp.engine.load.dcp_reader`) that takes one
record from the bytes read to its target: the record must lie inside its file, be listed in the marker with the
length read, match its checksum and decode to the dtype and shape the metadata gives; each failure is a
:class:`~lightning_dcp.errors.CorruptCheckpointError` naming the file and the entry.
"""

from __future__ import annotations

import ctypes
import io
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from lightning_dcp._compat.torch_dcp import StorageInfo, narrow_tensor_by_index
from lightning_dcp.engine.format.archive import load_checked
from lightning_dcp.engine.format.marker import (
    COMMIT_FILE,
    checksum,
)
from lightning_dcp.engine.format.records import tensor_record
from lightning_dcp.engine.load.reading import Source, corrupt_record, read_raw, undecodable_record
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError


class RecordChecks:
    """Checking and landing single records, mixed into the verifying reader (its ``path``, ``checksums``, metadata)."""

    def _read_item(self, item: Any) -> Any:
        """``item``, or for a :class:`_Whole` the read item the planner would have made for it."""
        if type(item) is not _Whole:
            return item
        index = item.storage_index
        return ReadItem(
            LoadItemType.TENSOR, index, index.offset, index, index.offset, self._tensor_meta[index.fqn].size
        )

    def _read_one(self, stream, source, name, size, info, item, planner) -> None:
        expected = self._expected(name, size, info, item)

        def read() -> None:
            if not self._read_in_place(source, name, info, expected, item, planner):
                self._apply(self._read_record(stream, name, info, expected, item), item, planner)

        self._guarded(name, item, read)

    def _guarded(self, name: str, item: Any, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except CheckpointError:
            raise
        except Exception as err:  # a record that is not what the metadata says it is
            raise self._undecodable(name, item, err) from None

    def _undecodable(self, name: str, item: Any, err: Exception) -> CorruptCheckpointError:
        fqn = item.storage_index.fqn
        return undecodable_record(f"{self.path}/{name}", name, fqn, err, described_by="the metadata")

    def _copy_raw(self, item: Any, dtype: torch.dtype, sizes: tuple, address: int, nbytes: int, planner) -> None:
        target, into = _destination(item, dtype, sizes, planner)
        direct = into is target
        if nbytes:
            ctypes.memmove(into.data_ptr(), address, nbytes)
        if not direct:
            target.copy_(narrow_tensor_by_index(into, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

    def _read_in_place(
        self, source: Source, name: str, info: StorageInfo, expected: int | None, item: Any, planner: LoadPlanner
    ) -> bool:
        """Read a tensor record in our layout straight into its target (:mod:`lightning_dcp.engine.load.reading`).

        Returns False when the record is not in that layout (the general path then reads it).
        """
        if item.type != LoadItemType.TENSOR:
            return False
        meta = self._tensor_meta.get(item.storage_index.fqn)
        sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
        if sizes is None:
            return False
        dtype = meta.properties.dtype
        target, into = _destination(item, dtype, sizes, planner)
        direct = into is target
        digest = read_raw(source, info.offset, info.length, tensor_record(dtype, sizes), into)
        if digest is None:
            return False
        if expected is not None and digest != expected:
            raise self._corrupt(name, item)
        if not direct:
            target.copy_(narrow_tensor_by_index(into, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)
        return True

    def _apply(self, record: bytes, item: Any, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(record))
            return
        meta = self._tensor_meta.get(item.storage_index.fqn)
        sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
        if sizes is None:
            raise TypeError("the metadata lists no chunk of this tensor at the record's offsets")
        tensor = load_checked(record)  # nothing the archive claims is allocated beyond what it holds
        del record  # at most two copies of the largest record alive: decoded tensor and target
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"the record holds a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.size()) != sizes or tensor.dtype != meta.properties.dtype:
            raise TypeError(
                f"it holds {tensor.dtype}{tuple(tensor.size())}, the metadata's chunk is {meta.properties.dtype}{sizes}"
            )
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size() or target.dtype != tensor.dtype:
            raise TypeError(
                f"it holds {tensor.dtype}{tuple(tensor.size())}, the metadata says {target.dtype}{tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _expected(self, name: str, size: int, info: StorageInfo, item: Any) -> int | None:
        """The checksum ``.commit`` records for this record (``None`` without a marker).

        Raises ``CorruptCheckpointError`` when the record lies outside its file or the marker does not list it.
        """
        fqn = item.storage_index.fqn
        if info.offset + info.length > size:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends at {size}.",
                file=name,
            )
        if self.checksums is None:
            return None
        expected = self.checksums.get((name, info.offset))
        if expected is None or expected[0] != info.length:
            raise CorruptCheckpointError(
                f"{self.path}/{name}: record {fqn!r} (bytes {info.offset}..{info.offset + info.length}) is not listed"
                f" in {COMMIT_FILE}; the checkpoint's files and its commit marker disagree.",
                file=name,
            )
        return expected[1]

    def _read_record(self, stream: IO[bytes], name: str, info: StorageInfo, expected: int | None, item: Any) -> bytes:
        stream.seek(info.offset)
        record = stream.read(info.length)
        self._check_record(record, name, info, expected, item)
        return record

    def _check_record(self, record: Any, name: str, info: StorageInfo, expected: int | None, item: Any) -> None:
        """A record read whole (``info.length`` bytes) whose checksum matches ``.commit`` (when it records one)."""
        if len(record) != info.length:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {item.storage_index.fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends earlier.",
                file=name,
            )
        if expected is not None and checksum(record) != expected:
            raise self._corrupt(name, item)

    def _corrupt(self, name: str, item: Any) -> CorruptCheckpointError:
        return corrupt_record(f"{self.path}/{name}", name, item.storage_index.fqn)


class _Whole:
    """The read item of a lean plan's ``direct`` target: its whole tensor's one record.

    See :meth:`_VerifyingReader._per_file <lightning_dcp.engine.load.dcp_reader._VerifyingReader._per_file>`.

    It has what the reading loop needs of a read item (``type``, ``storage_index``); anything else gets the full
    read item from :meth:`~lightning_dcp.engine.load.record_checks.RecordChecks._read_item`.
    """

    __slots__ = ("storage_index",)
    type = LoadItemType.TENSOR

    def __init__(self, storage_index: MetadataIndex) -> None:
        self.storage_index = storage_index


def _destination(
    item: Any, dtype: torch.dtype, sizes: tuple, planner: LoadPlanner
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, into)`` for a tensor record of ``sizes``: the planner's target and where the record's bytes go.

    ``into`` is the target itself when the record is its whole, contiguous CPU memory; else a new chunk to copy from.

    Raises:
        TypeError: The target's dtype or shape differs from what the record holds.
    """
    target = planner.resolve_tensor(item).detach()
    if target.dtype != dtype or tuple(target.size()) != tuple(item.lengths):
        raise TypeError(f"it holds {dtype}{tuple(item.lengths)}, the target is {target.dtype}{tuple(target.size())}")
    whole = tuple(item.lengths) == sizes and not any(item.storage_offsets)
    direct = whole and target.device.type == "cpu" and target.is_contiguous()
    return target, target if direct else torch.empty(sizes, dtype=dtype)


def _chunk_sizes(meta: TensorStorageMetadata, index: MetadataIndex) -> tuple[int, ...] | None:
    """The shape of the saved chunk of ``meta`` that starts at ``index.offset`` (its ``index`` hint tried first)."""
    chunks, hint, offset = meta.chunks, index.index, index.offset
    if offset is not None and hint is not None and 0 <= hint < len(chunks):
        chunk = chunks[hint]
        if chunk.offsets == offset:  # torch.Size and tuples compare by value
            return tuple(chunk.sizes)
    key = tuple(offset) if offset is not None else (0,) * len(meta.size)
    for chunk in chunks:
        if tuple(chunk.offsets) == key:
            return tuple(chunk.sizes)
    return None
