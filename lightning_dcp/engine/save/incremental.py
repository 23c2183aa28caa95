"""Incremental saves: a large record whose bytes equal the previous checkpoint's is hard-linked, not written again.

With ``incremental=True`` every tensor record of at least :data:`MIN_OWN_BYTES` gets a data file of its own, named
from the record alone (FQN, chunk offsets and sizes: :func:`own_file_name`), so the same record lands in a file of
the same name at every save; smaller records and blobs share the usual ``__{rank}_{n}.distcp`` files. Before writing
such a file the writer looks for the same record in the *previous* checkpoint: the newest committed checkpoint in the
same directory, chosen by rank 0 (:meth:`Incremental.previous`). When that checkpoint's file holds only this record
and its bytes equal the live record byte for byte (an exact ``memcmp`` against the mapped file, never a checksum
alone), the file is hard-linked into the new checkpoint and the previous offset, length and checksum are reused
(readers verify that checksum as for any record).

Each checkpoint stays complete on its own: a hard link is a second name of the same immutable file, so deleting any
other checkpoint (top-k pruning, ``save_last`` replacement, ``rm -r``) leaves it whole, and stock ``dcp.load`` reads
it as any DCP checkpoint. Files are never written in place: the writer unlinks a name before it creates a file there,
so a shared file is never truncated.

Comparing costs a read of the previous file, except for a record whose first 64 KiB no longer hash to what this
process wrote or linked there at its last save: that one has changed, and is written without any read (a checksum
only ever proves a change; "unchanged" is always decided by the byte comparison). A record found changed is not
compared again for the next ``probe_every - 1`` saves: it is written directly, into the shared files (as a full
save writes it) except at the save before its next comparison. A run where everything changes thus writes as a
full save does at most saves, and its own files (at about the same cost here) at two saves in ``probe_every``.

Object stores, and local saves whose link fails (another filesystem: ``EXDEV``), write every file as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import xxhash
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.format.marker import DATA_SUFFIX
from lightning_dcp.engine.format.records import raw_bytes
from lightning_dcp.engine.save.datafiles import FileJob, RecordResult, item_nbytes, make_record
from lightning_dcp.engine.storage.location import Location, read_commit
from lightning_dcp.errors import CheckpointError

__all__ = ["MIN_OWN_BYTES", "OWN_PREFIX", "PROBE_EVERY", "Incremental", "SaveStats", "own_file_name"]

MIN_OWN_BYTES = 1 << 20
"""Tensor records of at least this many bytes get their own data file (and may be linked instead of written)."""
PROBE_EVERY = 8
"""A record found changed is compared again only at every this many saves (written directly in between)."""
OWN_PREFIX = "__r_"
"""Name prefix of a record's own data file: ``__r_<24 hex digits>.distcp``."""

_Key = tuple[str, tuple[int, ...]]
_FIRST_PIECE = 64 << 10  # a changed tensor usually differs here: one small read decides

_libc = ctypes.CDLL(None)
_memcmp = _libc.memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def own_file_name(item: WriteItem) -> str:
    """The stable data file name of ``item``'s record: ``__r_<hex>.distcp``, from its FQN, offsets and sizes.

    A plain file name (no separator); the same record (same key, same chunk) gets the same name at every save, and
    no two records of one checkpoint share a name (DCP keys are unique per ``(fqn, offsets)``).
    """
    chunk = item.tensor_data.chunk if item.tensor_data is not None else None
    sizes = tuple(chunk.sizes) if chunk is not None else ()
    text = f"{item.index.fqn}\0{_offsets(item)}\0{sizes}"
    return f"{OWN_PREFIX}{hashlib.blake2b(text.encode(), digest_size=12).hexdigest()}{DATA_SUFFIX}"


@dataclasses.dataclass
class SaveStats:
    """What the last incremental save of this process did with the records large enough for a file of their own.

    Attributes:
        linked_files: Files hard-linked from the previous checkpoint (not written).
        linked_bytes: Bytes of the linked records.
        written_files: Own files written (new or changed records, or a link that failed).
        written_bytes: Tensor bytes of the written own files.
        compared_bytes: Bytes compared with the previous checkpoint (read from it); a comparison stops at the first
            differing 1 MiB piece.
        skipped: Records written without a comparison because they changed at an earlier probe.
        ruled_out: Records found changed from their first 64 KiB alone (their checksum differs from the one taken
            when this process wrote or linked the previous file): no read of the previous checkpoint.
    """

    linked_files: int = 0
    linked_bytes: int = 0
    written_files: int = 0
    written_bytes: int = 0
    compared_bytes: int = 0
    skipped: int = 0
    ruled_out: int = 0


class Incremental:
    """The incremental state of one process across saves (held by a ``Checkpointer`` with ``incremental=True``).

    Args:
        min_bytes: Tensor records of at least this many bytes get their own file and may be linked.
        probe_every: A record found changed is compared again only every this many saves (>= 1; 1 compares always).

    Raises:
        ValueError: ``min_bytes`` or ``probe_every`` is not a positive integer.
    """

    def __init__(self, *, min_bytes: int = MIN_OWN_BYTES, probe_every: int = PROBE_EVERY) -> None:
        for name, value in (("min_bytes", min_bytes), ("probe_every", probe_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        self.min_bytes = min_bytes
        self.probe_every = probe_every
        self.stats = SaveStats()
        """This process's :class:`SaveStats` of the last save."""
        self._skip: dict[_Key, int] = {}  # saves left before a changed record is compared again
        self._heads: dict[_Key, int] = {}  # checksums of the first bytes of the own files of the last save
        self._lock = threading.Lock()

    def previous(self, location: Location) -> str | None:
        """The checkpoint a save to ``location`` links from: the newest committed one beside it (local only).

        Rank 0 only: the caller broadcasts the result. ``None`` for object stores or when there is none.
        """
        if not location.local:
            return None
        try:
            found = committed_checkpoints(location.parent())
        except (OSError, CheckpointError):
            return None
        return found[0][1].path if found else None

    def attach(self, writer: Any, *, previous: str | None, local: bool) -> None:
        """Make ``writer`` (a lightning_dcp storage writer) save incrementally against ``previous``.

        Every rank calls this with the same ``previous`` (rank 0's :meth:`previous`). Own files are used on any
        storage; links only when the save is ``local``.
        """
        self.stats = SaveStats()
        save = _Save(self, previous if local else None, local=local, heads_before=self._heads)
        self._heads = save.heads
        writer.incremental = save


class _Save:
    """One save's view: where each large record goes, and whether its previous file can be linked."""

    def __init__(self, owner: Incremental, previous: str | None, *, local: bool, heads_before: dict) -> None:
        self.owner = owner
        self.previous = previous
        self.local = local
        self.heads_before = heads_before
        self.heads: dict[_Key, int] = {}
        self._records: dict[_Key, tuple[str, int, int, int]] | None = None  # key -> (file, offset, length, digest)
        self._compare: set[_Key] = set()  # records to compare at this save
        self._lock = threading.Lock()

    def own_file(self, item: WriteItem) -> str | None:
        """The own file name of ``item``'s record, or ``None`` when it goes to a shared file.

        Blobs and small tensors share files. So does a large record found changed at its last comparison, until the
        save before its next comparison (then it gets its own file again, which the comparison needs): a run where
        everything changes writes the usual few files at most saves. Called once per record and save.
        """
        if item.type == WriteItemType.BYTE_IO or item_nbytes(item) < self.owner.min_bytes:
            return None
        key = (item.index.fqn, _offsets(item))
        with self.owner._lock:
            left = self.owner._skip.get(key, 0)
            if left == 0:
                self._compare.add(key)
                return own_file_name(item)
            self.owner._skip[key] = left - 1
            self.owner.stats.skipped += 1
        return own_file_name(item) if left == 1 else None

    def reuse(self, path: str, job: FileJob, resolve: Callable[[WriteItem], Any]) -> list[RecordResult] | None:
        """Link ``job``'s file from the previous checkpoint when its record is unchanged, else prepare ``path``.

        Runs in a writer thread. Returns the record's result (previous offset, length and checksum) when linked;
        ``None`` when the caller must write the file (then nothing exists at ``path``).
        """
        owner = self.owner
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # never write through a name that may share its file with another checkpoint
        if not self.local or len(job.items) != 1 or not job.name.startswith(OWN_PREFIX):
            return self._written(job)
        item = job.items[0]
        key = (item.index.fqn, _offsets(item))
        data = resolve(item)
        head = _head_digest(data)
        with owner._lock:
            self.heads[key] = head
        if self.previous is None or key not in self._compare:
            return self._written(job)
        before = self.heads_before.get(key)
        if before is not None and before != head:
            # Its first bytes differ from what this process put in that file last time: changed, no read needed.
            # (A false "changed" would only cost a write; "unchanged" is always decided by a full comparison.)
            with owner._lock:
                owner._skip[key] = owner.probe_every - 1
                owner.stats.ruled_out += 1
            return self._written(job)
        found = self._previous_records().get(key)
        if found is None or found[0] != job.name:
            return self._written(job)
        linked = self._link_if_same(path, item, data, found)
        with owner._lock:
            if linked is None:
                owner._skip[key] = owner.probe_every - 1
            else:
                owner._skip.pop(key, None)
                owner.stats.linked_files += 1
                owner.stats.linked_bytes += found[2]
        return linked if linked is not None else self._written(job)

    def _written(self, job: FileJob) -> None:
        with self.owner._lock:
            self.owner.stats.written_files += 1
            self.owner.stats.written_bytes += sum(item_nbytes(i) for i in job.items)

    def _link_if_same(
        self, path: str, item: WriteItem, data: Any, found: tuple[str, int, int, int]
    ) -> list[RecordResult] | None:
        name, offset, length, digest = found
        source = os.path.join(self.previous, name)
        record = make_record(item, data)
        if sum(view.nbytes for view, _ in record.parts) != length:
            return None
        try:
            fd = os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if info.st_size < offset + length:
                return None
            same, compared = _same_bytes(fd, info.st_size, offset, record)
            with self.owner._lock:
                self.owner.stats.compared_bytes += compared
            if not same:
                return None
            try:
                os.link(source, path)
            except OSError:
                return None  # another filesystem (EXDEV), too many links, source gone: write it
            linked = os.stat(path)
            if (linked.st_ino, linked.st_dev) != (info.st_ino, info.st_dev):
                os.unlink(path)  # the source name was replaced meanwhile: not the bytes compared
                return None
        finally:
            os.close(fd)
        return [RecordResult(item, name, offset, length, digest)]

    def _previous_records(self) -> dict[_Key, tuple[str, int, int, int]]:
        """``(fqn, offsets) -> (file, offset, length, checksum)`` of the previous checkpoint's single-record files."""
        with self._lock:
            if self._records is None:
                self._records = _single_records(self.previous)
            return self._records


def _single_records(previous: str) -> dict[_Key, tuple[str, int, int, int]]:
    location = Location(previous)
    try:
        marker = read_commit(location)
        metadata = read_metadata(location)
    except (OSError, CheckpointError):
        return {}
    if marker is None:
        return {}
    single = {
        name: entry["records"][0]
        for name, entry in marker["files"].items()
        if name.startswith(OWN_PREFIX) and len(entry["records"]) == 1
    }
    records = {}
    for index, info in metadata.storage_data.items():
        record = single.get(info.relative_path)
        if record is not None and record[0] == info.offset and record[1] == info.length:
            offsets = tuple(index.offset) if index.offset is not None else ()
            records[(index.fqn, offsets)] = (info.relative_path, info.offset, info.length, record[2])
    return records


def _same_bytes(fd: int, size: int, offset: int, record: Any) -> tuple[bool, int]:
    """``(equal, bytes compared)``: whether ``record``'s bytes equal the file's from ``offset`` on.

    The first :data:`_FIRST_PIECE` bytes are read and compared first (a changed tensor usually differs there, and
    then costs one small read); only then is the file mapped with its pages populated at once and compared whole
    with ``memcmp`` (no per-page faults, GIL released). A file that cannot be mapped counts as different.
    """
    length = sum(view.nbytes for view, _ in record.parts)
    first = os.pread(fd, min(_FIRST_PIECE, length), offset)
    expected, need = [], len(first)
    for view, _ in record.parts:
        if need <= 0:
            break
        expected.append(bytes(view[:need]))
        need -= view.nbytes
    if first != b"".join(expected):
        return False, len(first)
    address = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), fd, 0)
    if address in (None, _MAP_FAILED):
        return False, len(first)
    try:
        position = address + offset
        for view, data in record.parts:
            if data is not None:
                same = _memcmp(position, data, view.nbytes) == 0
            else:
                same = bytes(view) == ctypes.string_at(position, view.nbytes)
            if not same:
                return False, length
            position += view.nbytes
        return True, length
    finally:
        _munmap(address, size)


def _head_digest(data: Any) -> int:
    """Checksum of the first :data:`_FIRST_PIECE` bytes of a tensor's elements (copies only those off a GPU)."""
    tensor = data.detach()
    flat = (tensor if tensor.is_contiguous() else tensor.contiguous()).reshape(-1)
    head = flat[: max(1, _FIRST_PIECE // max(1, flat.element_size()))]
    if head.device.type != "cpu":
        head = head.cpu()
    return xxhash.xxh3_64_intdigest(raw_bytes(head))


def _offsets(item: WriteItem) -> tuple[int, ...]:
    return tuple(item.index.offset) if item.index.offset is not None else ()
