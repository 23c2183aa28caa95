"""Sequential outputs for data files: direct I/O from tensor memory, buffered ``pwritev``, or an fsspec stream.

Every output takes the file's bytes in order (``write``), knows its ``position`` and may insert a gap of zeros
between records (``align``) so that a large tensor's bytes land on a file offset with the same alignment as their
address in memory. That is what lets :class:`DirectOut` hand them to the disk straight from the tensor (``O_DIRECT``:
no copy into the page cache, so no CPU spent on it, no other process's cached pages evicted, and an ``fsync`` with
nothing left to flush). Small pieces (record headers, small tensors, the unaligned head and tail of a large one) go
through one page-aligned bounce buffer written with the same descriptor. Where ``O_DIRECT`` is refused (tmpfs,
some network filesystems) the file is written by :class:`BufferedOut` instead, which gathers pieces into one
``pwritev`` per :data:`PIECE` bytes and asks the kernel to start write-back every :data:`KICK` bytes.

Small records are not handed over piece by piece: :meth:`DirectOut.frame` gives the writer a region of the output's own
buffer at the current position, which the writer fills in place (headers, tensor bytes) and hashes there; the
output writes it with what follows. A framed region is valid until the next call on the output.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

__all__ = [
    "ALIGN",
    "DIRECT_MIN",
    "FRAME_MAX",
    "KICK",
    "PIECE",
    "BufferedOut",
    "DirectOut",
    "StreamOut",
    "borrow_buffer",
    "open_local",
    "return_buffer",
]

ALIGN = 4096
"""Alignment of direct I/O: file offsets, lengths and memory addresses (covers logical blocks up to 4 KiB)."""
PIECE = 16 << 20
"""Bytes per write call (and per checksum update: a piece is hashed right before it is written)."""
DIRECT_MIN = 256 << 10
"""Tensors at least this large are written from their own memory with direct I/O; smaller ones are copied."""
KICK = 64 << 20
"""Buffered output: bytes after which the kernel is asked to start writing back (when the file is synced)."""
FRAME_MAX = PIECE - ALIGN
"""Largest region :meth:`DirectOut.frame` (and the others) hand out at once."""
_MAX_IOV = 512


_POOL: list[tuple[mmap.mmap, memoryview, int]] = []
_POOL_LOCK = threading.Lock()
_POOL_KEEP = 4


def borrow_buffer() -> tuple[mmap.mmap, memoryview, int]:
    """A page-aligned anonymous buffer of :data:`PIECE` bytes: ``(mmap, view, address)``.

    Give it back with :func:`return_buffer`: buffers are reused, because the first write to fresh pages costs a page
    fault each (3-4x the copy itself).
    """
    with _POOL_LOCK:
        if _POOL:
            return _POOL.pop()
    buffer = mmap.mmap(-1, PIECE)
    return buffer, memoryview(buffer), ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def return_buffer(buffer: tuple[mmap.mmap, memoryview, int]) -> None:
    """Give a buffer from :func:`borrow_buffer` back (kept for reuse, or unmapped)."""
    with _POOL_LOCK:
        if len(_POOL) < _POOL_KEEP:
            _POOL.append(buffer)
            return
    buffer[1].release()
    buffer[0].close()


def open_local(path: str, *, sync: bool) -> DirectOut | BufferedOut:
    """A new local file at ``path``: direct I/O when ``sync`` and the filesystem allows it, buffered otherwise.

    Without ``sync`` the caller prefers returning early to durability: the page cache absorbs the writes.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if sync and hasattr(os, "O_DIRECT"):
        try:
            return DirectOut(os.open(path, flags | os.O_DIRECT, 0o644))
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return BufferedOut(os.open(path, flags, 0o644), sync=sync)


class BufferedOut:
    """Buffered writes through the page cache: pieces gathered into ``pwritev`` calls of about :data:`PIECE`."""

    def __init__(self, fd: int, *, sync: bool, position: int = 0) -> None:
        self.fd, self.sync = fd, sync
        self.position = position  # bytes handed to write(), gaps included
        self._written = position  # bytes handed to the kernel
        self._kicked = position
        self._pending: list[memoryview] = []
        self._pending_bytes = 0
        self._keep: list[Any] = []
        self._frames: tuple[mmap.mmap, memoryview, int] | None = None
        self._frame_start = 0  # framed bytes [start, fill) of the frame buffer not queued yet
        self._frame_fill = 0

    def align(self, address: int, data_offset: int) -> None:
        """No gaps in buffered files."""

    def write(self, piece: memoryview, keep: Any = None, address: int | None = None) -> None:
        """Append ``piece`` (``keep`` is held until the bytes are written: what owns the memory)."""
        self._queue_frames()
        self._pending.append(piece)
        self._keep.append(keep)
        self._pending_bytes += piece.nbytes
        self.position += piece.nbytes
        if self._pending_bytes >= PIECE or len(self._pending) >= _MAX_IOV:
            self._flush()

    def settle(self) -> None:
        """Hand every pending piece to the kernel: no memory passed to :meth:`write` is referenced afterwards."""
        if self._pending:
            self._flush()

    def frame(self, nbytes: int) -> tuple[memoryview, int, int]:
        """``(view, start, address)``: ``view[start:start + nbytes]`` (at ``address``) are the next bytes of the file.

        The caller fills them before its next call on this output.
        """
        if self._frames is None:
            self._frames = borrow_buffer()
        elif self._frame_fill + nbytes > PIECE:
            self._flush()  # writes the framed bytes: the buffer can be reused
            self._frame_start = self._frame_fill = 0
        start = self._frame_fill
        self._frame_fill += nbytes
        self.position += nbytes
        return self._frames[1], start, self._frames[2] + start

    def close(self) -> None:
        """Write what is pending, ``fsync`` when synced, close the descriptor."""
        try:
            self._flush()
            if self.sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            if self._frames is not None:
                return_buffer(self._frames)
                self._frames = None

    def _queue_frames(self) -> None:
        if self._frame_fill > self._frame_start:
            view = self._frames[1][self._frame_start : self._frame_fill]
            self._pending.append(view)
            self._keep.append(None)
            self._pending_bytes += view.nbytes
            self._frame_start = self._frame_fill

    def _flush(self) -> None:
        self._queue_frames()
        views, total = self._pending, self._pending_bytes
        self._pending, self._pending_bytes = [], 0
        while total:
            n = os.pwritev(self.fd, views, self._written)
            self._written += n
            total -= n
            if total:  # a short write: continue with the rest
                views = _advance(views, n)
        self._keep.clear()
        if self._frames is not None and self._frame_start == self._frame_fill:
            self._frame_start = self._frame_fill = 0  # everything framed is written
        if self.sync and self._written - self._kicked >= KICK:
            _start_writeback(self.fd, self._kicked, self._written - self._kicked)
            self._kicked = self._written


class DirectOut:
    """``O_DIRECT`` writes: aligned spans of large pieces from their own memory, everything else via a bounce buffer.

    The bounce buffer always starts at an aligned file offset; when full, or when a piece can go direct, its whole
    blocks are written and the unaligned rest (under one block) moves to the start of the other bounce buffer: two
    alternate, one being written by a helper thread while the caller fills the other, so that framing and hashing
    overlap the disk. The file is padded to a whole block by its last write and truncated to its real length on
    :meth:`close`. Should the filesystem refuse an aligned direct write (``EINVAL``), ``O_DIRECT`` is switched off for
    the rest of the file and the same writes go through the page cache.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.position = 0
        self._buffers = [borrow_buffer()]
        self._current = 0
        self._bounce, self._view, self._address = self._buffers[0]
        self._base = 0  # file offset of the bounce buffer's first byte (aligned)
        self._fill = 0
        self._writer: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None  # the other buffer's write

    def align(self, address: int, data_offset: int) -> None:
        """Insert zeros so that the bytes at ``position + data_offset`` land at ``address`` modulo :data:`ALIGN`."""
        gap = (address - self.position - data_offset) % ALIGN
        if gap:
            self._copy(memoryview(bytes(gap)))

    def write(self, piece: memoryview, keep: Any = None, address: int | None = None) -> None:
        """Append ``piece``; with its memory ``address``, its aligned middle goes straight to the disk."""
        if address is not None and piece.nbytes >= DIRECT_MIN:
            head = (-self.position) % ALIGN
            if (address + head) % ALIGN == 0:
                body = (piece.nbytes - head) // ALIGN * ALIGN
                self._copy(piece[:head])
                self._drain()  # the position is aligned: the bounce buffer is written whole
                for start in range(head, head + body, PIECE):
                    chunk = piece[start : min(start + PIECE, head + body)]
                    self._pwrite(chunk, self._base)
                    self._base += chunk.nbytes
                    self.position += chunk.nbytes
                piece = piece[head + body :]
        self._copy(piece)

    def settle(self) -> None:
        """Nothing to do: :meth:`write` returns once a piece is written or copied into the bounce buffer."""

    def frame(self, nbytes: int) -> tuple[memoryview, int, int]:
        """``(view, start, address)``: ``view[start:start + nbytes]`` (at ``address``) are the next bytes of the file.

        A region of the bounce buffer (at most :data:`FRAME_MAX` bytes); the caller fills it before its next call.
        """
        if self._fill + nbytes > PIECE:
            self._drain()
        start = self._fill
        self._fill += nbytes
        self.position += nbytes
        return self._view, start, self._address + start

    def close(self) -> None:
        """Write the last partial block, trim the file to its length, ``fsync`` and close."""
        try:
            self._drain(final=True)
            self._wait()
            os.ftruncate(self.fd, self.position)
            os.fsync(self.fd)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            os.close(self.fd)
            for buffer in self._buffers:
                return_buffer(buffer)
            self._buffers = []

    def _copy(self, piece: memoryview) -> None:
        while piece.nbytes:
            n = min(piece.nbytes, PIECE - self._fill)
            self._view[self._fill : self._fill + n] = piece[:n]
            self._fill += n
            self.position += n
            piece = piece[n:]
            if self._fill == PIECE:
                self._drain()

    def _drain(self, *, final: bool = False) -> None:
        """Write the bounce buffer's whole blocks and move the rest to its start (``final``: zero-padded, all)."""
        if self._fill == 0:
            return
        length = self._fill
        if final:
            pad = -length % ALIGN
            self._view[length : length + pad] = bytes(pad)
            length += pad
        else:
            length -= length % ALIGN
        if not length:
            return
        rest = max(self._fill - length, 0)
        self._wait()  # the other buffer is free again
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_dcp-write")
            self._buffers.append(borrow_buffer())
        self._inflight = self._writer.submit(self._pwrite, self._view[:length], self._base)
        self._current = 1 - self._current
        self._bounce, view, self._address = self._buffers[self._current]
        if rest:
            view[:rest] = self._view[length : self._fill]
        self._view = view
        self._base += self._fill - rest
        self._fill = rest

    def _wait(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()  # raises the write's error

    def _pwrite(self, data: memoryview, offset: int) -> None:
        while data.nbytes:
            try:
                n = os.pwrite(self.fd, data, offset)
            except OSError as err:
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                if err.errno != errno.EINVAL or not flags & os.O_DIRECT:
                    raise
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)  # refused: buffered from here on
                continue
            data, offset = data[n:], offset + n


class StreamOut:
    """Writes to an open binary stream (an fsspec file): no gaps, pieces passed as they come."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.position = 0
        self._frames: tuple[mmap.mmap, memoryview, int] | None = None
        self._frame_fill = 0

    def align(self, address: int, data_offset: int) -> None:
        """No gaps in streams."""

    def write(self, piece: memoryview, keep: Any = None, address: int | None = None) -> None:
        """Append ``piece``."""
        self._write_frames()
        self._put(piece)
        self.position += piece.nbytes

    def frame(self, nbytes: int) -> tuple[memoryview, int, int]:
        """``(view, start, address)``: the next ``nbytes`` of the stream, filled by the caller before its next call."""
        if self._frames is None:
            self._frames = borrow_buffer()
        elif self._frame_fill + nbytes > PIECE:
            self._write_frames()
        start = self._frame_fill
        self._frame_fill += nbytes
        self.position += nbytes
        return self._frames[1], start, self._frames[2] + start

    def settle(self) -> None:
        """Nothing to do: the stream takes (copies or writes) each piece in :meth:`write`."""

    def close(self) -> None:
        """Write what was framed; the stream's owner closes the stream."""
        self._write_frames()
        if self._frames is not None:
            return_buffer(self._frames)
            self._frames = None

    def _write_frames(self) -> None:
        if self._frame_fill:
            self._put(self._frames[1][: self._frame_fill])
            self._frame_fill = 0

    def _put(self, piece: memoryview) -> None:
        written = self.stream.write(piece)
        if written is not None and written != piece.nbytes:
            raise OSError(f"short write: {written} of {piece.nbytes} bytes")


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for view in views:
        if n >= view.nbytes:
            n -= view.nbytes
            continue
        out.append(view[n:])
        n = 0
    return out


# ---------------------------------------------------------------------------------------------- write-back
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + length)`` of ``fd`` to disk without waiting for it."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # a failure only loses the head start
