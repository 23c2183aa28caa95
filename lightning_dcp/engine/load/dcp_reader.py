"""The DCP storage reader lightning_dcp uses: every record verified against ``.commit``, metadata read safely.

Any DCP directory loads (ours, Lightning's sharded layout, plain DCP); a directory with lightning_dcp's ``.commit``
must account for every record read, and every record's checksum is checked (see :class:`_VerifyingReader`). Local
files are read with few large calls (runs of small records at once, large records straight into their targets,
:mod:`~lightning_dcp.engine.load.reading`); object stores through one stream per file, or with concurrent ranged reads
and bounded memory (:mod:`~lightning_dcp.engine.storage.remote_read`, off by default: see ``_FsspecReader.concurrent``).
"""

from __future__ import annotations

import ctypes
import os
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from lightning_dcp._compat.torch_dcp import FsspecReader, StorageInfo, narrow_tensor_by_index
from lightning_dcp.engine.catalog.metadata import MAX_METADATA_BYTES, load_metadata
from lightning_dcp.engine.format.marker import (
    COMMIT_FILE,
    MAX_MARKER_BYTES,
    METADATA_FILE,
    MarkerError,
    checksum,
    parse_commit,
)
from lightning_dcp.engine.format.records import record_frame, tensor_record
from lightning_dcp.engine.load.reading import Source, land_run
from lightning_dcp.engine.load.record_checks import RecordChecks, _chunk_sizes, _Whole
from lightning_dcp.engine.load.shared_reads import SharedRecordReads, _runs
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.options import keep_options
from lightning_dcp.engine.storage.remote_read import Range, RangedReads, StreamedRecord, address_of, split
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError

__all__ = ["storage_reader"]


def storage_reader(location: Location) -> StorageReader:
    """A DCP storage reader for ``location`` that verifies record checksums and reads metadata safely."""
    if location.local:
        return _LocalReader(location.path)
    return keep_options(_FsspecReader(location.url, **location.storage_options), location.storage_options)


# ------------------------------------------------------------------------------------------------------ reading
class _VerifyingReader(SharedRecordReads, RecordChecks):
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
        self.sizes = {name: entry["size"] for name, entry in marker["files"].items()}
        for name, entry in marker["files"].items():
            for offset, length, digest in entry["records"]:
                self.checksums[(name, offset)] = (length, digest)

    def share_keys(self, plan: LoadPlan) -> list[tuple[str, int, int]] | None:
        """``(file, offset, length)`` of each tensor record ``plan`` reads.

        For :func:`~lightning_dcp.engine.load.shared_reads.agree`.

        ``None`` (this rank reads alone) for a checkpoint without our ``.commit``: its files' sizes and records'
        checksums, which every receiver checks against, are unknown.
        """
        if self.checksums is None:
            return None
        data, tensor = self.storage_data, LoadItemType.TENSOR
        infos = (data[item.storage_index] for item in plan.items if item.type == tensor)
        return [(info.relative_path, info.offset, info.length) for info in infos]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sharing = getattr(self, "sharing", None)
        if sharing is not None:
            plan = self._read_shared(plan, planner, sharing)
        per_file, names = self._per_file(plan, planner)
        for name in names:
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                source = Source(stream)
                try:
                    self._read_file(stream, source, name, per_file[name], planner)
                finally:
                    source.close()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _land(self, item: Any, target: torch.Tensor, into: torch.Tensor, planner: LoadPlanner) -> None:
        """A tensor chunk read (or received) into ``into``: into its target, and committed."""
        if into is not target:
            target.copy_(narrow_tensor_by_index(into, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

    def _guarded_value(self, name: str, item: Any, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except CheckpointError:
            raise
        except Exception as err:  # a record that is not what the metadata says it is
            raise self._undecodable(name, item, err) from None

    def _per_file(self, plan: LoadPlan, planner: Any = None) -> tuple[dict[str, list], list[str]]:
        """The plan's items by file (``(offset, storage info, read item)``, in file order) and the files' order.

        With a lean :class:`~lightning_dcp.engine.load.local_load.FastLoadPlanner`, also the records of its ``direct``
        targets (which the plan leaves out), each with a :class:`_Whole` for a read item.
        """
        per_file: dict[str, list] = {}
        storage_data = self.storage_data
        for item in plan.items:
            info = storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, info, item))
        direct = getattr(planner, "direct", None) if getattr(planner, "lean", False) else None
        if direct:
            found = 0
            for key, info in storage_data.items():
                if key.fqn in direct and key.offset is not None and not any(key.offset):
                    per_file.setdefault(info.relative_path, []).append((info.offset, info, _Whole(key)))
                    found += 1
            if found != len(direct):  # the metadata checks make this impossible; never copy on a guess
                raise CorruptCheckpointError(
                    f"{self.path}/{METADATA_FILE} does not list exactly one record for each whole tensor it describes"
                    f" ({found} records for {len(direct)} tensors).",
                    file=METADATA_FILE,
                )
        for entries in per_file.values():
            entries.sort(key=lambda e: e[0])
        # Ranks that read the same files (replicated state) read them in the same order: the first rank to ask for a
        # page reads it from the disk and the others wait for that read and copy it from the page cache, so the disk
        # streams each file once at its full speed. (Starting at different files made every rank read its first one
        # from the disk at a share of its speed, then copy the others': the BERT mix restored in 0.90-0.96 s that
        # way, 0.66-0.72 s in the same order.)
        return per_file, sorted(per_file)

    def _read_file(self, stream: IO[bytes], source: Source, name: str, entries: list, planner: LoadPlanner) -> None:
        """Read ``entries`` of one file: runs of small records with one call each, larger ones into their targets."""
        size = stream.seek(0, os.SEEK_END)
        for run, start, end, part in _runs(entries):
            if not run:
                _, info, item = part[0]
                self._read_one(stream, source, name, size, info, self._read_item(item), planner)
                continue
            checked = self._checked(name, size, part)  # each record inside the file before reading
            span, address = source.read_span(start, end - start)
            self._take_run(name, checked, start, span, address, planner)

    def _checked(self, name: str, size: int, part: list) -> list[tuple[int, StorageInfo, Any, int | None]]:
        """``part``'s ``(offset, storage info, read item)`` with each record's checksum (:meth:`_expected`)."""
        checksums = self.checksums
        if checksums is None:
            return [(offset, info, item, self._expected(name, size, info, item)) for offset, info, item in part]
        checked = []
        for offset, info, item in part:  # what _expected checks, inline (thousands of small records)
            expected = checksums.get((name, offset))
            if expected is None or expected[0] != info.length or offset + info.length > size:
                expected = (info.length, self._expected(name, size, info, item))  # raises, naming what is wrong
            checked.append((offset, info, item, expected[1]))
        return checked

    def _take_run(self, name: str, checked: list, start: int, span: memoryview, address: int, planner) -> None:
        """Apply a run of records read in one call (``span``, from file offset ``start``, at memory ``address``).

        Through the restores' one landing loop (:func:`~lightning_dcp.engine.load.reading.land_run`): each record is
        checked (its length, its checksum against ``.commit``); the whole-tensor targets of a lean plan (``direct``)
        get their raw bytes copied when framed as ours; the rest is landed here: a tensor chunk in our layout copied
        raw into its resolved target, anything else decoded the general way.
        """
        direct = getattr(planner, "direct", None) or {}  # FastLoadPlanner's whole-tensor targets, by FQN
        tensor_kind = LoadItemType.TENSOR
        records = []
        for offset, info, item, expected in checked:
            hit = direct.get(item.storage_index.fqn) if item.type == tensor_kind else None
            if hit is None:
                records.append((offset, info.length, expected, None, 0, info, item))
            else:  # the planner checked target and chunk: only the record's frame is left to check
                records.append((offset, info.length, expected, hit[1], hit[0], info, item))

        def failed(entry: tuple, record: memoryview) -> None:
            self._check_record(record, name, entry[5], entry[2], entry[6])  # raises: truncated, or not its checksum

        def other(entry: tuple, record: memoryview) -> None:
            self._guarded(name, entry[6], self._land_record, record, address + (entry[0] - start), entry[6], planner)

        land_run(span, address, start, records, failed=failed, other=other)

    def _land_record(self, record: memoryview, at: int, item: Any, planner: LoadPlanner) -> None:
        """One record of a run that :func:`land_run` did not land (at memory ``at``), into its target.

        Raw when it is in our layout, else decoded the general way. A direct target in another writer's framing comes
        here too, as its full read item.
        """
        item = self._read_item(item)
        meta = self._tensor_meta.get(item.storage_index.fqn) if item.type == LoadItemType.TENSOR else None
        sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
        if sizes is not None:
            dtype = meta.properties.dtype
            full, begin, end, prefix, suffix = record_frame(dtype, sizes)
            length = record.nbytes
            if length == full and record[:begin].tobytes() == prefix and record[end:].tobytes() == suffix:
                target = planner.resolve_tensor(item).detach()
                if (
                    target.dtype == dtype
                    and item.lengths == sizes
                    and target.shape == sizes
                    and not any(item.storage_offsets)
                    and target.device.type == "cpu"
                    and target.is_contiguous()
                ):  # the whole chunk into its own memory: what _copy_raw does, without its lookups
                    if end > begin:
                        ctypes.memmove(target.data_ptr(), at + begin, end - begin)
                    planner.commit_tensor(item, target)
                else:
                    self._copy_raw(item, dtype, sizes, at + begin, end - begin, planner)
                return
        self._apply(bytes(record), item, planner)


class _LocalReader(_VerifyingReader, FileSystemReader):
    reads_direct = True
    """Reads a lean plan's ``direct`` targets by FQN (:meth:`_VerifyingReader._per_file`)."""


class _FsspecReader(_VerifyingReader, FsspecReader):
    """Object stores and other fsspec filesystems: each file read through one stream, in order.

    With :attr:`concurrent`, a rank's reads are concurrent ranged requests instead, bounded in memory.
    """

    shares_reads = True
    """Under DDP, each record every rank reads comes over the network once and is broadcast to the other ranks
    (:mod:`~lightning_dcp.engine.load.shared_reads`). Local disks do not share: the other ranks read the same files from
    the page cache, cheaper than a broadcast (a 177 MB convnet restore at 2 ranks, ``python -m benchmarks.bench_trainer
    --mix conv --tasks load``: 0.95 s shared, 0.72 s not, in two runs of the same session)."""

    concurrent = False
    """Concurrent ranged reads (:mod:`~lightning_dcp.engine.storage.remote_read`). Off by default: against SeaweedFS on
    loopback (2 cores) a resume with them took 3.36 s against 1.65 s streaming each file (``python -m
    benchmarks.bench_remote --mix gpt2 --scale 0.5``); their gain needs a store with real network latency to show."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self.concurrent or getattr(self, "sharing", None) is not None:
            return super().read_data(plan, planner)
        per_file, names = self._per_file(plan)
        ranges: list[Range] = []
        jobs = []
        for name in names:
            path = str(self.fs.concat_path(self.path, name))
            size = self._file_size(name, path)
            for run, start, end, part in _runs(per_file[name]):
                checked = self._checked(name, size, part)  # each record inside the file before reading
                pieces = [Range(path, start, end)] if run else split(path, start, end)
                ranges += pieces
                jobs.append((run, name, size, checked, path, len(pieces)))
        fetched = RangedReads(lambda path, start, end: self.fs.fs.cat_file(path, start=start, end=end))(ranges)
        try:
            for run, name, size, checked, path, count in jobs:
                if run:
                    piece, data = next(fetched)
                    self._take_run(name, checked, piece.start, memoryview(data), address_of(data), planner)
                else:
                    _, info, item, _ = checked[0]
                    self._guarded(name, item, self._stream_one, fetched, count, path, name, size, info, item, planner)
        finally:
            fetched.close()  # requests still in flight are cancelled or awaited
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _file_size(self, name: str, path: str) -> int:
        size = getattr(self, "sizes", {}).get(name)
        return size if size is not None else self.fs.fs.size(path)

    def _stream_one(self, fetched, count: int, path: str, name: str, size: int, info, item, planner) -> None:
        """One large record from ``count`` fetched ranges: into its target as it arrives when it is in our layout."""
        expected = self._expected(name, size, info, item)
        target, layout = self._direct_target(item, info, planner)
        if target is not None:
            record = StreamedRecord(info.length, layout.data_offset, layout.nbytes, target.data_ptr())
        else:
            record = StreamedRecord(info.length)
        for _ in range(count):
            _, data = next(fetched)
            record.add(memoryview(data), address_of(data))
        if record.position != info.length:
            raise CorruptCheckpointError(
                f"{self.path}/{name} is truncated: record {item.storage_index.fqn!r} needs bytes"
                f" {info.offset}..{info.offset + info.length}, the file ends earlier.",
                file=name,
            )
        if expected is not None and record.hasher.intdigest() != expected:
            raise self._corrupt(name, item)
        if target is not None:
            if bytes(record.kept) == layout.prefix + layout.suffix:
                planner.commit_tensor(item, target)
                return
            data = self.fs.fs.cat_file(path, start=info.offset, end=info.offset + info.length)  # not our layout
        else:
            data = bytes(record.kept)
        self._apply(data, item, planner)

    def _direct_target(self, item, info, planner) -> tuple[torch.Tensor | None, Any]:
        """The target tensor and record layout when the record's raw bytes can land in the target as they are."""
        if item.type != LoadItemType.TENSOR:
            return None, None
        meta = self._tensor_meta.get(item.storage_index.fqn)
        sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
        if sizes is None:
            return None, None
        layout = tensor_record(meta.properties.dtype, sizes)
        target = planner.resolve_tensor(item).detach()
        whole = tuple(item.lengths) == sizes and not any(item.storage_offsets)
        direct = (
            whole and target.device.type == "cpu" and target.is_contiguous() and target.dtype == meta.properties.dtype
        )
        if not direct or info.length != layout.length or tuple(target.size()) != sizes:
            return None, None
        return target, layout
