"""The engine's part of a process's exit, in one owned order, while the interpreter is still whole.

At exit, in this order (registered when the engine is imported):

1. ``"work"``: what the engine still owes the user, first thing in the interpreter's exit (a ``threading`` exit hook,
   as ``concurrent.futures`` has: before the thread pools stop taking work, which the writers use, and before the
   ``atexit`` handlers). Each live :class:`~lightning_dcp.engine.checkpointer.Checkpointer` finishes its background
   save in flight (committed, or reported failed) and joins its thread, then waits for the local tier's uploads; a
   resume's page-cache prefetch stops. Together they get :data:`EXIT_WAIT_S` seconds; a log line says what was
   waited for and how long, and whatever could not finish in time is named in a loud error line (earlier
   checkpoints are intact).
2. ``"groups"`` (an ``atexit`` handler, so after the handlers that users and libraries register later): the process
   groups this package created are destroyed (:func:`~lightning_dcp.engine.dist.destroy_own_groups`), after the work
   that used them.
3. ``"threads"``: the native threads of process groups settle (:func:`~lightning_dcp.engine.dist.settle_threads`).

Why an owned order: a thread still running when CPython finalizes is ended by ``pthread_exit`` the moment it asks for
the interpreter lock; when a C++ frame without exceptions sits on its stack (torch's), the process aborts ("terminate
called without an active exception", exit 134) after a run that succeeded, and a background save cut off there is
never committed.

Each process runs its own exit; nothing here is collective (a background save's own collectives run in its thread).
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_WAIT_S", "STAGES", "on_exit", "run_exit"]

log = logging.getLogger("lightning_dcp")

EXIT_WAIT_S = 600.0
"""Seconds the ``"work"`` stage waits in all for background saves and uploads at exit (a save of tens of GB to a
remote store takes minutes); then it leaves what is unfinished, naming it."""

STAGES = ("work", "groups", "threads")
"""The exit's stages, in the order they run."""

_LOCK = threading.Lock()
_TASKS: dict[str, list[tuple[Any, Callable[..., None]]]] = {stage: [] for stage in STAGES}
_RAN: set[str] = set()


def on_exit(stage: str, fn: Callable[..., None], *, owner: object | None = None) -> None:
    """Run ``fn`` at exit in ``stage`` (after the tasks registered before it in that stage).

    ``"work"`` tasks are called with ``deadline`` (a ``time.monotonic()`` value): ``fn(owner, deadline)``, only while
    ``owner`` is alive (held weakly), or ``fn(deadline)`` without an owner; other stages call ``fn()``. A task that
    raises is logged and the exit goes on.
    """
    if stage not in _TASKS:
        raise ValueError(f"`stage` must be one of {STAGES}, got {stage!r}.")
    held = weakref.ref(owner) if owner is not None else None
    with _LOCK:
        _TASKS[stage].append((held, fn))


def run_exit(stages: tuple[str, ...] = STAGES) -> None:
    """Run the exit's ``stages`` now, each once per process (the interpreter's exit runs them all)."""
    with _LOCK:
        stages = tuple(stage for stage in stages if stage not in _RAN)
        _RAN.update(stages)
        tasks = {stage: list(_TASKS[stage]) for stage in stages}
    deadline = time.monotonic() + EXIT_WAIT_S
    for stage in stages:
        for held, fn in tasks[stage]:
            try:
                if held is not None:
                    owner = held()
                    if owner is not None:
                        fn(owner, deadline)
                elif stage == "work":
                    fn(deadline)
                else:
                    fn()
            except Exception:  # the exit goes on; what failed is told
                log.error(
                    "lightning_dcp: a step of the exit failed (%s)", getattr(fn, "__qualname__", fn), exc_info=True
                )


def _register() -> None:
    import concurrent.futures.thread  # noqa: F401  (its hook, registered first, then runs after ours)

    work = functools.partial(run_exit, ("work",))
    try:
        threading._register_atexit(work)  # run by threading._shutdown, before atexit (CPython 3.9+)
    except (AttributeError, RuntimeError):  # another Python, or imported during the exit itself
        atexit.register(work)
    atexit.register(run_exit)


_register()
