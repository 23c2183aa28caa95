"""A resume as users see it: ``Trainer.fit(model, ckpt_path=...)`` in fresh processes with a cold page cache.

``bench_trainer --tasks load`` runs this. Per round, each method in its own fresh processes (spawned ranks: a new
interpreter, a new model and a new AdamW optimizer without state):

- ``load``: ``Trainer(strategy="dcp_ddp").fit(model, ckpt_path=<our checkpoint>)``;
- ``stock``: ``Trainer(strategy="ddp").fit(model, ckpt_path=<stock Lightning's single .ckpt of the same state>)``;
- ``fresh`` and ``stock_fresh``: the same two fits without a ``ckpt_path`` (training from the initial weights), the
  time a fit takes to start when there is nothing to restore;
- ``read``: this process reading our checkpoint's files sequentially in 64 MiB blocks (the disk's limit).

Each fit is timed from the ``setup`` hook to ``on_train_start`` (``start``: the slowest rank; weights, optimizer,
loops and callbacks restored, DDP's broadcast of the weights included for both) and to the end of the first
training step (``first``), after which the fit stops. Before each, the files it reads are written back and dropped
from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` per file: ``cold`` says whether every call succeeded).

What ``bench_trainer`` derives, per round: ``added``, ``load``'s ``start`` minus ``fresh``'s, each without the full
(oldest-generation) collections of the interpreter inside it (``gc``): the time the resume itself adds to a fit's
start. A fresh process that has imported torch and Lightning and built a model with many small tensors (``conv``)
owes the interpreter one full collection of its heap, 0.3-0.4 s for about 350,000 objects on 2 cores: it falls
inside ``start`` when there is a checkpoint to restore and in the first step when there is none (``gc_first``
records it), so it is no part of what a resume costs. ``added_first`` subtracts the ``first`` windows instead,
collections included; it also holds the first step's allocation of a fresh optimizer's state (which a resume makes
while it restores) and the first step's own spread (about 1 s for ``bert`` on 2 cores).

``phases`` (``load`` only): per resume, the slowest rank's seconds in each part of our restore up to
``on_train_start``, found by wrapping the functions the strategy calls (in the child processes only; the library has
no timers), each without the full collections that ran inside it:
``target`` (the model's and optimizers' targets: ``model_state_dict``, ``parameters_by_fqn``), ``probe``
(which checkpoint, its ``.commit``/metadata), ``plan`` (the record index's plan), ``read`` (reading and checking
the records into the targets), ``dcp`` (the general DCP load, where the index declines), ``apply``
(``load_model_state_dict``, ``load_optimizer_state_dict``), ``gc`` (full collections from ``setup`` to
``on_train_start``) and ``total`` (``strategy.load_checkpoint`` and both applies, without collections).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

PHASES = ("target", "probe", "plan", "read", "dcp", "apply", "gc", "total")
METHODS = ("load", "stock", "fresh", "stock_fresh")


def _max_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class _Collections:
    """Seconds of the interpreter's full collections (generation 2) while installed as a ``gc.callbacks`` entry."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began: float | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None


class _Clock:
    """Seconds spent in wrapped functions, per phase (nested calls of one phase count once; collections apart)."""

    def __init__(self, collections: _Collections) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._depth = dict.fromkeys(PHASES, 0)
        self._collections = collections

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth[phase] += 1
            start, collected = time.perf_counter(), self._collections.seconds
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[phase] -= 1
                if self._depth[phase] == 0:
                    spent = time.perf_counter() - start
                    self.seconds[phase] += spent - (self._collections.seconds - collected)

        setattr(owner, name, timed)


def _instrument(strategy: Any, collections: _Collections) -> _Clock:
    """Wrap what ``strategy``'s restore calls (see the module docstring) for this process."""
    from lightning_dcp.engine.load import index_load, restore
    from lightning_dcp.trainer import strategies

    clock = _Clock(collections)
    for name in ("model_state_dict", "parameters_by_fqn"):  # the optimizers' targets: their parameters by FQN
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
    import gc

    from lightning.pytorch import Callback

    class Timing(Callback):
        """From ``setup`` to ``on_train_start`` and to the end of the first step (then the fit stops)."""

        def __init__(self) -> None:
            self.start = 0.0
            self.marks: list[float] = []  # start, gc to start, first, gc to first
            self.seconds: list[float] = []
            self.clock: _Clock | None = None
            self.collections = _Collections()

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            gc.callbacks.append(self.collections)
            if instrument:
                self.clock = _instrument(trainer.strategy, self.collections)
            self.start = time.perf_counter()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.marks = [time.perf_counter() - self.start, self.collections.seconds]
            if self.clock:
                self.clock.seconds["gc"] = self.collections.seconds

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if len(self.marks) != 2:
                return
            self.marks += [time.perf_counter() - self.start, self.collections.seconds]
            gc.callbacks.remove(self.collections)
            phases = [self.clock.seconds[p] for p in PHASES] if self.clock else []
            self.seconds = _max_over_ranks([*self.marks, *phases])
            trainer.should_stop = True

    return Timing()


def task_resume(
    rank: int, world_size: int, workdir: str, mix: str, scale: float, ckpt: str | None, strategy: str
) -> dict:
    """One fit in these fresh processes: ``Trainer.fit(model, ckpt_path=ckpt)`` with ``strategy``, one step."""
    from benchmarks.mixes import make_module
    from benchmarks.trainer_runs import make_trainer

    module = make_module(mix, scale=scale)
    timing = _timing_callback(instrument=strategy == "dcp_ddp" and ckpt is not None)
    trainer = make_trainer(world_size, strategy=strategy, max_steps=10_000, callbacks=[timing])
    trainer.fit(module, ckpt_path=ckpt)
    seconds = timing.seconds
    if len(seconds) < 4:
        raise RuntimeError(f"the fit ran no training step (global_step {trainer.global_step})")
    out: dict[str, Any] = dict(zip(("start", "gc_start", "first", "gc_first"), seconds[:4], strict=True))
    if len(seconds) > 4:
        out["phases"] = dict(zip(PHASES, seconds[4:], strict=True))
    return out


def run_rounds(world_size: int, loaddir: str, *, saved: int, repeats: int, mix: str, scale: float) -> dict:
    """``repeats`` rounds of the methods of the module docstring (fresh processes each) and a cold read."""
    from benchmarks.resume_floor import floor_file, floor_seconds
    from benchmarks.trainer_runs import dir_bytes, evict, read_files, spawn

    ours = os.path.join(loaddir, f"resume-ws{saved}.ckpt")
    stock = os.path.join(loaddir, f"stock-ws{saved}.ckpt")
    fits = {
        "load": (ours, "dcp_ddp"),
        "stock": (stock, "ddp"),
        "fresh": (None, "dcp_ddp"),
        "stock_fresh": (None, "ddp"),
    }
    runs: dict[str, list[Any]] = {"read": [], "floor": [], "phases": []}
    weights, optimizer = state_bytes(mix, scale)
    floor = floor_file(loaddir, weights, optimizer)
    for method in METHODS:
        runs[method], runs[f"{method}_first"], runs[f"{method}_gc"], runs[f"{method}_gc_first"] = [], [], [], []
    cold = True
    for _ in range(repeats):
        for method in METHODS:
            path, name = fits[method]
            cold = evict(ours) and evict(stock) and cold
            res = spawn(task_resume, world_size, loaddir, mix=mix, scale=scale, ckpt=path, strategy=name)
            runs[method].append(res["start"])
            runs[f"{method}_first"].append(res["first"])
            runs[f"{method}_gc"].append(res["gc_start"])
            runs[f"{method}_gc_first"].append(res["gc_first"])
            if "phases" in res:
                runs["phases"].append(res["phases"])
        cold = evict(ours) and cold
        start = time.perf_counter()
        read_files(ours)
        runs["read"].append(time.perf_counter() - start)
        runs["floor"].append(floor_seconds(floor, weights, optimizer, world_size))
    os.unlink(floor)
    return {"bytes": dir_bytes(ours), "stock_bytes": dir_bytes(stock), "runs": runs, "cold": cold}


def state_bytes(mix: str, scale: float) -> tuple[int, int]:
    """``(weights, optimizer state)`` bytes of the mix's model after an AdamW step (two tensors per parameter)."""
    from benchmarks.mixes import make_module

    weights = sum(p.numel() * p.element_size() for p in make_module(mix, scale=scale).parameters())
    return weights, 2 * weights
