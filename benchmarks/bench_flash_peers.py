"""Memory tier side by side with DLRover's flash checkpoint: the loop's stall per save and the restore from memory.

The same workload for both: 2 ranks over gloo (DDP-like: every rank holds the whole state), the ``gpt2`` mix of
:mod:`benchmarks.mixes` (GPT-2 small's shapes, 124 M parameters) after one AdamW step: 1.49 GB of model and optimizer
state, as Lightning's checkpoint dict holds it (``state_dict`` + ``optimizer_states``).

- ``ours_sync`` / ``ours_async``: ``Checkpointer`` with a ``MemoryTier`` on ``/dev/shm`` (what ``MemoryCheckpoint``
  calls; one node, K=0; each rank writes its half of the tensors), a save before every other training step;
  ``stall`` is the save call, ``step_wait`` how much longer the ``optimizer.step()`` right after the save (no forward
  and backward in between to hide the copies behind: the worst case) took than the next one (paired; an async
  save's pending copies hold the optimizer step);
- ``dlrover``: ``DdpCheckpointer.save_checkpoint(storage_type=MEMORY)`` (local rank 0 copies the whole state into one
  shared-memory segment; a forked saver process serves its metadata), one save per training step;
- restores, each into 2 fresh processes that built the model and optimizer: ``ours`` loads ``last`` from the memory
  area (checksums verified), ``dlrover`` calls ``load_checkpoint()`` and ``load_state_dict`` on model and optimizer.
  Without ``dlrover-run`` (its elastic agent, which keeps the saver alive across worker restarts) DLRover's segment
  metadata dies with the processes, so fresh processes read its newest checkpoint from disk (``save_to_storage``
  before); ``dlrover_same_process`` is its restore from memory in the processes that saved. Every restore checks the
  restored tensors against the saved ones.

Needs ``dlrover`` (+ ``grpcio``, which it does not declare) importable; install them in a separate environment (see
benchmarks/README.md), never in the project's. Without them the benchmark says so and exits 0. Not part of CI.

``python -m benchmarks.bench_flash_peers --repeats 5 --restores 2``; prints one JSON object (slowest rank of
each figure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.mixes import make_module
from harness.ranks import spawn
from lightning_dcp import MemoryTier
from lightning_dcp.engine import Checkpointer, CheckpointerConfig, Location


def _missing() -> list[str]:
    return [name for name in ("dlrover", "grpc") if importlib.util.find_spec(name) is None]


def _trained(mix: str, scale: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., float]]:
    """The module and its AdamW after one step, and a function running one more training step and timing its
    ``optimizer.step()`` (where an async save's pending copies hold the loop)."""
    module = make_module(mix, scale=scale, steps=4)
    optimizer = module.configure_optimizers()
    batch = next(iter(module.train_dataloader()))

    def step(skip_backward: bool = False) -> float:
        if not skip_backward:  # the gradients of the last backward stay: AdamW steps again with them
            optimizer.zero_grad(set_to_none=True)
            module.training_step(batch, 0).backward()
        started = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - started

    step()
    return module, optimizer, step


def _tree(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}


def _digest(tree: dict) -> list[float]:
    """Sums of every tensor (restores compare against the saved values)."""
    flat = list(tree["state_dict"].values())
    flat += [t for s in tree["optimizer_states"][0]["state"].values() for t in s.values() if torch.is_tensor(t)]
    return [float(t.double().sum()) for t in flat]


def _loop(step: Callable[..., float], save: Callable[[int], None], repeats: int) -> dict:
    """Median stall of ``save()`` and how much longer the training step after it took than the next one (paired)."""
    stalls, waits, plain = [], [], []
    for i in range(repeats + 2):
        dist.barrier()
        started = time.perf_counter()
        save(i)
        stall = time.perf_counter() - started
        after = step(skip_backward=True)  # no forward and backward to hide the copies behind
        plain_step = step()  # no save in flight: an async save's copies were waited for by the step before
        if i >= 2:  # two warm-ups: the first saves allocate and fault in their pages
            stalls.append(stall)
            waits.append(max(0.0, after - plain_step))
            plain.append(plain_step)
    return {
        "stall": statistics.median(stalls),
        "step_wait": statistics.median(waits),
        "plain_step": statistics.median(plain),
    }


def _ours_save(rank: int, world: int, area: str, disk: str, mix: str, scale: float, repeats: int, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    module, optimizer, step = _trained(mix, scale)
    result = {"state_bytes": sum(t.nbytes for t in _flat_tensors(_tree(module, optimizer)))}
    memcpy_buffers = [torch.empty_like(t) for t in _flat_tensors(_tree(module, optimizer))]
    copies = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for b, t in zip(memcpy_buffers, _flat_tensors(_tree(module, optimizer)), strict=True):
            b.copy_(t)
        copies.append(time.perf_counter() - started)
    result["memcpy_whole_state"] = statistics.median(copies[1:])
    del memcpy_buffers
    for mode in ("sync", "async"):
        tier = MemoryTier(area, replicas=0, persist_every=0, async_save=mode == "async")
        checkpointer = Checkpointer(CheckpointerConfig(memory=tier))

        def save(i: int, checkpointer: Checkpointer = checkpointer, mode: str = mode) -> None:
            with checkpointer.into_memory():
                tree = _tree(module, optimizer)
                checkpointer.save(tree, f"{disk}/ours/{mode}-{i}", objects={"global_step": i}, collective=True, step=i)

        result[mode] = _loop(step, save, repeats)
        if mode == "async":  # the newest checkpoint holds the state the restores check
            save(repeats + 2)
            result["digest"] = _digest(_tree(module, optimizer))
        checkpointer.close()
    _report(rank, world, result, out)


def _ours_restore(rank: int, world: int, area: str, disk: str, mix: str, scale: float, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    module, optimizer, _ = _trained(mix, scale)
    module.apply(_perturb)
    checkpointer = Checkpointer(CheckpointerConfig(memory=MemoryTier(area, replicas=0)))
    checkpointer.memory_route.bind(Location(f"{disk}/ours"))
    dist.barrier()
    started = time.perf_counter()
    loaded = checkpointer.load(f"{area}/last", target=_tree(module, optimizer), collective=True)
    seconds = time.perf_counter() - started
    checkpointer.close()
    _report(rank, world, {"seconds": seconds, "tier": loaded.tier, "digest": _digest(_tree(module, optimizer))}, out)


def _dlrover_save(rank: int, world: int, disk: str, mix: str, scale: float, repeats: int, out: str) -> None:
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    module, optimizer, step = _trained(mix, scale)
    checkpointer = DdpCheckpointer(f"{disk}/dlrover")

    def save(i: int) -> None:
        state = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
        checkpointer.save_checkpoint(i, state, storage_type=StorageType.MEMORY)

    result = {"sync": _loop(step, save, repeats)}
    save(repeats + 2)  # the newest checkpoint holds the state the restores check
    digest = _digest(_tree(module, optimizer))
    # Restore from memory in these processes (what it offers without its elastic agent).
    module.apply(_perturb)
    dist.barrier()
    started = time.perf_counter()
    state = checkpointer.load_checkpoint()
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    result["same_process_restore"] = time.perf_counter() - started
    result["same_process_equal"] = _digest(_tree(module, optimizer)) == digest
    # The newest state to disk, for the fresh processes.
    step_number = repeats + 2
    state = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
    checkpointer.save_checkpoint(step_number, state, storage_type=StorageType.DISK)
    _wait_tracker(f"{disk}/dlrover", step_number)
    result["digest"] = digest
    _report(rank, world, result, out)


def _wait_tracker(directory: str, step: int, timeout: float = 600.0) -> None:
    """Poll DLRover's tracker file until its saver process reports ``step`` persisted (it offers no future to wait
    on; its own ``wait_latest_checkpoint`` fails when the file does not exist yet)."""
    tracker = os.path.join(directory, "dlrover_latest.txt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(tracker) as f:
                if f.read().strip() == str(step):
                    dist.barrier()
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"DLRover's saver did not persist step {step} in {timeout} s")


def _dlrover_restore(rank: int, world: int, disk: str, mix: str, scale: float, out: str) -> None:
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    module, optimizer, _ = _trained(mix, scale)
    module.apply(_perturb)
    checkpointer = DdpCheckpointer(f"{disk}/dlrover")
    dist.barrier()
    started = time.perf_counter()
    state = checkpointer.load_checkpoint()
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    seconds = time.perf_counter() - started
    _report(rank, world, {"seconds": seconds, "digest": _digest(_tree(module, optimizer))}, out)


def _perturb(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.add_(1.0)


def _flat_tensors(tree: dict) -> list[torch.Tensor]:
    flat = list(tree["state_dict"].values())
    return flat + [t for s in tree["optimizer_states"][0]["state"].values() for t in s.values() if torch.is_tensor(t)]


def _report(rank: int, world: int, result: dict, out: str) -> None:
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def _run(fn, *args) -> list[dict]:
    out = args[-1]
    spawn(fn, 2, *args, timeout=1800, fresh=True)
    with open(out) as f:
        return json.load(f)


def _worst(ranks: list[dict], *keys: str) -> float:
    values = []
    for r in ranks:
        for k in keys:
            r = r[k]
        values.append(r)
    return max(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mix", default="gpt2")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--restores", type=int, default=2, help="restores of each, alternating")
    args = parser.parse_args(argv)
    missing = _missing()
    if missing:
        print(
            f"bench_flash_peers: skipped, {' and '.join(missing)} not importable. Install dlrover and grpcio in a "
            "separate environment (torch pinned), never in the project's (see benchmarks/README.md)."
        )
        return 0
    area = f"/dev/shm/lightning_dcp-peers-{uuid.uuid4().hex[:8]}"
    disk = tempfile.mkdtemp(prefix="lightning_dcp-peers-")
    out = f"{disk}/result.json"
    report: dict = {"mix": args.mix, "scale": args.scale, "ranks": 2}
    segment = "/dev/shm/ckpt_shm_0"  # DLRover's segment of local shard 0: it outlives its processes
    segment_before = os.path.exists(segment)
    try:
        saved = _run(_ours_save, area, disk, args.mix, args.scale, args.repeats, out)
        report["state_gb"] = saved[0]["state_bytes"] / 1e9
        report["memcpy_whole_state"] = _worst(saved, "memcpy_whole_state")
        for mode in ("sync", "async"):
            report[f"ours_{mode}"] = {k: _worst(saved, mode, k) for k in ("stall", "step_wait", "plain_step")}
        flash = _run(_dlrover_save, disk, args.mix, args.scale, args.repeats, out)
        report["dlrover"] = {k: _worst(flash, "sync", k) for k in ("stall", "step_wait", "plain_step")}
        report["dlrover_same_process_restore"] = {
            "seconds": _worst(flash, "same_process_restore"),
            "equal": all(r["same_process_equal"] for r in flash),
        }
        ours, theirs = [], []
        for _ in range(args.restores):  # alternating, paired on a loaded machine
            restored = _run(_ours_restore, area, disk, args.mix, args.scale, out)
            ours.append(_worst(restored, "seconds"))
            assert restored[0]["tier"] == "memory", restored[0]["tier"]
            assert all(r["digest"] == s["digest"] for r, s in zip(restored, saved, strict=True)), "ours: not restored"
            fresh = _run(_dlrover_restore, disk, args.mix, args.scale, out)
            theirs.append(_worst(fresh, "seconds"))
            assert all(r["digest"] == s["digest"] for r, s in zip(fresh, flash, strict=True)), "dlrover: not restored"
        report["ours_restore_fresh_from_memory"] = {"median": statistics.median(ours), "all": ours}
        report["dlrover_restore_fresh_from_disk"] = {"median": statistics.median(theirs), "all": theirs}
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(area, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        if not segment_before and os.path.exists(segment):
            os.unlink(segment)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
