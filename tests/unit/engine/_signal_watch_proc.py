"""A process for test_signal_watch.py: a SignalWatch on SIGTERM, then the main thread does what ``MODE`` says.

Run as ``python -m tests.unit.engine._signal_watch_proc MODE DIR AFTER``. It writes ``DIR/ready`` once the watch runs
(the test signals it then), ``DIR/handled`` each time the Python handler runs, ``DIR/on_stuck`` from the watch's
``on_stuck``, and exits 0 when the main thread finishes. Modes:

- ``stuck``: the main thread locks a pthread mutex it holds (one C call that waits for good and that no signal
  interrupts, as a gloo collective waiting for a vanished peer);
- ``busy``: the main thread runs Python for ``AFTER + 1.5`` seconds (the handler runs at once);
- ``stopped``: the watch is stopped and a handler that does not tell the watch is installed; the main thread then
  runs Python for ``AFTER + 1.5`` seconds;
- ``owner``: another wakeup fd was set before: the watch must stay off; prints the wakeup fd after ``start``;
- ``fork``: a child forked while the watch runs is sent SIGTERM (its handler inherited, which tells the copy of the
  watch in the child); the parent runs Python for ``AFTER + 1.5`` seconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from lightning_dcp.engine import SignalWatch


def _touch(directory: str, name: str) -> None:
    with open(os.path.join(directory, name), "a") as f:
        f.write("x")


def main() -> int:
    mode, directory, after = sys.argv[1], sys.argv[2], float(sys.argv[3])
    watch = SignalWatch(signals=[signal.SIGTERM], after=after, on_stuck=lambda s: _touch(directory, "on_stuck"))

    def handler(signum, frame):
        watch.handler_ran()
        _touch(directory, "handled")

    signal.signal(signal.SIGTERM, handler)
    if mode == "owner":
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        print("started", watch.start(), "fd kept", signal.set_wakeup_fd(-1) == write_end, flush=True)
        return 0
    assert watch.start()
    if mode == "stopped":
        watch.stop()
        signal.signal(signal.SIGTERM, lambda signum, frame: _touch(directory, "handled"))
    child = os.fork() if mode == "fork" else None
    if child == 0:  # the child: waits for its SIGTERM, whose handler it runs
        time.sleep(after + 2)
        os._exit(0)
    if child is not None:
        time.sleep(0.5)
        os.kill(child, signal.SIGTERM)
    _touch(directory, "ready")
    if mode == "stuck":
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # zeroed: a default (non-recursive) pthread mutex
        libc.pthread_mutex_lock(mutex)
        libc.pthread_mutex_lock(mutex)  # locks it again: waits for good; signals do not interrupt the wait
        return 0
    end = time.monotonic() + after + 1.5
    while time.monotonic() < end:
        sum(range(1000))
    if child is not None:
        os.waitpid(child, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
