"""What the Trainer benchmarks share: spawning a task on fresh ranks, timing across ranks, the disk's side.

:mod:`benchmarks.bench_trainer` (saves, fits) and :mod:`benchmarks.bench_resume` (resumes in fresh processes) both
run their tasks through :func:`spawn`, which takes the task function itself, so neither module imports the other's
tasks: ``bench_trainer`` imports ``bench_resume``, never the reverse.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BLOCK = 64 << 20
"""Bytes per read of a cold sequential read (:func:`read_files`)."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _max_over_ranks(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Any) -> tuple[float, float]:
    """``(this rank's seconds, slowest rank's seconds)`` of ``fn()``, from a barrier."""
    _barrier()
    start = time.perf_counter()
    fn()
    mine = time.perf_counter() - start
    return mine, _max_over_ranks(mine)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def dir_bytes(path: str) -> int:
    """Bytes of every file in ``path`` (a file's own size when ``path`` is a file)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def read_files(path: str) -> int:
    """Read every file under ``path`` sequentially in 64 MiB blocks into one reused buffer; returns the bytes."""
    buffer = bytearray(BLOCK)
    total = 0
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for name in sorted(files):
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total


def evict(path: str) -> bool:
    """Drop ``path``'s files (a file or a directory tree) from the page cache, after writing them back.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file: the next read comes from the disk, like after
    ``echo 3 > /proc/sys/vm/drop_caches``, without evicting other processes' pages (or the libraries this process
    still has to page in). Returns False when the kernel kept some of the pages (checked with ``mincore``-free
    means: a second call is harmless, so this only reports ``posix_fadvise`` failures).
    """
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    ok = True
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def make_trainer(world_size: int, *, strategy: str = "dcp_ddp", **kwargs: Any):
    """The harness's CPU Trainer (:func:`harness.trainer.make_trainer`) without validation."""
    import lightning_dcp  # noqa: F401  (registers the dcp_* strategy names)
    from harness.trainer import make_trainer as harness_trainer

    return harness_trainer(world_size, strategy=strategy, limit_val_batches=0, **kwargs)


def _entry(rank: int, world_size: int, task: Callable[..., dict], workdir: str, kwargs: dict) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    result = task(rank, world_size, workdir, **kwargs)
    if rank == 0:
        with open(os.path.join(workdir, f"{task.__name__}.json"), "w") as f:
            json.dump(result, f)


def spawn(task: Callable[..., dict], world_size: int, workdir: str, **kwargs: Any) -> dict:
    """Run ``task(rank, world_size, workdir, **kwargs)`` on ``world_size`` fresh processes; rank 0's result.

    ``task`` is a module-level function (it is pickled by reference into the processes, which
    :func:`harness.ranks.spawn` starts: torchrun-style variables, one gloo group).
    """
    from harness.ranks import spawn as spawn_ranks

    os.makedirs(workdir, exist_ok=True)
    spawn_ranks(_entry, world_size, task, workdir, kwargs, timeout=3600.0, fresh=True)
    with open(os.path.join(workdir, f"{task.__name__}.json")) as f:
        return json.load(f)


def summary(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (seconds)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
