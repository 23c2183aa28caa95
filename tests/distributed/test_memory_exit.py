"""A run with the memory tier ends with exit code 0 on every rank, whichever rank leaves first.

Gloo's worker threads keep each finished collective until they drop it, and dropping one whose tensors Python created
(the tier's ``all_gather_object`` and ``broadcast_object_list``) takes the GIL: a worker that does so while the
interpreter finalizes aborts the process ("terminate called without an active exception", SIGABRT) after a run that
finished correctly. The memory tier's ``close`` (the strategy's teardown, or at exit) therefore leaves its group in a
defined order: a barrier, then the group destroyed while the interpreter is alive, its worker threads joined.

4 real processes (2 simulated nodes of 2 ranks, each node its own area under /dev/shm), started as a launcher
starts them, save into memory and close; fresh processes restore the newest checkpoint from memory, and leave at
different times without destroying the default group (as a Trainer's processes do).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import weakref

import pytest
import torch

from harness.ranks import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"state_dict": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}}


def _gloo_threads() -> int:
    """Gloo worker threads of this process (two per gloo process group)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            continue
    return sum(name == "pt_gloo_runloop" for name in names)


def _rank(base: str, phase: str) -> dict:
    import torch.distributed as dist

    from lightning_dcp.engine import Checkpointer, CheckpointerConfig
    from lightning_dcp.engine.storage.location import Location
    from lightning_dcp.engine.tiers.memory import MemoryTier

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tier = MemoryTier(f"{base}/shm{rank // 2}", replicas=1, persist_every=0)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    record: dict = {"rank": rank}
    if phase == "save":
        for step in (1, 2):
            tier.async_save = step == 2  # the last one in the background, as every few steps in training
            with checkpointer.into_memory():
                checkpointer.save(
                    _tree(step), f"{base}/durable/step={step}", objects={"step": step}, collective=True, step=step
                )
    else:
        checkpointer.memory_route.bind(Location(f"{base}/durable"))
        target = {"state_dict": {"w": torch.empty(256, 256), "b": torch.empty(256)}}
        loaded = checkpointer.load(f"{base}/durable/last", target=target, collective=True)
        expected = _tree(2)["state_dict"]
        record["equal"] = all(torch.equal(target["state_dict"][k], v) for k, v in expected.items())
        record["tier"], record["step"] = loaded.tier, loaded.objects["step"]
    group = weakref.ref(tier.group)
    record["threads_open"] = _gloo_threads()
    checkpointer.close()  # what the strategy's teardown calls
    record["threads_closed"] = _gloo_threads()
    record["group_alive"] = group() is not None
    return record


def _launch(base: str, phase: str) -> list[dict]:
    port = free_port()
    procs = []
    for rank in range(4):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
        env.update(WORLD_SIZE="4", LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2))
        cmd = [sys.executable, "-m", "tests.distributed.test_memory_exit", base, phase]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{out[-3000:]}"
        assert "terminate called" not in out, out[-3000:]
    with open(f"{base}/{phase}.jsonl") as f:
        return sorted((json.loads(line) for line in f), key=lambda r: r["rank"])


@pytest.mark.full
def test_every_rank_exits_cleanly_after_saving_and_restoring_from_memory():
    base = f"/dev/shm/lightning_dcp-test-{uuid.uuid4().hex[:8]}"
    try:
        for phase in ("save", "load"):
            records = _launch(base, phase)
            assert [r["rank"] for r in records] == [0, 1, 2, 3]
            for r in records:  # the tier's group is gone with its two worker threads, the default group's stay
                assert not r["group_alive"] and r["threads_closed"] == r["threads_open"] - 2 == 2, r
        assert all(r["equal"] and r["tier"] == "memory" and r["step"] == 2 for r in records), records
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    base_dir, phase_name = sys.argv[1:3]
    result = _rank(base_dir, phase_name)
    with open(f"{base_dir}/{phase_name}.jsonl", "a") as out:
        out.write(json.dumps(result) + "\n")
    time.sleep(0.3 * result["rank"])  # ranks leave at different times; rank 0 (the store's host) first
