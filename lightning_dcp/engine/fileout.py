"""Sequential outputs for data files: direct I/O from tensor memory, buffered ``pwritev``, or an fsspec stream.

Every output takes the file's bytes in order (``write``), knows its ``position`` and may insert a gap of zeros
between records (``align``) so that a large tensor's bytes land on a file offset with the same alignment as their
address in memory. That is what lets :class:`DirectOut` hand them to the disk straight from the tensor (``O_DIRECT``:
no copy into the page cache, so no CPU spent on it, no other process's cached pages evicted, and an ``fsync`` with
nothing left to flush). Small pieces (record headers, small tensors, the unaligned head and tail of a large one) go
through one page-aligned bounce buffer written with the same descriptor. Where ``O_DIRECT`` is refused (tmpfs,
some network filesystems) the file is written by :class:`BufferedOut` instead, which gathers pieces into one
``pwritev`` per :data:`PIECE` bytes and asks the kernel to start write-back every :data:`KICK` bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from typing import IO, Any

__all__ = ["ALIGN", "DIRECT_MIN", "KICK", "PIECE", "BufferedOut", "DirectOut", "StreamOut", "open_local"]

ALIGN = 4096
"""Alignment of direct I/O: file offsets, lengths and memory addresses (covers logical blocks up to 4 KiB)."""
PIECE = 16 << 20
"""Bytes per write call (and per checksum update: a piece is hashed right before it is written)."""
DIRECT_MIN = 256 << 10
"""Tensors at least this large are written from their own memory with direct I/O; smaller ones are copied."""
KICK = 64 << 20
"""Buffered output: bytes after which the kernel is asked to start writing back (when the file is synced)."""
_MAX_IOV = 512


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

    def align(self, address: int, data_offset: int) -> None:
        """No gaps in buffered files."""

    def write(self, piece: memoryview, keep: Any = None, address: int | None = None) -> None:
        """Append ``piece`` (``keep`` is held until the bytes are written: what owns the memory)."""
        self._pending.append(piece)
        self._keep.append(keep)
        self._pending_bytes += piece.nbytes
        self.position += piece.nbytes
        if self._pending_bytes >= PIECE or len(self._pending) >= _MAX_IOV:
            self._flush()

    def close(self) -> None:
        """Write what is pending, ``fsync`` when synced, close the descriptor."""
        try:
            self._flush()
            if self.sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)

    def _flush(self) -> None:
        views, total = self._pending, self._pending_bytes
        self._pending, self._pending_bytes = [], 0
        while total:
            n = os.pwritev(self.fd, views, self._written)
            self._written += n
            total -= n
            if total:  # a short write: continue with the rest
                views = _advance(views, n)
        self._keep.clear()
        if self.sync and self._written - self._kicked >= KICK:
            _start_writeback(self.fd, self._kicked, self._written - self._kicked)
            self._kicked = self._written


class DirectOut:
    """``O_DIRECT`` writes: aligned spans of large pieces from their own memory, everything else via a bounce buffer.

    The bounce buffer always starts at an aligned file offset; it is written when full and when a piece can go
    direct (the buffer then ends on an aligned offset too). The file is padded to a whole block by its last write
    and truncated to its real length on :meth:`close`. Should the filesystem refuse an aligned direct write
    (``EINVAL``), ``O_DIRECT`` is switched off for the rest of the file and the same writes go through the page cache.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.position = 0
        self._bounce = mmap.mmap(-1, PIECE)  # page-aligned anonymous memory
        self._view = memoryview(self._bounce)
        self._base = 0  # file offset of the bounce buffer's first byte (aligned)
        self._fill = 0

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
                self._drain()  # the bounce buffer now ends on an aligned offset
                for start in range(head, head + body, PIECE):
                    chunk = piece[start : min(start + PIECE, head + body)]
                    self._pwrite(chunk, self._base)
                    self._base += chunk.nbytes
                    self.position += chunk.nbytes
                piece = piece[head + body :]
        self._copy(piece)

    def close(self) -> None:
        """Write the last partial block, trim the file to its length, ``fsync`` and close."""
        try:
            self._drain(final=True)
            os.ftruncate(self.fd, self.position)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self._view.release()
            self._bounce.close()

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
        """Write the bounce buffer (whole blocks; on ``final`` the last partial block zero-padded) and empty it."""
        if self._fill == 0:
            return
        length = self._fill
        if final:
            pad = -length % ALIGN
            self._view[length : length + pad] = bytes(pad)
            length += pad
        elif length % ALIGN:  # write() drains only on an aligned position
            raise AssertionError("bounce buffer drained off a block boundary")
        self._pwrite(self._view[:length], self._base)
        self._base += self._fill
        self._fill = 0

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

    def align(self, address: int, data_offset: int) -> None:
        """No gaps in streams."""

    def write(self, piece: memoryview, keep: Any = None, address: int | None = None) -> None:
        """Append ``piece``."""
        written = self.stream.write(piece)
        if written is not None and written != piece.nbytes:
            raise OSError(f"short write: {written} of {piece.nbytes} bytes")
        self.position += piece.nbytes

    def close(self) -> None:
        """The stream's owner closes it."""


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
