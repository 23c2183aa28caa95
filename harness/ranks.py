"""Run a top-level function on N real processes joined in a gloo process group (forked from harness/zygote.py)."""

from __future__ import annotations

import faulthandler
import os
import pickle
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from harness.zygote import recv_message, send_message

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


def spawn(
    fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, env: dict | None = None, fresh: bool = False
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; re-raise the first failure.

    Each process sees the torchrun-style variables (``MASTER_ADDR``, ``RANK``, ``LOCAL_RANK``, ...), so a Lightning
    ``Trainer(devices=world_size)`` inside ``fn`` joins the group instead of launching processes. Rank ``r`` is forked
    from the zygote of rank index ``r`` (harness/zygote.py: torch and Lightning already imported) and exits through
    the interpreter's own exit; a rank that fails, or exits with another code than 0, fails the run and the others
    are killed. A run that takes longer than ``timeout`` seconds is killed and fails the test (no hang).

    ``fresh=True`` starts each rank as a new interpreter instead (multiprocessing's ``spawn``), which imports torch
    and Lightning itself: what a benchmark that times a process from its start needs.
    """
    if fresh:
        _spawn_fresh(fn, world_size, args, timeout, dict(env or {}))
        return
    port = free_port()
    errors = tempfile.mkdtemp(prefix="spawn-errors-")
    started: dict[int, tuple[int, socket.socket]] = {}  # rank -> (pid, connection)
    exited: set[int] = set()  # pids the zygotes reported (never signalled again: the pid may be reused)
    try:
        for rank in range(world_size):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(_zygote(rank))
            request = {
                "task": pickle.dumps((_entry, (rank, fn, world_size, port, args, dict(env or {})))),
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "sys_path": list(sys.path),
                "error_file": os.path.join(errors, f"rank{rank}"),
                "main": _main_module(),
            }
            send_message(conn, request, fds=[1, 2])
            (_, pid), _ = recv_message(conn)
            started[rank] = (pid, conn)
        _join(fn, started, exited, errors, timeout)
    finally:
        for pid, conn in started.values():
            if pid not in exited:  # left running by a failure, a timeout or an interrupt
                _signal(pid, signal.SIGKILL)
            conn.close()
        shutil.rmtree(errors, ignore_errors=True)


def _spawn_fresh(fn: Callable, world_size: int, args: tuple, timeout: float, env: dict) -> None:
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _entry, args=(fn, world_size, free_port(), args, env), nprocs=world_size, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            stuck = [pid for p in context.processes if p.is_alive() for pid in (p.pid, *_descendants(p.pid))]
            for pid in stuck:
                _signal(pid, signal.SIGUSR2)
            time.sleep(2.0)
            for pid in stuck:
                _signal(pid, signal.SIGKILL)
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world_size} ranks exceeded {timeout} s")


def _main_module() -> tuple[str, str] | None:
    """How a child finds the functions of the requester's ``__main__`` (a benchmark run with ``python -m``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and not spec.name.endswith("__main__"):
        return "module", spec.name
    path = getattr(main, "__file__", None)
    if spec is None and path and path.endswith(".py"):
        return "path", os.path.abspath(path)
    return None


def _join(
    fn: Callable, started: dict[int, tuple[int, socket.socket]], exited: set[int], errors: str, timeout: float
) -> None:
    """Wait for every rank to exit; raise the first failure (its traceback) or a timeout (after dumping stacks)."""
    name, world_size = getattr(fn, "__name__", fn), len(started)
    waiting = {conn: rank for rank, (_, conn) in started.items()}
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            running = [pid for pid, _ in started.values() if pid not in exited]
            stuck = [pid for pid in running for pid in (pid, *_descendants(pid))]
            for pid in stuck:  # every stack to the captured stderr first: a hang says where it hangs
                _signal(pid, signal.SIGUSR2)
            time.sleep(2.0)
            for pid in stuck:
                _signal(pid, signal.SIGKILL)
            raise TimeoutError(
                f"{name} on {world_size} ranks exceeded {timeout} s (the stacks of its"
                f" {len(stuck)} processes are in the captured stderr)"
            )
        ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                (_, pid, status), _ = recv_message(conn)
            except (EOFError, OSError) as err:
                raise RuntimeError(f"rank {rank}'s zygote went away before it reported the rank's exit") from err
            exited.add(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0:
                path = os.path.join(errors, f"rank{rank}")
                detail = open(path).read() if os.path.exists(path) else ""
                what = f"signal {-code}" if code < 0 else f"exit code {code}"
                raise RankFailed(f"{name}: rank {rank} of {world_size} ended with {what}\n{detail}")


class RankFailed(RuntimeError):
    """A spawned rank raised, or ended with another exit code than 0 (its traceback is in the message)."""


_ZYGOTES: dict[int, tuple[subprocess.Popen, str]] = {}


def _zygote(rank: int) -> str:
    """The socket of the zygote serving rank index ``rank``, started on first use (one per pytest process)."""
    known = _ZYGOTES.get(rank)
    if known is not None and known[0].poll() is None:
        return known[1]
    home = tempfile.mkdtemp(prefix="zygote-")
    path, log = os.path.join(home, "socket"), os.path.join(home, "stderr")
    clean = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "harness.zygote", path],
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env=clean,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    deadline = time.monotonic() + 120
    while not os.path.exists(path):  # it appears once the zygote listens
        if process.poll() is not None or time.monotonic() > deadline:
            with open(log) as f:
                raise RuntimeError(
                    f"the zygote for rank {rank} did not start (exit code {process.poll()}):\n{f.read()}"
                )
        time.sleep(0.05)
    _ZYGOTES[rank] = (process, path)
    return path


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


def stop_process_group(proc: subprocess.Popen | None, *, grace: float) -> None:
    """Stop the server ``proc`` started in its own session: SIGTERM to its group, SIGKILL after ``grace`` seconds;
    return once it is gone (at once when it is not running)."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        kill_process_group(proc)


def kill_process_group(proc: subprocess.Popen | None) -> None:
    """SIGKILL the group of ``proc`` (a crash: nothing is flushed) and wait until it is gone."""
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
