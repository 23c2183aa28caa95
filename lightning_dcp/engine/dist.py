"""Who takes part in a checkpoint call, and rank 0's decisions given to every rank.

A call is *collective* when every rank of the default process group makes it (the sharded strategies); otherwise one
process acts alone (a stock Lightning strategy calls its CheckpointIO on rank 0 only) and nothing here runs a
collective. Anything that could differ between ranks (does the checkpoint exist, which is the newest, where to write)
is decided by rank 0 and broadcast.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_dcp.engine import shutdown

__all__ = [
    "all_true",
    "destroy_own_groups",
    "distributed",
    "on_rank0",
    "own_group",
    "rank_and_world",
    "settle_threads",
    "single_process_ok",
]

_T = TypeVar("_T")


def distributed(collective: bool) -> bool:
    """Whether a call with this ``collective`` flag runs as a collective over the default process group.

    A group of one process runs nothing collective: DCP then skips pickling its plans for an exchange with itself.
    """
    return collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_true(flag: bool, *, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``flag`` is true on every rank of ``group`` (the default group when ``None``).

    One all-reduce of a CPU tensor where the group's backend is gloo (``"gloo"``, ``"cpu:gloo,cuda:nccl"``);
    otherwise ``all_gather_object``, which puts its tensors where the backend wants them.

    Collective: call on all ranks of ``group``.
    """
    if "gloo" in str(dist.get_backend(group)):
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
        return bool(value.item())
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, bool(flag), group=group)
    return all(flags)


def rank_and_world(collective: bool) -> tuple[int, int]:
    """``(rank, world_size)`` of this call: the default group's when collective, else ``(0, 1)``."""
    if distributed(collective):
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def on_rank0(collective: bool, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on rank 0 and give every rank its result, or raise its exception on every rank.

    Collective: call on all ranks when ``collective`` (one ``broadcast_object_list``).
    """
    rank, world_size = rank_and_world(collective)
    if world_size == 1:
        return fn()
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = (True, fn())
        except Exception as err:  # re-raised on every rank below
            payload[0] = (False, err)
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if not ok:
        raise value
    return value


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs in a single process: here that is intended (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


_OWN: list[dist.ProcessGroup] = []
_OWN_LOCK = threading.Lock()


def own_group(*, backend: str = "gloo") -> dist.ProcessGroup:
    """A new process group of every rank (``dist.new_group``) that this package created, destroyed at exit.

    Process groups left to the interpreter's teardown are destroyed in whatever order its C++ statics go, with
    their worker threads still joinable: one way a process ends in "terminate called without an active exception"
    (exit 134) after a successful run. :func:`destroy_own_groups` runs in the exit's ``"groups"`` stage
    (:mod:`~lightning_dcp.engine.shutdown`): after the background saves that use these groups finished.

    Collective: call on all ranks (``new_group`` is).
    """
    group = dist.new_group(backend=backend)
    with _OWN_LOCK:
        _OWN.append(group)
    return group


def destroy_own_groups() -> None:
    """Destroy the groups :func:`own_group` created that still exist (each rank alone: no collective runs)."""
    with _OWN_LOCK:
        groups, _OWN[:] = list(_OWN), []
    for group in groups:
        with contextlib.suppress(Exception):  # already destroyed with the default group (Lightning's NCCL exit)
            if dist.is_initialized():
                dist.destroy_process_group(group)


_QUIET_THREADS = frozenset({"gloo_tcp_loop", "pt_tcpstore_uv"})
"""Threads that wake on their own timers (gloo's and the store's event loops) and never touch Python objects."""


def _busy_threads() -> int:
    """How many other threads of this process are running or runnable (state ``R`` in ``/proc``); ``-1``: unknown."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return -1
    busy = 0
    for tid in tids:
        if tid == str(me):
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm", "rb") as f:
                name = f.read().strip().decode(errors="replace")
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(b")")  # the name in parentheses may hold spaces: the state follows the last ')'
        if stat[end + 2 : end + 3] == b"R" and name not in _QUIET_THREADS:
            busy += 1
    return busy


def settle_threads(*, limit: float = 0.5, poll: float = 0.002, quiet_polls: int = 5) -> float:
    """Let the process's native threads finish what they hold before the interpreter is torn down; seconds waited.

    A gloo process group's worker threads drop each finished collective a moment after the ranks see it complete,
    and with it the last references to the tensors it held: dropping those takes the GIL (torch decrements the
    Python objects of such tensors). Process groups stay alive while anything references them, even after
    ``destroy_process_group`` (which does not join gloo's threads), so a worker held off the CPU on a loaded machine
    can do this after interpreter teardown began: CPython then ends that thread with ``pthread_exit``, its unwinding
    crosses a ``noexcept`` frame, and the process aborts ("terminate called without an active exception", exit
    134) after a successful run. Sleeping with the GIL released until no other thread is runnable for
    ``quiet_polls`` polls in a row lets them finish first (at most ``limit`` seconds). Linux only (``/proc``);
    elsewhere it returns at once.

    Runs in the exit's ``"threads"`` stage (:mod:`~lightning_dcp.engine.shutdown`); each process alone.
    """
    start = time.monotonic()
    quiet = 0
    while quiet < quiet_polls and time.monotonic() - start < limit:
        time.sleep(poll)
        busy = _busy_threads()
        if busy < 0:
            break
        quiet = quiet + 1 if busy == 0 else 0
    return time.monotonic() - start


def _settle_at_exit() -> None:
    """The exit's ``"threads"`` stage, in every process that imported the engine.

    A group's threads live on while anything references the group, also after the default group was destroyed; a
    few quiet polls when none runs.
    """
    if dist.is_available():
        settle_threads()


shutdown.on_exit("groups", destroy_own_groups)
shutdown.on_exit("threads", _settle_at_exit)
