"""Reading a local checkpoint into the page cache in the background, ahead of a restore that reads all of it.

Under DDP (and on one device) every rank restores every byte of the checkpoint. From a cold page cache the restore
would wait for the disk record by record, after it has built its targets and probed the checkpoint. A background
thread per rank instead sends the checkpoint's files (``sendfile``) to ``/dev/null`` from the moment the front end knows
the path: the kernel fills the page cache without copying to the process, and the thread holds the GIL only between
files. The commit marker and the metadata come first (the probe reads them next), then the data files in the order
every rank's restore reads them (by name): the ranks' threads ask for the same pages, so the disk reads each file
once, front to back, and each restore follows right behind it, finding its pages in memory or waiting on the ones
the disk is bringing in. (Each rank starting at its own file instead splits the disk between the files: every
file then completes late, and ``bert`` restored in 0.70-0.75 s against 0.53-0.59 s this way.) At most half of the
machine's memory is read ahead, so that a checkpoint larger than that does not evict its own first pages before
the restore reads them. Each file is read with ``POSIX_FADV_SEQUENTIAL`` (the kernel's read-ahead doubled): the
``bert`` files (1.3 GB) came from a cold cache in 0.53-0.60 s with it and 0.66-0.81 s without (3 rounds each).

Only regular files are read (a FIFO or a device is opened without blocking and skipped), never past each file's
end or the end the caller gives; every error is left to the restore's own reads, which name it.

Measured (2 ranks, cold page cache; ``benchmarks.bench_trainer --mix M --tasks load --load-world-sizes 2``):
started by the Trainer strategy before it builds its targets rather than after the probe, ``conv`` (187 MB in
7,600 records) restored in 0.16-0.21 s against 0.20-0.22 s (medians of 7, 3 runs each); see ``benchmarks/README.md``.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Mapping

from lightning_dcp.engine import shutdown

__all__ = ["fill_page_cache", "prefetch", "wait"]

_FIRST = (".commit", ".metadata")
"""Read before the data files: the probe reads them first."""
_DATA_SUFFIX = ".distcp"

_CHUNK = 64 << 20
"""Bytes per ``sendfile``: a prefetch stops within one of them at exit."""

_ACTIVE: dict[str, threading.Thread] = {}
_LOCK = threading.Lock()


def prefetch(path: str, *, ends: Callable[[], Mapping[str, int]] | None = None) -> bool:
    """Start reading the local checkpoint directory ``path`` into the page cache in a background thread.

    Args:
        path: A local checkpoint directory; anything else (a file, a missing path) starts nothing.
        ends: Gives the bytes to read of each data file (by name, from the record index; called in the thread);
            ``None``: the directory's ``*.distcp`` files whole, after ``.commit`` and ``.metadata``.

    Returns:
        Whether a thread started (``False``: nothing to read, or a prefetch of ``path`` is still running).

    Any rank; never raises.
    """
    key = os.path.realpath(path)
    if ends is None and not os.path.isdir(key):
        return False
    with _LOCK:
        running = _ACTIVE.get(key)
        if running is not None and running.is_alive():
            return False
        thread = threading.Thread(target=_fill, args=(key, ends), name="lightning_dcp-prefetch", daemon=True)
        _ACTIVE[key] = thread
        thread.start()
    return True


def wait(path: str, timeout: float | None = None) -> bool:
    """Wait for the prefetch of ``path`` (if one runs) to finish; returns False if it still runs after ``timeout`` s."""
    with _LOCK:
        thread = _ACTIVE.get(os.path.realpath(path))
    if thread is not None:
        thread.join(timeout)
        return not thread.is_alive()
    return True


def _stop_at_exit(deadline: float) -> None:
    """The exit's ``"work"`` stage (:mod:`~lightning_dcp.engine.shutdown`): no more reads; the threads end."""
    _STOP.set()
    with _LOCK:
        threads = list(_ACTIVE.values())
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


_STOP = threading.Event()
shutdown.on_exit("work", _stop_at_exit)


def _fill(key: str, ends: Callable[[], Mapping[str, int]] | None) -> None:
    try:
        first: tuple[str, ...] = ()
        if ends is None:
            try:
                names = [name for name in os.listdir(key) if name.endswith(_DATA_SUFFIX)]
            except OSError:
                return
            sizes, first = dict.fromkeys(names, -1), _FIRST
        else:
            sizes = dict(ends())
        files = [(os.path.join(key, name), -1) for name in first]
        fill_page_cache(files + [(os.path.join(key, name), sizes[name]) for name in sorted(sizes)])
    except Exception:  # nothing to report: the restore's own reads name what is wrong
        pass
    finally:
        with _LOCK:
            if _ACTIVE.get(key) is threading.current_thread():
                del _ACTIVE[key]


def fill_page_cache(files: list[tuple[str, int]], budget: int | None = None) -> None:
    """``sendfile`` the first ``end`` bytes of each regular file ``(path, end)`` to ``/dev/null`` (``-1``: all).

    No more than ``budget`` bytes in all (default: half of the machine's physical memory). Errors are left to the
    restore's own reads, which name them.
    """
    if budget is None:
        budget = _half_the_memory()
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for where, end in files:
            try:
                fd = os.open(where, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            except OSError:
                continue  # the restore's own read says what is wrong
            try:
                info = os.fstat(fd)  # a FIFO or a device is not read (opened without blocking)
                size = (info.st_size if end < 0 else min(info.st_size, end)) if stat.S_ISREG(info.st_mode) else 0
                size = min(size, budget)
                budget -= size
                if size and hasattr(os, "posix_fadvise"):  # twice the read-ahead: larger reads from the disk
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                done = 0
                while done < size and not _STOP.is_set():
                    sent = os.sendfile(sink, fd, done, min(size - done, _CHUNK))
                    if not sent:
                        break
                    done += sent
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        os.close(sink)


def _half_the_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (AttributeError, OSError, ValueError):  # not a POSIX system that says: no limit of ours
        return 1 << 62
