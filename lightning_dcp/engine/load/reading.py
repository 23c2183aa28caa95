"""Reading tensor records straight into their targets, checksumming them on the way.

A record written by :mod:`lightning_dcp.engine.save.datafiles` is ``prefix + raw bytes + suffix`` where prefix and
suffix depend only on the dtype and shape the metadata gives for it
(:func:`~lightning_dcp.engine.format.records.tensor_record`). When a record's prefix is exactly that, its raw bytes are
read into the target tensor in pieces that are checksummed as they arrive: no ``torch.load``, no intermediate ``bytes``.
Local files are read through the page cache with large calls straight into the target tensors: ranks that restore the
same replicated files (DDP) share the cached pages, so each file comes from the disk once (the readers go through the
files in the same order). With ``direct=True`` the block-aligned middle of a large record is read with ``O_DIRECT``
instead (into the target itself when its address has the same alignment as the bytes' file offset, else through one
reused aligned buffer): the page cache is neither filled nor copied from, which suits files that one rank alone reads. A
target that is not the whole chunk (a reshard) or not contiguous gets a scratch tensor of the chunk's shape, then the
part it needs. Records not in that layout (``torch.save`` records of earlier checkpoints, other writers) are left to the
caller.

Both restores (the record index's, :mod:`~lightning_dcp.engine.load.index_load`, and DCP's storage reader,
:mod:`~lightning_dcp.engine.load.dcp_reader` with its shared reads) read through this module: :func:`runs` groups a
file's records into reads, :class:`Source` reads them, :func:`read_raw` lands a large one, and a record that fails its
checks is named by :func:`corrupt_record` or :func:`undecodable_record`.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any

import torch
import xxhash

from lightning_dcp.engine.format.marker import checksum
from lightning_dcp.engine.format.records import RecordLayout, raw_bytes
from lightning_dcp.engine.storage.fileout import ALIGN, DIRECT_MIN, PIECE, borrow_buffer, return_buffer
from lightning_dcp.errors import CorruptCheckpointError, describe_load_error

__all__ = [
    "GAP",
    "SMALL_RECORD",
    "Landing",
    "Source",
    "corrupt_record",
    "land_run",
    "read_raw",
    "runs",
    "undecodable_record",
]

SMALL_RECORD = 1 << 20
"""Records up to this size are read with one call and copied (fewer calls beat one copy fewer)."""
GAP = 64 << 10
"""Records this close together are read in one call with the ones before them (the bytes between are skipped)."""

Run = tuple[int, int, int]
"""``(i, j, end)`` of :func:`runs`."""


class Source:
    """Positional reads from an open data file: ``preadv`` on a local descriptor, ``seek`` + ``readinto`` otherwise.

    Args:
        stream: The open binary file (from the storage reader's ``create_stream``); stays owned by the caller.
        direct: Read the middle of large records with ``O_DIRECT`` (local files whose filesystem allows it).
    """

    def __init__(self, stream: IO[bytes], *, direct: bool = False) -> None:
        self.stream = stream
        try:
            self.fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no descriptor (fsspec)
            self.fd = None
        self._direct: int | None = None
        self._bounce: mmap.mmap | None = None
        self._span: tuple | None = None
        if self.fd is not None and hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
            except OSError:
                pass
        if (
            direct
            and self.fd is not None
            and hasattr(os, "O_DIRECT")
            and isinstance(getattr(stream, "name", None), str)
        ):
            try:
                self._direct = os.open(stream.name, os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # the filesystem refuses O_DIRECT: ordinary reads
                self._direct = None

    def close(self) -> None:
        """Release the direct-I/O descriptor and buffers (the stream stays open)."""
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None
        if self._bounce is not None:
            self._bounce.close()
            self._bounce = None
        if self._span is not None:
            return_buffer(self._span)
            self._span = None

    def span_buffer(self) -> memoryview:
        """The buffer :meth:`read_span` reads into (:data:`~lightning_dcp.engine.storage.fileout.PIECE` bytes).

        For the caller to fill otherwise; valid until :meth:`close`.
        """
        if self._span is None:
            self._span = borrow_buffer()
        return self._span[1]

    def read_span(self, offset: int, length: int) -> tuple[memoryview, int]:
        """``length`` (at most :data:`~lightning_dcp.engine.storage.fileout.PIECE`) bytes from ``offset`` in one read.

        Returns ``(view, address)``: the bytes read (fewer at the end of the file) in a buffer of this source, and
        the buffer's memory address; valid until the next call.
        """
        if self._span is None:
            self._span = borrow_buffer()
        _, view, address = self._span
        return view[: self.read_into(view[:length], offset)], address

    def read_into(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""
        done = 0
        while done < view.nbytes:
            if self.fd is not None:
                n = os.preadv(self.fd, [view[done:]], offset + done)
            else:
                self.stream.seek(offset + done)
                n = _readinto(self.stream, view[done:])
            if not n:
                break
            done += n
        return done

    def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end of the file)."""
        buffer = bytearray(length)
        return bytes(memoryview(buffer)[: self.read_into(memoryview(buffer), offset)])

    def read_hashed(self, view: memoryview, address: int, offset: int, hasher: xxhash.xxh3_64) -> bool:
        """Fill ``view`` (its memory starts at ``address``) from ``offset``, hashing every byte in order.

        Returns False when the file ends first.
        """
        done = 0
        if self._direct is not None and view.nbytes >= DIRECT_MIN:
            head = -offset % ALIGN
            body = (view.nbytes - head) // ALIGN * ALIGN
            if not self._plain(view[:head], offset, hasher):
                return False
            in_place = (address + head) % ALIGN == 0
            for begin in range(head, head + body, PIECE):
                piece = view[begin : min(begin + PIECE, head + body)]
                landing = piece if in_place else self._bounce_view(piece.nbytes)
                try:
                    n = _pread_full(self._direct, landing, offset + begin)
                except OSError:  # direct reads refused after all: finish with ordinary ones
                    self.close()
                    return self._plain(view[begin:], offset + begin, hasher)
                if n != piece.nbytes:
                    return False
                hasher.update(landing)
                if not in_place:
                    piece[:] = landing
            done = head + body
        return self._plain(view[done:], offset + done, hasher)

    def _plain(self, view: memoryview, offset: int, hasher: xxhash.xxh3_64) -> bool:
        for begin in range(0, view.nbytes, PIECE):
            piece = view[begin : begin + PIECE]
            if self.read_into(piece, offset + begin) != piece.nbytes:
                return False
            hasher.update(piece)
        return True

    def _bounce_view(self, nbytes: int) -> memoryview:
        if self._bounce is None:
            self._bounce = mmap.mmap(-1, PIECE)  # page-aligned
        return memoryview(self._bounce)[:nbytes]


def read_raw(source: Source, offset: int, length: int, layout: RecordLayout, into: torch.Tensor) -> int | None:
    """Read the record at ``offset`` (``length`` bytes, laid out as ``layout``) into the contiguous tensor ``into``.

    Returns:
        The record's xxHash3-64, or ``None`` when its bytes around the raw data are not ``layout``'s (or it ends
        early): then nothing can be concluded from ``into`` and the caller reads the record its general way.
    """
    if length != layout.length:
        return None
    view = raw_bytes(into)
    hasher = xxhash.xxh3_64()
    if length <= SMALL_RECORD:
        record = source.read(offset, length)
        end = layout.data_offset + layout.nbytes
        if len(record) != length or record[: layout.data_offset] != layout.prefix or record[end:] != layout.suffix:
            return None
        hasher.update(record)
        view[:] = memoryview(record)[layout.data_offset : end]
        return hasher.intdigest()
    if source.read(offset, layout.data_offset) != layout.prefix:
        return None
    hasher.update(layout.prefix)
    start = offset + layout.data_offset
    if not source.read_hashed(view, into.data_ptr(), start, hasher):
        return None
    if source.read(start + layout.nbytes, len(layout.suffix)) != layout.suffix:
        return None
    hasher.update(layout.suffix)
    return hasher.intdigest()


def runs(offsets: Sequence[int], lengths: Sequence[int], *, span: int, most: int = sys.maxsize) -> Iterator[Run]:
    """Group the records of one data file into reads: the one answer for both restores (index and DCP reader).

    Args:
        offsets: Each record's offset in the file (bytes), ascending.
        lengths: Each record's length (bytes).
        span: The most bytes one read of small records covers.
        most: The most records one read covers (``preadv`` takes at most ``IOV_MAX`` buffers).

    Yields:
        ``(i, j, end)``: records ``i:j`` read with one call from ``offsets[i]`` to byte ``end``. A record over
        :data:`SMALL_RECORD` is read alone (``j == i + 1``: its caller reads it into its target in pieces); smaller
        ones join the read before them while the gap before each is at most :data:`GAP` bytes, the read stays within
        ``span`` bytes and holds at most ``most`` records.
    """
    count, i = len(offsets), 0
    while i < count:
        offset, length = offsets[i], lengths[i]
        if length > SMALL_RECORD:
            yield i, i + 1, offset + length
            i += 1
            continue
        j, end, limit = i + 1, offset + length, min(count, i + most)
        while j < limit:
            start_j, length_j = offsets[j], lengths[j]
            if length_j > SMALL_RECORD or start_j - end > GAP or start_j + length_j - offset > span:
                break
            end = max(end, start_j + length_j)
            j += 1
        yield i, j, end
        i = j


Landing = tuple[int, int, "int | None", "tuple | None", int, Any, Any]
"""A record of a run as :func:`land_run` takes it: ``(offset, length, expected, frame, into, a, b)``: its place in the
file (bytes), the checksum ``.commit`` records for it (``None``: unchecked), the
:func:`~lightning_dcp.engine.format.records.record_frame` of its target (``None``: no target in our layout), the
memory address of the target's bytes, and two fields of the reader's own that only its callbacks read."""


def land_run(
    span: memoryview,
    address: int,
    start: int,
    records: Iterable[Landing],
    *,
    failed: Callable[[Landing, memoryview], None],
    other: Callable[[Landing, memoryview], None],
) -> None:
    """Check and land a run of records read with one call: the landing loop of both restores.

    ``span`` holds the file's bytes from offset ``start`` and lies at memory ``address``. Each record
    (:data:`Landing`) is checked first: a short one or one whose checksum is not ``expected`` goes to ``failed``, which
    raises (naming the file). A record framed as its target's (``frame`` matches its length and framing bytes) has its
    tensor bytes copied to ``into``: one ``memmove``, no decoding. Every other record goes to ``other``: a bytes
    entry, a record in another writer's framing, a target the reader resolves itself.

    Used by :mod:`~lightning_dcp.engine.load.index_load` (records from the index in ``.commit``) and the DCP reader
    (:mod:`~lightning_dcp.engine.load.dcp_reader`, records from ``.metadata``). One loop with nothing looked up per
    record: thousands of small records cost microseconds each.
    """
    digest, memmove = checksum, ctypes.memmove
    for entry in records:
        offset, length, expected, frame, into, _, _ = entry
        rel = offset - start
        record = span[rel : rel + length]
        if record.nbytes != length or (expected is not None and digest(record) != expected):
            failed(entry, record)
            continue
        if frame is not None:
            full, begin, end, prefix, suffix = frame
            if length == full and record[:begin].tobytes() == prefix and record[end:].tobytes() == suffix:
                if end > begin:
                    memmove(into, address + rel + begin, end - begin)
                continue
        other(entry, record)


def corrupt_record(where: str, name: str, fqn: str) -> CorruptCheckpointError:
    """The error of a record whose bytes do not match the checksum ``.commit`` recorded (``where``: the file's path)."""
    return CorruptCheckpointError(
        f"{where} is corrupt: record {fqn!r} does not match the checksum recorded at save. Restore the file or resume"
        " from another checkpoint.",
        file=name,
    )


def undecodable_record(where: str, name: str, fqn: str, err: Exception, *, described_by: str) -> CorruptCheckpointError:
    """The error of a record that does not decode as ``described_by`` (the metadata, the index in ``.commit``) says."""
    return CorruptCheckpointError(
        f"{where}: record {fqn!r} cannot be read as {described_by} describes it ({describe_load_error(err)}).",
        file=name,
    )


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done


def _readinto(stream: IO[bytes], view: memoryview) -> int:
    readinto = getattr(stream, "readinto", None)
    if readinto is not None:
        return readinto(view) or 0
    data = stream.read(view.nbytes)
    view[: len(data)] = data
    return len(data)
