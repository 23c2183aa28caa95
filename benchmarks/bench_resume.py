"""A resume as users see it: ``Trainer.fit(model, ckpt_path=...)`` in fresh processes with a cold page cache.

``bench_trainer --tasks load`` runs this. Per round, each method in its own fresh processes (spawned ranks: a new
interpreter, a new model and a new AdamW optimizer without state):

- ``load``: ``Trainer(strategy="dcp_ddp").fit(model, ckpt_path=<our checkpoint>)``;
- ``stock``: ``Trainer(strategy="ddp").fit(model, ckpt_path=<stock Lightning's single .ckpt of the same state>)``;
- ``read``: this process reading our checkpoint's files sequentially in 64 MiB blocks (the disk's limit).

Each is timed from the ``setup`` hook to ``on_train_start`` (the slowest rank; weights, optimizer, loops and
callbacks restored, DDP's broadcast of the weights included for both), which stops the fit before its first step.
Before each, the files it reads are written back and dropped from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)`` per file: ``cold`` says whether every call succeeded). ``paired``: each
round's ``read`` over its ``load`` (and ``stock`` over ``load``), round by round, which the disk's changing speed
skews less than the ratio of medians.

``phases`` (``load`` only): per resume, the slowest rank's seconds in each part of our restore, found by wrapping the
functions the strategy calls (in the child processes only; the library has no timers):
``target`` (the model's and optimizers' targets: ``model_state_dict``, ``optimizer_state_dict``), ``probe``
(which checkpoint, its ``.commit``/metadata), ``plan`` (the record index's plan), ``read`` (reading and checking
the records into the targets), ``dcp`` (the general DCP load, where the index declines), ``apply``
(``load_model_state_dict``, ``load_optimizer_state_dict``) and ``total`` (``strategy.load_checkpoint`` and both
applies).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("target", "probe", "plan", "read", "dcp", "apply", "total")


def _max_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class _Clock:
    """Seconds spent in wrapped functions, per phase (nested calls of one phase count once)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._depth = dict.fromkeys(PHASES, 0)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth[phase] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[phase] -= 1
                if self._depth[phase] == 0:
                    self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


def _instrument(strategy: Any) -> _Clock:
    """Wrap what ``strategy``'s restore calls (see the module docstring) for this process."""
    from lightning_dcp.engine.load import index_load, restore
    from lightning_dcp.trainer import strategies

    clock = _Clock()
    for name in ("model_state_dict", "optimizer_state_dict"):
        clock.wrap(strategies, name, "target")
    for name in ("load_model_state_dict", "load_optimizer_state_dict"):
        if hasattr(strategies, name):
            clock.wrap(strategies, name, "apply")
    clock.wrap(restore, "probe", "probe")
    clock.wrap(index_load, "_plan", "plan")
    clock.wrap(index_load, "_read_file", "read")
    clock.wrap(restore.local_load, "load", "dcp")
    for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"):
        clock.wrap(strategy, name, "total")
    return clock


def _timing_callback(instrument: bool):
    from lightning.pytorch import Callback

    class Timing(Callback):
        """From ``setup`` to ``on_train_start`` (then the fit stops before its first step)."""

        def __init__(self) -> None:
            self.start = 0.0
            self.seconds: list[float] = []
            self.clock: _Clock | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if instrument:
                self.clock = _instrument(trainer.strategy)
            self.start = time.perf_counter()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            elapsed = time.perf_counter() - self.start
            phases = [self.clock.seconds[p] for p in PHASES] if self.clock else []
            self.seconds = _max_over_ranks([elapsed, *phases])
            trainer.should_stop = True

    return Timing()


def task_resume(rank: int, world_size: int, workdir: str, mix: str, scale: float, ckpt: str, strategy: str) -> dict:
    """One resume in these fresh processes: ``Trainer.fit(model, ckpt_path=ckpt)`` with ``strategy``."""
    from benchmarks.mixes import make_module
    from benchmarks.trainer_runs import make_trainer

    module = make_module(mix, scale=scale)
    timing = _timing_callback(instrument=strategy == "dcp_ddp")
    trainer = make_trainer(world_size, strategy=strategy, max_steps=2, callbacks=[timing])
    trainer.fit(module, ckpt_path=ckpt)
    seconds = timing.seconds
    out: dict[str, Any] = {"seconds": seconds[0]}
    if len(seconds) > 1:
        out["phases"] = dict(zip(PHASES, seconds[1:], strict=True))
    return out


def run_rounds(world_size: int, loaddir: str, *, saved: int, repeats: int, mix: str, scale: float) -> dict:
    """``repeats`` rounds of (our resume, stock's resume, a cold read of our files); see the module docstring."""
    from benchmarks.trainer_runs import dir_bytes, evict, read_files, spawn

    ours = os.path.join(loaddir, f"resume-ws{saved}.ckpt")
    stock = os.path.join(loaddir, f"stock-ws{saved}.ckpt")
    runs: dict[str, list[Any]] = {"load": [], "stock": [], "read": [], "phases": []}
    cold = True
    for _ in range(repeats):
        for method, path, name in (("load", ours, "dcp_ddp"), ("stock", stock, "ddp")):
            cold = evict(path) and cold
            res = spawn(task_resume, world_size, loaddir, mix=mix, scale=scale, ckpt=path, strategy=name)
            runs[method].append(res["seconds"])
            if "phases" in res:
                runs["phases"].append(res["phases"])
        cold = evict(ours) and cold
        start = time.perf_counter()
        read_files(ours)
        runs["read"].append(time.perf_counter() - start)
    return {"bytes": dir_bytes(ours), "stock_bytes": dir_bytes(stock), "runs": runs, "cold": cold}
