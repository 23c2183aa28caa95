"""What saving costs a fit: its wall time against no saves, beside the summed ``checkpoint/save_blocked_s``.

Each round runs the same ``trainer.fit`` (``strategy="dcp_ddp"``, ``--world-size`` real processes over gloo, AdamW on
a mix of :mod:`benchmarks.mixes`, ``--steps`` steps) three ways, the order rotating from round to round: without
checkpointing (``none``), with a ``DCPModelCheckpoint`` every ``--every`` steps through ``DCPCheckpointIO()``
(``sync``) and through ``DCPCheckpointIO(async_save=True)`` (``async``: deferred staging, the default). Per fit:

- ``seconds``: wall time of ``trainer.fit`` from a barrier to the slowest rank's return (an async fit's teardown waits
  there for its last save);
- ``overhead``: ``seconds`` minus the same round's ``none`` fit (what the saves cost the run);
- ``blocked``: the sum of ``checkpoint/save_blocked_s`` that rank 0's logger received for the fit's saves (every
  wait of the loop for each save: the call, the steps waiting for its staging copies, the next call or the
  teardown waiting for its write);
- ``calls``: the sum of the save calls alone (``ModelCheckpoint``'s ``trainer.save_checkpoint``, the slowest rank):
  what ``save_blocked_s`` reported for an async save before it counted the waits after the call;
- ``removals``: the sum of ``ModelCheckpoint``'s removals of the checkpoint each save replaces (``save_top_k=1``,
  the slowest rank): a loop cost of checkpointing that is no save's (a sync fit deletes in the loop; an async one
  queues the deletion behind the save in flight, in its background thread);
- ``blocked_share``: ``blocked / overhead``, the part of the cost the metric shows (the rest is no wait: the
  background write's use of the cores, memory bandwidth and the kernel's writeback, taken from the training);
- ``steps``: the training steps' own time, ``on_train_batch_start`` to ``on_train_batch_end`` before any save
  (forward, backward, optimizer step with its waits at the step gate), summed over the fit, the slowest rank; and
  ``steps_extra``: that minus the same round's ``none`` fit: the steps' waits for the staging copies plus how much
  slower the steps ran beside a background write;
- ``cpu``: CPU seconds (user + system, every thread) the ranks' processes used during the fit, summed over ranks, and
  ``cpu_extra``: that minus the same round's ``none`` fit: the saves' own work, which on a machine the training keeps
  busy is taken from the training without any wait (the kernel's writeback threads are not in it).

With ``--out DIR`` it writes ``DIR/LOOP_COST.md`` (table, commit, date, machine, load average, command) and
``DIR/loop_cost.json``; the JSON goes to stdout in any case::

    python -m benchmarks.bench_loop_cost --mix huge --scale 0.5 --world-size 2 --steps 12 --every 3 --rounds 3 \\
        --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from typing import Any

try:
    from benchmarks.mixes import MIXES, make_module
    from benchmarks.provenance import stamp
    from benchmarks.trainer_runs import _barrier, _max_over_ranks, _remove, _timed, make_trainer, spawn
except ImportError:  # run as a script
    from mixes import MIXES, make_module
    from provenance import stamp
    from trainer_runs import _barrier, _max_over_ranks, _remove, _timed, make_trainer, spawn

METHODS = ("none", "sync", "async")


def _classes() -> tuple[type, type, type]:
    """A logger keeping rank 0's ``checkpoint/save_blocked_s``, a ``DCPModelCheckpoint`` timing its save calls and
    removals, and a callback timing the training steps."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import Logger

    from lightning_dcp import DCPModelCheckpoint

    class Blocked(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.blocked: list[float] = []

        @property
        def name(self) -> str:
            return "blocked"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            if "checkpoint/save_blocked_s" in metrics:
                self.blocked.append(metrics["checkpoint/save_blocked_s"])

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    class TimedCheckpoint(DCPModelCheckpoint):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.calls: list[float] = []
            self.removals: list[float] = []

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            started = time.perf_counter()
            ModelCheckpoint._save_checkpoint(self, trainer, filepath)
            self.calls.append(time.perf_counter() - started)

        def _remove_checkpoint(self, trainer: Any, filepath: str) -> None:
            started = time.perf_counter()
            super()._remove_checkpoint(trainer, filepath)
            self.removals.append(time.perf_counter() - started)

    class StepTimes(Callback):  # its on_train_batch_end runs before ModelCheckpoint's (Lightning orders those last)
        def __init__(self) -> None:
            self.seconds = 0.0

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seconds += time.perf_counter() - self.started

    return Blocked, TimedCheckpoint, StepTimes


def task(rank: int, world_size: int, workdir: str, mix: str, scale: float, rounds: int, steps: int, every: int) -> dict:
    """Every round's three fits on this rank; rank 0's result holds the slowest rank's times."""
    from lightning_dcp import DCPCheckpointIO
    from lightning_dcp.engine.save import memo

    blocked_logger, timed_checkpoint, step_times = _classes()
    runs: list[dict[str, dict[str, float]]] = []
    for round_ in range(rounds + 1):  # round 0 warms up (imports, first allocations), untimed
        order = METHODS[round_ % 3 :] + METHODS[: round_ % 3]
        row: dict[str, dict[str, float]] = {}
        for method in order:
            dirpath = os.path.join(workdir, f"{method}-{round_}")
            callbacks = [] if method == "none" else [timed_checkpoint(dirpath=dirpath, every_n_train_steps=every)]
            timer = step_times()
            trainer = make_trainer(
                world_size,
                max_steps=steps,
                callbacks=[timer, *callbacks],
                enable_checkpointing=method != "none",
                plugins=[DCPCheckpointIO(async_save=method == "async")],
            )
            logger = blocked_logger()
            trainer.loggers = [logger]
            module = make_module(mix, scale=scale, steps=steps)
            memo.forget_all()  # each fit plans its first save, as a fresh process would
            cpu = _cpu()
            _, seconds = _timed(functools.partial(trainer.fit, module))
            cpu = _sum_over_ranks(_cpu() - cpu)
            calls = [_max_over_ranks(c) for c in callbacks[0].calls] if callbacks else []
            removals = [_max_over_ranks(r) for r in callbacks[0].removals] if callbacks else []
            row[method] = {
                "seconds": seconds,
                "cpu": cpu,
                "steps": _max_over_ranks(timer.seconds),
                "blocked": sum(logger.blocked),
                "calls": sum(calls),
                "removals": sum(removals),
                "saves": len(calls),
                "logged": len(logger.blocked),
            }
            _barrier()
            if rank == 0:
                _remove(dirpath)
            del trainer, module, callbacks
            gc.collect()
        if round_ > 0:
            for method in ("sync", "async"):
                row[method]["overhead"] = row[method]["seconds"] - row["none"]["seconds"]
                row[method]["cpu_extra"] = row[method]["cpu"] - row["none"]["cpu"]
                row[method]["steps_extra"] = row[method]["steps"] - row["none"]["steps"]
            runs.append(row)
    return {"rounds": runs}


def _cpu() -> float:
    """CPU seconds (user + system) this process used so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sum_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _median(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(
    mix: str, workdir: str, *, world_size: int = 2, scale: float = 0.5, rounds: int = 3, steps: int = 12, every: int = 3
) -> dict[str, Any]:
    """Run the rounds (see the module docstring); medians with min-max over rounds, and every round."""
    load = os.getloadavg()
    res = spawn(task, world_size, workdir, mix=mix, scale=scale, rounds=rounds, steps=steps, every=every)
    runs = res["rounds"]
    out: dict[str, Any] = {
        "mix": mix,
        "scale": scale,
        "world_size": world_size,
        "steps": steps,
        "every": every,
        "rounds": runs,
        "load_average": {"start": list(load), "end": list(os.getloadavg())},
        "none_seconds": _median([r["none"]["seconds"] for r in runs]),
        "none_cpu": _median([r["none"]["cpu"] for r in runs]),
        "none_steps": _median([r["none"]["steps"] for r in runs]),
    }
    for method in ("sync", "async"):
        out[method] = {
            key: _median([r[method][key] for r in runs])
            for key in ("seconds", "overhead", "blocked", "calls", "removals", "steps_extra", "cpu_extra")
        }
        out[method]["blocked_share"] = _median(
            [r[method]["blocked"] / r[method]["overhead"] for r in runs if r[method]["overhead"] > 0] or [float("nan")]
        )
        out[method]["saves"] = runs[0][method]["saves"]
    out["async_over_sync_overhead"] = _median(
        [r["async"]["overhead"] / r["sync"]["overhead"] for r in runs if r["sync"]["overhead"] > 0] or [float("nan")]
    )
    return out


def _cell(summary: dict[str, float], digits: int = 2) -> str:
    return f"{summary['median']:.{digits}f} ({summary['min']:.{digits}f}-{summary['max']:.{digits}f})"


def report(result: dict[str, Any], *, command: str) -> str:
    """``LOOP_COST.md``: what was run, where, and the table (medians, min-max over rounds)."""
    lines = [
        "# What saving costs a fit: wall-time overhead against no saves, beside the summed `save_blocked_s`",
        "",
        f"Command: `{command}`",
        f"Commit: {result['commit']}. Date: {result['date']}. Machine: {result['machine']}.",
        f"Load average (1, 5, 15 min) at the start: {', '.join(f'{v:.1f}' for v in result['load_average']['start'])};"
        f" at the end: {', '.join(f'{v:.1f}' for v in result['load_average']['end'])}.",
        f"Workload: mix `{result['mix']}` at scale {result['scale']}, {result['world_size']} ranks (`dcp_ddp`, gloo),"
        f" {result['steps']} steps, a save every {result['every']} steps; {len(result['rounds'])} rounds after a"
        " warm-up, the three fits of a round back to back (order rotating).",
        "",
        f"Fit without saves: {_cell(result['none_seconds'])} s, its steps {_cell(result['none_steps'])} s,"
        f" {_cell(result['none_cpu'])} CPU seconds (all ranks).",
        "",
        "| saves | fit (s) | overhead vs no saves (s) | summed `save_blocked_s` (s) | summed save calls (s)"
        " | blocked / overhead | removals in the loop (s) | steps' own time vs no saves (s)"
        " | extra CPU vs no saves (s, all ranks) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method in ("sync", "async"):
        m = result[method]
        lines.append(
            f"| {method} ({m['saves']} saves) | {_cell(m['seconds'])} | {_cell(m['overhead'])} | {_cell(m['blocked'])}"
            f" | {_cell(m['calls'])} | {_cell(m['blocked_share'])} | {_cell(m['removals'])}"
            f" | {_cell(m['steps_extra'])} | {_cell(m['cpu_extra'])} |"
        )
    lines += [
        "",
        f"Async overhead / sync overhead, round by round: {_cell(result['async_over_sync_overhead'])}.",
        "",
        "Per round (seconds): "
        + "; ".join(
            ", ".join(
                f"{m} {r[m]['seconds']:.2f}" + (f" (blocked {r[m]['blocked']:.2f})" if m != "none" else "")
                for m in METHODS
            )
            for r in result["rounds"]
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", choices=MIXES, default="huge")
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write LOOP_COST.md and loop_cost.json into this directory")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    args = parser.parse_args(argv)
    stamped = stamp(argv)  # the code measured (at the start: files edited during the run do not count)
    command = stamped["command"]
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_loop_cost_", dir=os.path.abspath("."))
    try:
        result = run(
            args.mix,
            workdir,
            world_size=args.world_size,
            scale=args.scale,
            rounds=args.rounds,
            steps=args.steps,
            every=args.every,
        )
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {**stamped, **result}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "LOOP_COST.md"), "w") as f:
            f.write(report(result, command=command))
        with open(os.path.join(args.out, "loop_cost.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
