"""Keeping Python's cyclic garbage collector off the checkpoint path and off a failed worker's exit.

Unpickling the ``.metadata`` of 7,600 tensors took 0.28-0.44 s with the collector running and 0.04 s paused, in a
small process (``conv`` mix); in a training process with a large heap each collection costs more. At exit, the
interpreter's own collections over a heap that holds torch and Lightning took 1.6-2.1 s (below).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["freeze_heap_at_exit", "gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector meanwhile, and run it afterwards if it was enabled.

    A checkpoint creates tens of thousands of small objects (plans, metadata, checksum lists): each burst of them
    triggers collections over the whole heap of a training process, which cost more than the work itself; and the
    objects a background save keeps alive while collections run are promoted to the oldest generation, whose full
    collections (hundreds of milliseconds in a large process) then come sooner, in the training loop. Safe across
    threads (a background save and the training loop): the collector is enabled again when the last pause that
    began while it was enabled ends.
    """
    global _PAUSES, _REENABLE
    with _PAUSE_LOCK:
        if _PAUSES == 0:
            _REENABLE = gc.isenabled()
            gc.disable()
        _PAUSES += 1
    try:
        yield
    finally:
        with _PAUSE_LOCK:
            _PAUSES -= 1
            if _PAUSES == 0 and _REENABLE:
                gc.enable()


_PAUSE_LOCK = threading.Lock()
_PAUSES = 0  # pauses in progress (any thread)
_REENABLE = False  # whether the collector was enabled when the first of them began


def freeze_heap_at_exit() -> None:
    """At this process's exit, move every live object out of the cyclic garbage collector's reach (:func:`gc.freeze`).

    CPython's finalization (``Py_FinalizeEx``) runs the collector over the whole heap while it tears the modules down.
    With torch, Lightning and lightning_dcp imported, the process ended 1.57-2.11 s after its first ``atexit``
    handler on a 2-core machine, and 0.21-0.30 s after it with the heap frozen there (``benchmarks/exit_time.py``). A
    failed worker spends that time before its elastic agent sees it end and restarts the job; the ``dcp_*``
    multi-process strategies call this when a run fails. Objects still alive at exit are then freed by reference
    counting only, which Python's data model allows ("It is not guaranteed that ``__del__()`` methods are called for
    objects that still exist when the interpreter exits"); every ``atexit`` handler still runs. Idempotent; safe from
    any thread.
    """
    global _FREEZE_AT_EXIT
    with _PAUSE_LOCK:
        if _FREEZE_AT_EXIT:
            return
        _FREEZE_AT_EXIT = True
    atexit.register(gc.freeze)


_FREEZE_AT_EXIT = False  # whether freeze_heap_at_exit registered its handler in this process
