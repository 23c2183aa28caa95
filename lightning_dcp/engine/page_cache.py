"""Reading a local checkpoint into the page cache in the background, ahead of a restore that reads all of it.

Under DDP (and on one device) every rank restores every byte of the checkpoint. From a cold page cache the restore
would wait for the disk record by record, after it has built its targets and probed the checkpoint. A background
thread per rank instead sends the checkpoint's files (``sendfile``) to ``/dev/null`` from the moment the front end knows
the path: the kernel fills the page cache without copying to the process, and the thread holds the GIL only between
files. The commit marker and the metadata come first (the probe reads them next), then the data files, rank ``r``
starting at the ``r``-th, so that the ranks' threads ask the disk for different files at once. The restore's own
reads then find the pages in memory, or wait on the ones the disk is bringing in.

Only regular files are read (a FIFO or a device is opened without blocking and skipped), never past each file's
end or the end the caller gives; every error is left to the restore's own reads, which name it.

Measured (``conv`` mix, 187 MB in 7,600 records, 2 ranks, cold page cache; ``benchmarks.bench_trainer --mix conv
--tasks load --load-world-sizes 2``): started by the Trainer strategy before it builds its targets, against started
after the probe: see ``benchmarks/README.md``.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Mapping

__all__ = ["fill_page_cache", "prefetch", "wait"]

_FIRST = (".commit", ".metadata")
"""Read before the data files: the probe reads them first."""
_DATA_SUFFIX = ".distcp"

_ACTIVE: dict[str, threading.Thread] = {}
_LOCK = threading.Lock()


def prefetch(path: str, *, rank: int = 0, ends: Callable[[], Mapping[str, int]] | None = None) -> bool:
    """Start reading the local checkpoint directory ``path`` into the page cache in a background thread.

    Args:
        path: A local checkpoint directory; anything else (a file, a missing path) starts nothing.
        rank: This process's rank: it reads the data files starting at the ``rank``-th (by name, modulo their count).
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
        thread = threading.Thread(target=_fill, args=(key, rank, ends), name="lightning_dcp-prefetch", daemon=True)
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


def _fill(key: str, rank: int, ends: Callable[[], Mapping[str, int]] | None) -> None:
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
        names = sorted(sizes)
        k = rank % len(names) if names else 0
        files = [(os.path.join(key, name), -1) for name in first]
        fill_page_cache(files + [(os.path.join(key, name), sizes[name]) for name in names[k:] + names[:k]])
    except Exception:  # nothing to report: the restore's own reads name what is wrong
        pass
    finally:
        with _LOCK:
            if _ACTIVE.get(key) is threading.current_thread():
                del _ACTIVE[key]


def fill_page_cache(files: list[tuple[str, int]]) -> None:
    """``sendfile`` the first ``end`` bytes of each regular file ``(path, end)`` to ``/dev/null`` (``-1``: all).

    Errors are left to the restore's own reads, which name them.
    """
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
                done = 0
                while done < size:
                    sent = os.sendfile(sink, fd, done, size - done)
                    if not sent:
                        break
                    done += sent
            except OSError:
                pass
            finally:
                os.close(fd)
    finally:
        os.close(sink)
