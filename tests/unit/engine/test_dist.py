"""engine.dist: the exit handler that lets native threads finish before the interpreter is torn down."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from lightning_dcp.engine.dist import settle_threads


def _hash_for(seconds: float, done: threading.Event) -> None:
    """Keep a CPU busy outside the GIL (hashlib releases it for large buffers), as a gloo worker does."""
    data = b"x" * (8 << 20)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hashlib.sha256(data).digest()
    done.set()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="reads /proc")
def test_settling_waits_while_another_thread_runs_and_returns_once_all_are_quiet():
    assert settle_threads(limit=2.0) < 0.5  # nothing runs: a few quiet polls

    done = threading.Event()
    worker = threading.Thread(target=_hash_for, args=(0.6, done))
    worker.start()
    waited = settle_threads(limit=5.0)
    assert done.is_set() and waited >= 0.4, waited  # it waited for the busy thread to finish
    worker.join()

    done = threading.Event()
    worker = threading.Thread(target=_hash_for, args=(3.0, done))
    worker.start()
    waited = settle_threads(limit=0.3)
    assert not done.is_set() and 0.3 <= waited < 1.5, waited  # never past its limit
    worker.join()
