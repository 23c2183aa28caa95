"""Reading records from an object store with concurrent ranged reads and bounded memory.

One ranged read at a time leaves a rank waiting on the network's latency for every request; object stores serve many
requests at once. :class:`RangedReads` turns a rank's read plan into byte ranges of at most :data:`CHUNK` bytes (runs
of small records that lie close together in a file share a range; a large record is split into several), fetches
them with up to :data:`WORKERS` requests in flight (``fs.cat_file(path, start, end)``, any fsspec filesystem) while
at most :data:`WINDOW` bytes are fetched and not yet consumed, and hands them over in file order. A record in
lightning_dcp's layout is copied from the fetched bytes straight into its target tensor and checksummed on the way;
any other record is assembled and decoded by the caller.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from lightning_dcp.engine.storage.fileout import PIECE

__all__ = ["CHUNK", "WINDOW", "WORKERS", "Range", "RangedReads", "StreamedRecord", "address_of", "split"]

CHUNK = PIECE
"""Largest byte range of one request."""
WINDOW = 256 << 20
"""Bytes fetched ahead of the consumer at most (a rank's read buffer, besides the record being assembled)."""
WORKERS = 8
"""Requests in flight at most."""


@dataclasses.dataclass
class Range:
    """A byte range ``[start, end)`` of ``path``: part of a record or of a run of records."""

    path: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Length of the range."""
        return self.end - self.start


class RangedReads:
    """Fetch ranges concurrently, in order, with at most ``window`` bytes ahead of the consumer.

    Args:
        fetch: ``fetch(path, start, end) -> bytes`` (``fs.cat_file``); called from worker threads.
        workers: Requests in flight at most.
        window: Bytes fetched and not yet consumed at most (a single range larger than this is fetched alone).
    """

    def __init__(self, fetch: Callable[[str, int, int], bytes], *, workers: int = WORKERS, window: int = WINDOW):
        self.fetch = fetch
        self.workers = workers
        self.window = window

    def __call__(self, ranges: list[Range]) -> Iterator[tuple[Range, bytes]]:
        """Yield ``(range, bytes)`` for ``ranges`` in their order (fewer bytes than asked: the object ended)."""
        if not ranges:
            return
        pending: collections.deque[tuple[Range, Future]] = collections.deque()
        ahead, submitted = 0, 0
        with ThreadPoolExecutor(
            max_workers=min(self.workers, len(ranges)), thread_name_prefix="lightning_dcp-get"
        ) as pool:
            try:
                for _ in range(len(ranges)):
                    while submitted < len(ranges) and (not pending or ahead + ranges[submitted].nbytes <= self.window):
                        piece = ranges[submitted]
                        pending.append((piece, pool.submit(self.fetch, piece.path, piece.start, piece.end)))
                        ahead += piece.nbytes
                        submitted += 1
                    piece, future = pending.popleft()
                    data = future.result()
                    ahead -= piece.nbytes
                    yield piece, data
            finally:
                for _, future in pending:
                    future.cancel()


def split(path: str, start: int, end: int, *, chunk: int = CHUNK) -> list[Range]:
    """``[start, end)`` of ``path`` as ranges of at most ``chunk`` bytes."""
    return [Range(path, begin, min(begin + chunk, end)) for begin in range(start, end, chunk)] or [
        Range(path, start, end)
    ]


def address_of(data: bytes) -> int:
    """Memory address of a ``bytes`` object's contents (valid while ``data`` is alive)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


class StreamedRecord:
    """One record arriving in ranges: its raw tensor bytes copied to ``address``, the rest kept; all of it hashed.

    Args:
        length: Bytes of the record.
        data_offset: Where the raw bytes start in the record (``None``: keep every byte, the caller decodes them).
        nbytes: Length of the raw bytes.
        address: Where they go (the target tensor's memory).
    """

    def __init__(self, length: int, data_offset: int | None = None, nbytes: int = 0, address: int = 0) -> None:
        self.length = length
        self.data_offset = data_offset
        self.nbytes = nbytes
        self.address = address
        self.position = 0
        self.hasher = xxhash.xxh3_64()
        self.kept = bytearray()  # header and trailer (or the whole record when it is not streamed into a target)

    def add(self, view: memoryview, address: int) -> None:
        """The next bytes of the record (``view``, whose contents start at memory ``address``)."""
        self.hasher.update(view)
        begin, end = self.position, self.position + view.nbytes
        self.position = end
        if self.data_offset is None:
            self.kept += view
            return
        raw_begin, raw_end = self.data_offset, self.data_offset + self.nbytes
        if begin < raw_begin:
            self.kept += view[: min(end, raw_begin) - begin]
        lo, hi = max(begin, raw_begin), min(end, raw_end)
        if lo < hi:
            ctypes.memmove(self.address + lo - raw_begin, address + lo - begin, hi - lo)
        if end > raw_end:
            self.kept += view[max(begin, raw_end) - begin :]
