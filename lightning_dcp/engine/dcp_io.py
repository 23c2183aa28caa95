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

import ctypes
import dataclasses
import gc
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_dcp._compat import (
    DCP_METADATA_VERSION,
    DCPFsspecFileSystem,
    FsspecReader,
    FsspecWriter,
    StorageInfo,
    narrow_tensor_by_index,
)
from lightning_dcp.engine.archive import check_archive
from lightning_dcp.engine.datafiles import FileJob, RecordResult, assign_files, write_local, write_stream
from lightning_dcp.engine.fileout import PIECE
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
from lightning_dcp.engine.planning import BalancedSavePlanner
from lightning_dcp.engine.reading import SMALL_RECORD, Source, read_raw
from lightning_dcp.engine.records import tensor_record
from lightning_dcp.engine.storage import Location
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError, describe_load_error

__all__ = ["compact_result", "metadata_pickle", "save_planner", "storage_reader", "storage_writer"]


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


def save_planner(*, writers: int) -> SavePlanner:
    """The save planner for a save with ``writers`` writers in all (ranks x threads per rank).

    With more than one, large replicated tensors are split into row chunks so that every writer gets an equal share
    (:mod:`lightning_dcp.engine.planning`).
    """
    return BalancedSavePlanner(split=writers > 1)


def storage_reader(location: Location) -> StorageReader:
    """A DCP storage reader for ``location`` that verifies record checksums and reads metadata safely."""
    if location.local:
        return _LocalReader(location.path)
    return _keep_options(_FsspecReader(location.url, **location.storage_options), location.storage_options)


# ------------------------------------------------------------------------------------------------------ writing
class _ChecksummingWriter:
    """Write DCP records ourselves, checksumming each while it is written; then commit with ``.commit``.

    The records and files are :mod:`lightning_dcp.engine.datafiles`'s.
    ``local_files``: write with :func:`~lightning_dcp.engine.datafiles.write_local` (a local disk) rather than
    through an fsspec stream.
    """

    incremental: Any = None
    """Set by ``Incremental.attach``: large records in files of their own, unchanged ones linked."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's storage-writer contract: :meth:`write_compact` as ``WriteResult`` objects."""
        future: Future[list[WriteResult]] = Future()
        # The checksum rides along to the coordinator and is moved into .commit in finish().
        future.set_result(
            [
                WriteResult(
                    index=MetadataIndex(fqn, offsets),
                    size_in_bytes=size,
                    storage_data=(StorageInfo(name, offset, length), digest),
                )
                for fqn, offsets, size, name, offset, length, digest in self.write_compact(plan, planner)
            ]
        )
        return future

    def write_compact(self, plan: SavePlan, planner: SavePlanner) -> list[tuple]:
        """Write this rank's records; ``(fqn, offsets, size, file, offset, length, checksum)`` for each."""
        own = getattr(self.incremental, "own_file", None)
        jobs = assign_files(
            plan.items, prefix=plan.storage_data.prefix, files=self.thread_count, suffix=DATA_SUFFIX, own_file=own
        )
        if len(jobs) > 1:
            workers = self.thread_count + (self.incremental is not None)  # comparing overlaps writing
            with ThreadPoolExecutor(max_workers=min(len(jobs), workers)) as pool:
                per_file = list(pool.map(lambda job: self._write_file(planner, job), jobs))
        else:
            per_file = [self._write_file(planner, job) for job in jobs]
        return [
            (
                r.item.index.fqn,
                None if r.item.index.offset is None else tuple(r.item.index.offset),
                r.length,
                r.file,
                r.offset,
                r.length,
                r.digest,
            )
            for results in per_file
            for r in results
        ]

    def _write_file(self, planner: SavePlanner, job: FileJob) -> list[RecordResult]:
        path = self.fs.concat_path(self.path, job.name)
        if self.incremental is not None and self.local_files:
            linked = self.incremental.reuse(os.fspath(path), job, planner.resolve_data)
            if linked is not None:
                return linked
        if self.local_files:
            return write_local(os.fspath(path), job, planner.resolve_data, sync=self.sync_files)
        with self.fs.create_stream(path, "wb") as stream:
            return write_stream(stream, job, planner.resolve_data)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's storage-writer contract (coordinator): :meth:`finish_compact` of the results."""
        self.finish_compact(metadata, [[compact_result(r) for r in rank_results] for rank_results in results])

    def finish_compact(self, metadata: Metadata, results: list[list[tuple]]) -> None:
        """Write ``.metadata`` (what ``FileSystemWriter.finish`` writes) and then ``.commit`` (coordinator only).

        Args:
            metadata: The global plan's metadata (not modified).
            results: Per rank, ``(fqn, offsets, size, file, offset, length, checksum)`` of every record written.
        """
        files: dict[str, dict[str, Any]] = {}
        for rank_results in results:
            for _, _, _, name, offset, length, digest in rank_results:
                entry = files.get(name)
                if entry is None:
                    entry = files[name] = {"size": 0, "records": []}
                entry["records"].append([offset, length, digest])
                if offset + length > entry["size"]:
                    entry["size"] = offset + length
        metadata_bytes = metadata_pickle(metadata, results)
        self._put(METADATA_FILE, metadata_bytes, atomic=self.local_files)
        self._put(COMMIT_FILE, encode_commit(metadata_bytes=metadata_bytes, files=files), atomic=False)

    def _put(self, name: str, data: bytes, *, atomic: bool) -> None:
        final = self.fs.concat_path(self.path, name)
        path = self.fs.concat_path(self.path, name + ".tmp") if atomic else final
        with self.fs.create_stream(path, "wb") as f:
            f.write(data)
            if self.sync_files and self.local_files:
                f.flush()
                os.fsync(f.fileno())
        if atomic:
            self.fs.rename(path, final)


def compact_result(result: WriteResult) -> tuple:
    """``(fqn, offsets, size, file, offset, length, checksum)`` of one record our writer wrote."""
    info, digest = result.storage_data
    offset = None if result.index.offset is None else tuple(result.index.offset)
    return (result.index.fqn, offset, result.size_in_bytes, info.relative_path, info.offset, info.length, digest)


_METADATA_CACHE: list[Any] = []  # [(metadata, layout key, bytes)]: the last ``.metadata`` pickled


def metadata_pickle(metadata: Metadata, results: list[list[tuple]]) -> bytes:
    """The bytes of ``.metadata``: ``metadata`` with the records' storage locations, pickled as DCP does.

    A training run saves the same layout every time (the same plan, the same record sizes, the same files): then the
    bytes of the previous save are reused, because pickling thousands of entries takes longer than writing them.
    ``storage_meta`` (the path and a random id of the save, which nothing reads) is left out so that the bytes of
    two saves can be equal; DCP's readers fill it in when they load.
    """
    key = tuple(record[:6] for rank_results in results for record in rank_results)
    if _METADATA_CACHE and _METADATA_CACHE[0][0] is metadata and _METADATA_CACHE[0][1] == key:
        return _METADATA_CACHE[0][2]
    storage_data = {
        MetadataIndex(fqn, None if offset is None else torch.Size(offset)): StorageInfo(name, start, length)
        for fqn, offset, _, name, start, length in key
    }
    final = dataclasses.replace(metadata, storage_data=storage_data, storage_meta=None)
    if DCP_METADATA_VERSION is not None:
        final.version = DCP_METADATA_VERSION
    enabled = gc.isenabled()
    gc.disable()  # thousands of small objects: collections would run over the whole heap many times
    try:
        data = pickle.dumps(final)
    finally:
        if enabled:
            gc.enable()
    _METADATA_CACHE[:] = [(metadata, key, data)]
    return data


class _LocalWriter(_ChecksummingWriter, FileSystemWriter):
    local_files = True


class _FsspecWriter(_ChecksummingWriter, FsspecWriter):  # DCP's FsspecWriter is a FileSystemWriter too
    local_files = False


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
        self._metadata_bytes = data
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.checksums: dict[tuple[str, int], tuple[int, int]] | None = None
        self._tensor_meta = {
            key: meta for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
        }
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, COMMIT_FILE), "rb") as f:
                data = f.read(MAX_MARKER_BYTES + 1)
        except FileNotFoundError:
            return  # not written by lightning_dcp: nothing to verify against
        try:
            marker = parse_commit(data)
        except MarkerError as err:
            raise CorruptCheckpointError(f"{self.path}/{COMMIT_FILE} is not valid: {err}.", file=COMMIT_FILE) from None
        read = getattr(self, "_metadata_bytes", None)
        if read is not None and (len(read), checksum(read)) != (
            marker["metadata"]["size"],
            marker["metadata"]["checksum"],
        ):
            raise CorruptCheckpointError(
                f"{self.path}/{METADATA_FILE} does not match the size and checksum recorded in {COMMIT_FILE}."
                " Restore the file or resume from another checkpoint.",
                file=METADATA_FILE,
            )
        self.checksums = {}
        for name, entry in marker["files"].items():
            for offset, length, digest in entry["records"]:
                self.checksums[(name, offset)] = (length, digest)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        storage_data = self.storage_data
        for item in plan.items:
            info = storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, info, item))
        names = sorted(per_file)
        # Ranks that read the same files (replicated state) start at different ones: each file comes from the disk
        # once, read by one rank while another reads another, and from the page cache for the rest.
        first = (self.rank or 0) % len(names) if names else 0
        for name in names[first:] + names[:first]:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                source = Source(stream)
                try:
                    self._read_file(stream, source, name, per_file[name], planner)
                finally:
                    source.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_file(self, stream: IO[bytes], source: Source, name: str, entries: list, planner: LoadPlanner) -> None:
        """Read ``entries`` (``(offset, storage info, read item)``) of one file, in file order.

        Runs of small records are read with one call each (up to :data:`~lightning_dcp.engine.fileout.PIECE`
        bytes) and taken apart in memory; larger records are read one by one, straight into their targets.
        """
        size = stream.seek(0, os.SEEK_END)
        entries.sort(key=lambda e: e[0])
        count, i = len(entries), 0
        while i < count:
            offset, info, item = entries[i]
            if info.length > SMALL_RECORD:
                self._read_one(stream, source, name, size, info, item, planner)
                i += 1
                continue
            j, end = i, offset
            while j < count:  # the run: small records, close together, within one buffer
                start_j, info_j, _ = entries[j]
                if info_j.length > SMALL_RECORD or start_j - end > _GAP or start_j + info_j.length - offset > PIECE:
                    break
                end = max(end, start_j + info_j.length)
                j += 1
            for _, info_j, item_j in entries[i:j]:
                self._expected(name, size, info_j, item_j)  # each record inside the file before reading
            span, address = source.read_span(offset, end - offset)
            for start_j, info_j, item_j in entries[i:j]:
                rel = start_j - offset
                self._guarded(
                    name,
                    item_j,
                    self._take,
                    name,
                    size,
                    info_j,
                    item_j,
                    span[rel : rel + info_j.length],
                    address + rel,
                    planner,
                )
            i = j

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
            raise CorruptCheckpointError(
                f"{self.path}/{name}: record {item.storage_index.fqn!r} cannot be read as the metadata"
                f" describes it ({describe_load_error(err)}).",
                file=name,
            ) from None

    def _take(
        self, name: str, size: int, info: StorageInfo, item: Any, record: memoryview, address: int, planner: LoadPlanner
    ) -> None:
        """Apply one record already in memory (``record``, at ``address``): checked, then copied to its target."""
        expected = self._expected(name, size, info, item)
        if len(record) != info.length:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {item.storage_index.fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends earlier.",
                file=name,
            )
        if expected is not None and _digest(record) != expected:
            raise self._corrupt(name, item)
        if item.type == LoadItemType.TENSOR:
            meta = self._tensor_meta.get(item.storage_index.fqn)
            sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
            if sizes is not None:
                layout = tensor_record(meta.properties.dtype, sizes)
                data, end = layout.data_offset, layout.data_offset + layout.nbytes
                if info.length == layout.length and record[:data] == layout.prefix and record[end:] == layout.suffix:
                    self._copy_raw(item, meta.properties.dtype, sizes, address + data, layout.nbytes, planner)
                    return
        self._apply(bytes(record), item, planner)

    def _copy_raw(self, item: Any, dtype: torch.dtype, sizes: tuple, address: int, nbytes: int, planner) -> None:
        target = planner.resolve_tensor(item).detach()
        if target.dtype != dtype or tuple(target.size()) != tuple(item.lengths):
            raise TypeError(
                f"it holds {dtype}{tuple(item.lengths)}, the target is {target.dtype}{tuple(target.size())}"
            )
        whole = tuple(item.lengths) == sizes and not any(item.storage_offsets)
        direct = whole and target.device.type == "cpu" and target.is_contiguous()
        into = target if direct else torch.empty(sizes, dtype=dtype)
        if nbytes:
            ctypes.memmove(into.data_ptr(), address, nbytes)
        if not direct:
            target.copy_(narrow_tensor_by_index(into, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

    def _read_in_place(
        self, source: Source, name: str, info: StorageInfo, expected: int | None, item: Any, planner: LoadPlanner
    ) -> bool:
        """Read a tensor record in our layout straight into its target (:mod:`lightning_dcp.engine.reading`).

        Returns False when the record is not in that layout (the general path then reads it).
        """
        if item.type != LoadItemType.TENSOR:
            return False
        meta = self._tensor_meta.get(item.storage_index.fqn)
        sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
        if sizes is None:
            return False
        dtype = meta.properties.dtype
        target = planner.resolve_tensor(item).detach()
        if target.dtype != dtype or tuple(target.size()) != tuple(item.lengths):
            raise TypeError(
                f"it holds {dtype}{tuple(item.lengths)}, the target is {target.dtype}{tuple(target.size())}"
            )
        whole = tuple(item.lengths) == sizes and not any(item.storage_offsets)
        direct = whole and target.device.type == "cpu" and target.is_contiguous()
        into = target if direct else torch.empty(sizes, dtype=dtype)
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
        check_archive(record)  # nothing the archive claims is allocated beyond what it holds
        tensor = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
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
        if len(record) != info.length:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {item.storage_index.fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends earlier.",
                file=name,
            )
        if expected is not None and checksum(record) != expected:
            raise self._corrupt(name, item)
        return record

    def _corrupt(self, name: str, item: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path}/{name} is corrupt: record {item.storage_index.fqn!r} does not match the checksum recorded at"
            " save. Restore the file or resume from another checkpoint.",
            file=name,
        )


def _chunk_sizes(meta: TensorStorageMetadata, index: MetadataIndex) -> tuple[int, ...] | None:
    """The shape of the saved chunk of ``meta`` that starts at ``index.offset`` (its ``index`` hint tried first)."""
    key = tuple(index.offset) if index.offset is not None else (0,) * len(meta.size)
    hint = index.index
    if hint is not None and 0 <= hint < len(meta.chunks) and tuple(meta.chunks[hint].offsets) == key:
        return tuple(meta.chunks[hint].sizes)
    for chunk in meta.chunks:
        if tuple(chunk.offsets) == key:
            return tuple(chunk.sizes)
    return None


_GAP = 64 << 10
"""Records this close together are read with the ones before them (the bytes between are read and skipped)."""
_digest = xxhash.xxh3_64_intdigest


class _LocalReader(_VerifyingReader, FileSystemReader):
    pass


class _FsspecReader(_VerifyingReader, FsspecReader):
    pass
