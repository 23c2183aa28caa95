"""The DCP storage writer and reader lightning_dcp uses: checksummed writes, verified reads.

Files stay exactly DCP's (``__{rank}_{n}.distcp`` records written with ``torch.save``, ``.metadata``), so any DCP
reader loads them. On top of that:

- the writer computes a checksum (xxHash3-64) of every record while writing it (no second pass over the disk) and
  the coordinator writes them, with the size and checksum of ``.metadata``, to ``.commit`` **after** ``.metadata``:
  ``.commit`` is lightning_dcp's commit marker (:mod:`lightning_dcp.engine.marker`), and a directory without it is
  never treated as a checkpoint;
- the reader verifies the checksum of every record it reads (so a flipped bit never loads silently) and names the
  file; ``.metadata`` is read by :mod:`lightning_dcp.engine.metadata` (allow-listed unpickling, then checked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_dcp._compat import DCPFsspecFileSystem, FsspecReader, FsspecWriter, StorageInfo, narrow_tensor_by_index
from lightning_dcp.engine.marker import (
    COMMIT_FILE,
    DATA_SUFFIX,
    MAX_MARKER_BYTES,
    METADATA_FILE,
    MarkerError,
    checksum,
    encode_commit,
    parse_commit,
)
from lightning_dcp.engine.metadata import MAX_METADATA_BYTES, load_metadata
from lightning_dcp.engine.storage import Location
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError, describe_load_error

__all__ = ["storage_reader", "storage_writer"]


def storage_writer(location: Location, *, thread_count: int, sync_files: bool) -> StorageWriter:
    """A checksumming DCP storage writer for the directory at ``location``.

    Local disks: DCP's ``FileSystemWriter`` layout, ``fsync`` per file when ``sync_files``. Other protocols:
    ``FsspecWriter`` with the location's storage options and never ``sync_files`` (without a file descriptor DCP
    would fall back to a host-wide ``os.sync()`` per file).
    """
    if location.local:
        return _LocalWriter(location.path, thread_count=thread_count, sync_files=sync_files, overwrite=True)
    writer = _FsspecWriter(location.url, thread_count=thread_count, sync_files=False, **location.storage_options)
    return _keep_options(writer, location.storage_options)


def storage_reader(location: Location) -> StorageReader:
    """A DCP storage reader for ``location`` that verifies record checksums and reads metadata safely."""
    if location.local:
        return _LocalReader(location.path)
    return _keep_options(_FsspecReader(location.url, **location.storage_options), location.storage_options)


# ------------------------------------------------------------------------------------------------------ writing
class _HashingStream:
    """A write-only stream that forwards to ``raw`` and keeps a running checksum and byte count."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.position = 0
        self.hasher = xxhash.xxh3_64()
        self.error: OSError | None = None  # torch.save's zip writer hides OSErrors behind a RuntimeError

    def begin_record(self) -> int:
        """Start a new record: reset the running checksum; returns the record's offset."""
        self.hasher.reset()
        return self.position

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self.raw.write(view)
        except OSError as err:
            self.error = err
            raise
        self.hasher.update(view)
        self.position += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()

    def writable(self) -> bool:
        return True


_ZIP_CRC_LOCK = threading.Lock()
_ZIP_CRC_USERS = 0
_ZIP_CRC_BEFORE = True


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """Skip the CRC32 ``torch.save`` computes for its zip records while we write ours.

    That CRC is never verified by ``torch.load`` and costs a full pass over every byte at ~1.5 GB/s (here it was
    most of the serialization time); each record already gets our own, faster checksum. The setting is process-wide
    (``torch.serialization.set_crc32_options``), so it is switched off while any of our saves runs and restored after
    the last one; a ``torch.save`` elsewhere in the meantime writes a zip without CRCs, which torch loads the same.
    """
    global _ZIP_CRC_USERS, _ZIP_CRC_BEFORE
    with _ZIP_CRC_LOCK:
        if _ZIP_CRC_USERS == 0:
            _ZIP_CRC_BEFORE = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _ZIP_CRC_USERS += 1
    try:
        yield
    finally:
        with _ZIP_CRC_LOCK:
            _ZIP_CRC_USERS -= 1
            if _ZIP_CRC_USERS == 0:
                torch.serialization.set_crc32_options(_ZIP_CRC_BEFORE)


def _balance(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Split write items into ``bins`` files of similar byte size (largest tensors first)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    sizes = [0] * bins

    def size(item: WriteItem) -> int:
        if item.tensor_data is None:
            return 0
        return item.tensor_data.size.numel() * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()

    for item in sorted(items, key=size, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(item)
        sizes[i] += size(item)
    return [b for b in buckets if b]


class _ChecksummingWriter:
    """Write DCP records ourselves so each record's checksum is known exactly; then commit with ``.commit``."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        jobs = [
            (f"{prefix}{i}{DATA_SUFFIX}", bucket) for i, bucket in enumerate(_balance(plan.items, self.thread_count))
        ]
        with _without_zip_crc32():
            if len(jobs) > 1:
                with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                    per_file = list(pool.map(lambda job: self._write_file(planner, *job), jobs))
            else:
                per_file = [self._write_file(planner, *job) for job in jobs]
        future: Future[list[WriteResult]] = Future()
        future.set_result([result for results in per_file for result in results])
        return future

    def _write_file(self, planner: SavePlanner, file_name: str, items: list[WriteItem]) -> list[WriteResult]:
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as raw:
            out = _HashingStream(raw)
            for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
                data = planner.resolve_data(item)
                start = out.begin_record()
                if item.type == WriteItemType.BYTE_IO:
                    out.write(data.getbuffer())
                else:
                    tensor = data.detach().cpu()
                    if tensor.untyped_storage().size() != tensor.nbytes:
                        tensor = tensor.clone()  # a view: write only its own elements
                    try:
                        torch.save(tensor, out)
                    except RuntimeError:
                        if out.error is not None:
                            raise out.error from None
                        raise
                info = StorageInfo(file_name, start, out.position - start)
                # The checksum rides along to the coordinator and is moved into .commit in finish().
                results.append(
                    WriteResult(
                        index=item.index, size_in_bytes=info.length, storage_data=(info, out.hasher.intdigest())
                    )
                )
            raw.flush()
            if self.sync_files:
                os.fsync(raw.fileno())
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, dict[str, Any]] = {}
        plain = []
        for rank_results in results:
            plain.append([])
            for result in rank_results:
                info, digest = result.storage_data
                entry = files.setdefault(info.relative_path, {"size": 0, "records": []})
                entry["records"].append([info.offset, info.length, digest])
                entry["size"] = max(entry["size"], info.offset + info.length)
                plain[-1].append(dataclasses.replace(result, storage_data=info))
        super().finish(metadata, plain)
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_FILE), "rb") as f:
            metadata_bytes = f.read()
        with self.fs.create_stream(self.fs.concat_path(self.path, COMMIT_FILE), "wb") as f:
            f.write(encode_commit(metadata_bytes=metadata_bytes, files=files))
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())


class _LocalWriter(_ChecksummingWriter, FileSystemWriter):
    pass


class _FsspecWriter(_ChecksummingWriter, FsspecWriter):
    pass


class _OptionsFileSystem(DCPFsspecFileSystem):
    """DCP's fsspec adapter, except that ``init_path`` (called by ``reset(checkpoint_id)``) keeps the options."""

    def __init__(self, inner: DCPFsspecFileSystem, storage_options: dict[str, Any]) -> None:
        super().__init__()
        self.fs = inner.fs
        self._storage_options = storage_options

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return super().init_path(path, **{**self._storage_options, **kwargs})


def _keep_options(io: Any, storage_options: dict[str, Any]) -> Any:
    # DCP's FsspecWriter/FsspecReader.reset(checkpoint_id) re-create their filesystem from the URL alone; give them
    # one that re-applies our storage options, so credentials and endpoint survive any reset.
    if isinstance(getattr(io, "fs", None), DCPFsspecFileSystem):
        io.fs = _OptionsFileSystem(io.fs, storage_options)
    return io


# ------------------------------------------------------------------------------------------------------ reading
class _VerifyingReader:
    """Read records as DCP's filesystem readers do, checking each record against ``.commit`` first.

    A checkpoint with a ``.commit`` marker (lightning_dcp's) must account for every record read: a record that the
    marker does not list, that lies outside its file, or whose bytes do not match the recorded checksum fails with
    :class:`CorruptCheckpointError` naming the file; so does a record that does not decode to what the metadata
    says. Directories without a marker (Lightning's own sharded layout, plain DCP) are read unchecked.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata (no collectives): not a layout we write
            raise NotACheckpointError("Per-rank DCP metadata files are not supported.")
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_FILE), "rb") as f:
            data = f.read(MAX_METADATA_BYTES + 1)
        if len(data) > MAX_METADATA_BYTES:
            raise NotACheckpointError(f"{self.path}/{METADATA_FILE} is larger than {MAX_METADATA_BYTES} bytes.")
        metadata = load_metadata(data, where=f"{self.path}/{METADATA_FILE}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.checksums: dict[tuple[str, int], tuple[int, int]] | None = None
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, COMMIT_FILE), "rb") as f:
                data = f.read(MAX_MARKER_BYTES + 1)
        except FileNotFoundError:
            return  # not written by lightning_dcp: nothing to verify against
        try:
            marker = parse_commit(data)
        except MarkerError as err:
            raise CorruptCheckpointError(f"{self.path}/{COMMIT_FILE} is not valid: {err}.", file=COMMIT_FILE) from None
        self.checksums = {}
        for name, entry in marker["files"].items():
            for offset, length, digest in entry["records"]:
                self.checksums[(name, offset)] = (length, digest)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                size = stream.seek(0, os.SEEK_END)
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    record = self._read_record(stream, name, size, info, item)
                    try:
                        self._apply(record, item, planner)
                    except CheckpointError:
                        raise
                    except Exception as err:  # a record that is not what the metadata says it is
                        raise CorruptCheckpointError(
                            f"{self.path}/{name}: record {item.storage_index.fqn!r} cannot be read as the metadata"
                            f" describes it ({describe_load_error(err)}).",
                            file=name,
                        ) from None
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _apply(self, record: bytes, item: Any, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(record))
            return
        tensor = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
        del record  # at most two copies of the largest record alive: decoded tensor and target
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"the record holds a {type(tensor).__name__}, not a tensor")
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size() or target.dtype != tensor.dtype:
            raise TypeError(
                f"it holds {tensor.dtype}{tuple(tensor.size())}, the metadata says {target.dtype}{tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _read_record(self, stream: IO[bytes], name: str, size: int, info: StorageInfo, item: Any) -> bytes:
        fqn = item.storage_index.fqn
        if info.offset + info.length > size:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends at {size}.",
                file=name,
            )
        expected = None if self.checksums is None else self.checksums.get((name, info.offset))
        if self.checksums is not None and (expected is None or expected[0] != info.length):
            raise CorruptCheckpointError(
                f"{self.path}/{name}: record {fqn!r} (bytes {info.offset}..{info.offset + info.length}) is not listed"
                f" in {COMMIT_FILE}; the checkpoint's files and its commit marker disagree.",
                file=name,
            )
        stream.seek(info.offset)
        record = stream.read(info.length)
        if len(record) != info.length:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends earlier.",
                file=name,
            )
        if expected is not None and checksum(record) != expected[1]:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is corrupt: record {fqn!r} does not match the checksum recorded at save. Restore"
                " the file or resume from another checkpoint.",
                file=name,
            )
        return record


class _LocalReader(_VerifyingReader, FileSystemReader):
    pass


class _FsspecReader(_VerifyingReader, FsspecReader):
    pass
