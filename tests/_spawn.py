"""Run a top-level function on N real processes joined in a gloo process group (spawn start method)."""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

_HANDED_OUT: set[int] = set()
_PICKER = random.Random()  # its own generator: seed_everything in a test must not make two processes pick alike


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback TCP port that is free now, below the kernel's ephemeral range, not handed out before in this process.

    A port the kernel picks for ``bind(0)`` lies in the ephemeral range, from which every outgoing connection also takes
    its local port: between the pick and the server's own bind, a client connection (s3fs, gloo) can take it and the
    server exits with EADDRINUSE. Ports below that range are only ever taken by an explicit bind.
    """
    low, _ = _ephemeral_range()
    floor = 10000 if low > 12000 else 1024
    candidates = list(range(floor, low))
    _PICKER.shuffle(candidates)
    for port in candidates:
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # every port below the range is taken: fall back on the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
"""Set by a launcher: inherited, they make Lightning take the run's processes as started by someone else."""


def port_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with a ``MASTER_PORT`` of its own, for a Trainer or Fabric run started as a subprocess.

    Lightning picks a free port when none is set; two runs started at the same moment (a reference run beside the
    one a test kills) can pick the same one, and the second fails with EADDRINUSE. The launcher's variables a test
    process may hold (``LOCAL_RANK``, ...) are left out: the run launches its own ranks.
    """
    inherited = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    return {**inherited, "MASTER_PORT": str(free_port()), **extra}


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, env: dict) -> None:
    # A rank (and every child it forks, e.g. a DataLoader worker, which inherits the handler) prints every thread's
    # Python stack on SIGUSR2: what `spawn` sends before it kills a run that exceeded its timeout.
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    fn(rank, world_size, *args)
    import torch.distributed as dist

    if dist.is_initialized():  # leave together and in order, as a user's script ends after its run
        dist.barrier()
        dist.destroy_process_group()
    # Then the interpreter's own exit, as in a user's process: the exit code is checked by `spawn` (an abort at exit
    # is a non-zero code, and fails the test).


def spawn(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, env: dict | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; re-raise the first failure.

    Each process sees the torchrun-style variables (``MASTER_ADDR``, ``RANK``, ``LOCAL_RANK``, ...), so a Lightning
    ``Trainer(devices=world_size)`` inside ``fn`` joins the group instead of launching processes. A run that takes
    longer than ``timeout`` seconds is killed and fails the test (no hang).
    """
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args, dict(env or {})),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            stuck = [pid for p in context.processes if p.is_alive() for pid in (p.pid, *_descendants(p.pid))]
            for pid in stuck:  # every stack to the captured stderr first: a hang says where it hangs
                _signal(pid, signal.SIGUSR2)
            time.sleep(2.0)
            for pid in stuck:
                _signal(pid, signal.SIGKILL)
            raise TimeoutError(
                f"{getattr(fn, '__name__', fn)} on {world_size} ranks exceeded {timeout} s (the stacks of its"
                f" {len(stuck)} processes are in the captured stderr)"
            )


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first), from ``/proc``; none where ``/proc`` is missing."""
    parents: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, queue = [], list(parents.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue += parents.get(child, [])
    return found


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
