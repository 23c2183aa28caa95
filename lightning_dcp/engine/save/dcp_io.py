"""The checksumming DCP storage writer lightning_dcp uses (its reader: :mod:`lightning_dcp.engine.load.dcp_reader`).

Files stay exactly DCP's (``__{rank}_{n}.distcp`` records written with ``torch.save``, ``.metadata``), so any DCP
reader loads them. On top of that:

- the writer computes a checksum (xxHash3-64) of every record while writing it (no second pass over the disk) and
  the coordinator writes them, with the size and checksum of ``.metadata``, to ``.commit`` **after** ``.metadata``:
  ``.commit`` is lightning_dcp's commit marker (:mod:`lightning_dcp.engine.format.marker`), and a directory without it
  is never treated as a checkpoint;
- the reader verifies the checksum of every record it reads (so a flipped bit never loads silently) and names the
  file; ``.metadata`` is read by :mod:`lightning_dcp.engine.catalog.metadata` (allow-listed unpickling, then checked).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_dcp._compat.torch_dcp import DCP_METADATA_VERSION, FsspecWriter, StorageInfo
from lightning_dcp.engine.format.marker import (
    COMMIT_FILE,
    DATA_SUFFIX,
    METADATA_FILE,
    encode_commit,
)
from lightning_dcp.engine.format.record_index import encode_index
from lightning_dcp.engine.gc_pause import gc_paused
from lightning_dcp.engine.save.datafiles import (
    FileJob,
    RecordResult,
    assign_files,
    write_local,
    write_stream,
)
from lightning_dcp.engine.save.memo import PlanMemo
from lightning_dcp.engine.save.planning import BalancedSavePlanner
from lightning_dcp.engine.storage.localfs import CANNOT_RENAME
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.options import keep_options
from lightning_dcp.errors import CorruptCheckpointError

__all__ = ["compact_result", "keep_options", "metadata_pickle", "save_planner", "storage_writer"]


def storage_writer(location: Location, *, thread_count: int, sync_files: bool) -> StorageWriter:
    """A checksumming DCP storage writer for the directory at ``location``.

    Local disks: DCP's ``FileSystemWriter`` layout, ``fsync`` per file when ``sync_files``. Other protocols:
    ``FsspecWriter`` with the location's storage options and never ``sync_files`` (without a file descriptor DCP
    would fall back to a host-wide ``os.sync()`` per file).
    """
    if location.local:
        return _LocalWriter(location.path, thread_count=thread_count, sync_files=sync_files, overwrite=True)
    writer = _FsspecWriter(location.url, thread_count=thread_count, sync_files=False, **location.storage_options)
    return keep_options(writer, location.storage_options)


def save_planner(*, writers: int) -> SavePlanner:
    """The save planner for a save with ``writers`` writers in all (ranks x threads per rank).

    With more than one, large replicated tensors are split into row chunks so that every writer gets an equal share
    (:mod:`lightning_dcp.engine.save.planning`).
    """
    return BalancedSavePlanner(split=writers > 1)


# ------------------------------------------------------------------------------------------------------ writing
class _ChecksummingWriter:
    """Write DCP records ourselves, checksumming each while it is written; then commit with ``.commit``.

    The records and files are :mod:`lightning_dcp.engine.save.datafiles`'s.
    ``local_files``: write with :func:`~lightning_dcp.engine.save.datafiles.write_local` (a local disk) rather than
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
            # A live write lets tensors go record by record, or swaps in their copies.
            done, swap = getattr(planner, "record_written", None), getattr(planner, "swap", None)
            return write_local(os.fspath(path), job, planner.resolve_data, sync=self.sync_files, done=done, swap=swap)
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
        fqns: dict[str, list[str]] = {}
        chunks: dict[str, list[Any]] = {}
        writers: dict[str, int] = {}
        for rank, rank_results in enumerate(results):
            for fqn, chunk, _, name, offset, length, digest in rank_results:
                entry = files.get(name)
                if entry is None:
                    entry = files[name] = {"size": 0, "records": []}
                    fqns[name], chunks[name] = [], []
                    writers[name] = rank
                entry["records"].append([offset, length, digest])
                fqns[name].append(fqn)
                chunks[name].append(chunk)
                if offset + length > entry["size"]:
                    entry["size"] = offset + length
        self._check_in_place(files, writers)
        metadata_bytes = metadata_pickle(metadata, results)
        self._put(METADATA_FILE, metadata_bytes, atomic=self.local_files)
        marker = encode_commit(
            metadata_bytes=metadata_bytes,
            files=files,
            order=getattr(self, "order", None),
            index=_record_index(metadata, fqns, chunks),
        )
        self._put(COMMIT_FILE, marker, atomic=self.local_files)  # atomic: never seen half written

    def _check_in_place(self, files: dict[str, dict[str, Any]], writers: dict[str, int]) -> None:
        """Refuse to commit unless every data file the ranks reported is in this directory, whole (one listing).

        A rank that wrote elsewhere (a path that names each node's own disk, a rank whose path differed) would
        otherwise leave a commit that vouches for files that are not there.

        Raises:
            CorruptCheckpointError: A data file is missing or shorter than its records (``file`` names it).
        """
        present = self._file_sizes()
        for name, entry in files.items():
            size = present.get(name)
            if size is not None and size >= entry["size"]:
                continue
            found = "is missing" if size is None else f"holds {size} of its {entry['size']} bytes"
            raise CorruptCheckpointError(
                f"Refusing to commit the checkpoint at {os.fspath(self.path)!r}: its data file {name!r}, written by"
                f" rank {writers[name]}, {found} there. Every rank must write into the same directory: use a"
                " `dirpath` on storage all ranks share (not a disk of each node's own), and the same path on every"
                " rank. Nothing was committed; earlier checkpoints are intact.",
                file=name,
            )

    def _file_sizes(self) -> dict[str, int]:
        """``{name: bytes}`` of the files in this writer's directory."""
        if self.local_files:
            with os.scandir(self.path) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file()}
        fs, root = self.fs.fs, os.fspath(self.path).rstrip("/")
        fs.invalidate_cache(root)
        listing = fs.ls(root, detail=True)
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in listing if e["type"] == "file"
        }

    def _put(self, name: str, data: bytes, *, atomic: bool) -> None:
        final = self.fs.concat_path(self.path, name)
        path = self.fs.concat_path(self.path, name + ".tmp") if atomic else final
        with self.fs.create_stream(path, "wb") as f:
            f.write(data)
            if self.sync_files and self.local_files:
                f.flush()
                os.fsync(f.fileno())
        if atomic:
            try:
                self.fs.rename(path, final)
            except OSError as err:  # a mount that cannot rename (FUSE of an object store): written in place
                if err.errno not in CANNOT_RENAME:
                    raise
                self._put(name, data, atomic=False)  # inside the staging directory: no reader sees it half written
                self.fs.rm_file(path)


def compact_result(result: WriteResult) -> tuple:
    """``(fqn, offsets, size, file, offset, length, checksum)`` of one record our writer wrote."""
    info, digest = result.storage_data
    offset = None if result.index.offset is None else tuple(result.index.offset)
    return (result.index.fqn, offset, result.size_in_bytes, info.relative_path, info.offset, info.length, digest)


_METADATA = PlanMemo()  # the ``.metadata`` bytes of the last few plans
_INDEX = PlanMemo()  # the record index of the last few plans


def _record_index(metadata: Metadata, fqns: dict[str, list[str]], chunks: dict[str, list[Any]]) -> dict | None:
    """:func:`~lightning_dcp.engine.format.record_index.encode_index`, remembered per plan and record layout."""
    key = tuple((name, tuple(names), tuple(chunks[name])) for name, names in fqns.items())
    known = _INDEX.get(metadata, key)
    if known is None:
        known = (encode_index(metadata, fqns, chunks),)
        _INDEX.put(metadata, key, known)
    return known[0]


def metadata_pickle(metadata: Metadata, results: list[list[tuple]]) -> bytes:
    """The bytes of ``.metadata``: ``metadata`` with the records' storage locations, pickled as DCP does.

    A training run saves the same layout every time (the same plan, the same record sizes, the same files): then the
    bytes of the previous save of that plan are reused (the last few plans are remembered), because pickling
    thousands of entries takes longer than writing them.
    ``storage_meta`` (the path and a random id of the save, which nothing reads) is left out so that the bytes of
    two saves can be equal; DCP's readers fill it in when they load.
    """
    key = tuple(record[:6] for rank_results in results for record in rank_results)
    known = _METADATA.get(metadata, key)
    if known is not None:
        return known
    storage_data = {
        MetadataIndex(fqn, None if offset is None else torch.Size(offset)): StorageInfo(name, start, length)
        for fqn, offset, _, name, start, length in key
    }
    final = dataclasses.replace(metadata, storage_data=storage_data, storage_meta=None)
    if DCP_METADATA_VERSION is not None:
        final.version = DCP_METADATA_VERSION
    with gc_paused():  # thousands of small objects: collections would run over the whole heap many times
        data = pickle.dumps(final)
    _METADATA.put(metadata, key, data)
    return data


class _LocalWriter(_ChecksummingWriter, FileSystemWriter):
    local_files = True


class _FsspecWriter(_ChecksummingWriter, FsspecWriter):  # DCP's FsspecWriter is a FileSystemWriter too
    local_files = False
