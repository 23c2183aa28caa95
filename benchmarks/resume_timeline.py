"""When each part of a resume runs on each rank, and where the interpreter's full collections fall.

``bench_trainer --tasks load`` gives each phase's total; this gives the order. It writes a checkpoint of ``--mix``
(``bench_trainer``'s ``task_prepare_load``), drops it from the page cache, and resumes it once with
``Trainer(strategy="dcp_ddp").fit(model, ckpt_path=...)`` in ``--world-size`` fresh processes, training ``--steps``
steps after ``on_train_start``. Each rank logs the seconds since its ``setup`` hook at which each wrapped part begins
(``+``) and ends (``-``): the page-cache prefetch thread, the strategy's ``model_to_device``, ``configure_ddp`` and
``load_checkpoint``, the targets, the probe and rank 0's broadcast of it, ``fill_pending``, the record index's plan
and reads, decoding the Trainer's state, both applies, every full (generation-2) collection (``gc2``) and every
training step. The ranks' logs are printed side by side.

``--pause-gc`` disables the collector from ``setup`` to ``on_train_start`` (to see where a paused collection goes).
``--promotions`` also counts, per part, the objects each generation-1 collection moves into the oldest generation
(what makes CPython 3.11 run a full collection once they exceed a quarter of that generation); counting costs time
of its own, so the timings of such a run are not comparable.

    python -m benchmarks.resume_timeline --mix conv --steps 4
    python -m benchmarks.resume_timeline --mix conv --steps 4 --pause-gc
    python -m benchmarks.resume_timeline --mix conv --steps 1 --promotions
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any


def _wrapper(events: list[tuple[str, float]], label: list[str]):
    def wrap(owner: Any, name: str, tag: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            outer, label[0] = label[0], tag
            events.append((tag + "+", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                events.append((tag + "-", time.perf_counter()))
                label[0] = outer

        setattr(owner, name, timed)

    return wrap


def task_timeline(
    rank: int,
    world_size: int,
    workdir: str,
    mix: str,
    scale: float,
    steps: int,
    pause_gc: bool,
    promotions: bool,
    saved_world_size: int | None = None,
) -> dict:
    """One resume on these fresh ranks of the checkpoint saved at ``saved_world_size`` (default: this one); every rank
    writes its log to ``workdir/timeline-<rank>.json``."""
    events: list[tuple[str, float]] = []
    label = ["imports"]
    promoted: collections.Counter[str] = collections.Counter()  # since the last full collection
    full: list[dict[str, Any]] = []  # per full collection: where it fell, the oldest generation's size, promoted
    young = [0]
    wrap = _wrapper(events, label)

    def on_collection(phase: str, info: dict[str, int]) -> None:
        generation = info.get("generation")
        if generation == 2:
            events.append(("gc2" + ("+" if phase == "start" else "-"), time.perf_counter()))
            if promotions and phase == "stop":
                full.append({"in": label[0], "oldest": len(gc.get_objects(2)), "promoted": dict(promoted)})
                promoted.clear()
        elif generation == 1 and promotions:
            if phase == "start":
                young[0] = len(gc.get_objects(0)) + len(gc.get_objects(1))
            else:
                promoted[label[0]] += young[0] - info["collected"]

    gc.callbacks.append(on_collection)
    from lightning.pytorch import Callback

    from benchmarks.mixes import make_module
    from benchmarks.trainer_runs import make_trainer
    from lightning_dcp.engine.load import index_load, page_cache, restore
    from lightning_dcp.trainer import strategies

    wrap(page_cache, "_fill", "prefetch")
    for name, tag in (("model_state_dict", "target-model"), ("parameters_by_fqn", "target-optimizer")):
        wrap(strategies, name, tag)
    for name, tag in (("load_model_state_dict", "apply-model"), ("load_optimizer_state_dict", "apply-optimizer")):
        wrap(strategies, name, tag)
    for name, tag in (
        ("on_rank0", "probe-broadcast"),
        ("probe", "probe"),
        ("fill_pending", "fill"),
        ("_finish", "decode"),
    ):
        wrap(restore, name, tag)
    wrap(index_load, "_plan", "plan")
    wrap(index_load, "_read_file", "read")
    start = [0.0]
    done: list[int] = []  # the steps trained since on_train_start

    class Timeline(Callback):
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            start[0] = time.perf_counter()
            label[0] = "restore"
            events.append(("setup", start[0]))
            for name, tag in (("model_to_device", "to-device"), ("configure_ddp", "ddp"), ("load_checkpoint", "load")):
                wrap(trainer.strategy, name, tag)
            if pause_gc:
                gc.disable()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if pause_gc:
                gc.enable()
            events.append(("on_train_start", time.perf_counter()))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            label[0] = f"step {len(done) + 1}"
            events.append((label[0] + "+", time.perf_counter()))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            done.append(batch_idx)
            events.append((f"step {len(done)}-", time.perf_counter()))
            if len(done) >= steps:
                trainer.should_stop = True

    label[0] = "model"
    module = make_module(mix, scale=scale)
    label[0] = "trainer"
    trainer = make_trainer(world_size, max_steps=10_000, callbacks=[Timeline()])
    label[0] = "fit before setup"
    trainer.fit(module, ckpt_path=os.path.join(workdir, f"resume-ws{saved_world_size or world_size}.ckpt"))
    gc.callbacks.remove(on_collection)
    events = [(tag, at - start[0]) for tag, at in events]
    log = {"events": events, "full": full, "promoted_since": dict(promoted)}
    with open(os.path.join(workdir, f"timeline-{rank}.json"), "w") as f:
        json.dump(log, f)
    return {}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_trainer import task_prepare_load
    from benchmarks.mixes import MIXES
    from benchmarks.trainer_runs import evict, spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", choices=MIXES, default="conv")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=4, help="training steps after on_train_start")
    parser.add_argument("--pause-gc", action="store_true")
    parser.add_argument("--promotions", action="store_true")
    parser.add_argument(
        "--saved-world-size", type=int, default=None, help="save at this world size (default: --world-size)"
    )
    args = parser.parse_args(argv)
    saved = args.saved_world_size or args.world_size
    workdir = tempfile.mkdtemp(prefix="resume_timeline_", dir=os.path.abspath("."))
    try:
        common = {"mix": args.mix, "scale": args.scale}
        spawn(task_prepare_load, saved, workdir, **common)
        evict(os.path.join(workdir, f"resume-ws{saved}.ckpt"))
        options = {"steps": args.steps, "pause_gc": args.pause_gc, "promotions": args.promotions}
        options["saved_world_size"] = saved
        spawn(task_timeline, args.world_size, workdir, **common, **options)
        logs = []
        for rank in range(args.world_size):
            with open(os.path.join(workdir, f"timeline-{rank}.json")) as f:
                logs.append(json.load(f))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print("  ".join(f"{'rank ' + str(rank):>30s}" for rank in range(len(logs))))
    for i in range(max(len(log["events"]) for log in logs)):
        cells = [log["events"][i] if i < len(log["events"]) else ("", None) for log in logs]
        print("  ".join(" " * 30 if at is None else f"{at:8.3f} {tag:>21s}" for tag, at in cells))
    if args.promotions:
        for rank, log in enumerate(logs):
            for collection in log["full"]:
                print(
                    f"rank {rank}: a full collection in {collection['in']!r}, oldest generation then"
                    f" {collection['oldest']} objects; moved into it since the last one: {collection['promoted']}"
                )
            print(
                f"rank {rank}: moved into the oldest generation since its last full collection: {log['promoted_since']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
