"""A full memory area on 2 real gloo processes as 2 simulated nodes, each area a real 6 MiB tmpfs (issue 40 item 2).

Each rank's part is ~1.8 MB: an area holds one checkpoint's own part and its replica, plus the next save's own part,
but not that save's replica. The replica fails on both nodes (``ENOSPC`` when its file is created, before any byte is
sent): every rank raises the same ``CheckpointError`` at the next call (no rank left waiting for its peer), the save
is dropped from both areas and the older one stays. A resume where the newest checkpoint cannot be assembled in the
full areas (its parts are held, each on its own node only) falls back to the older one, with a warning, and leaves
no ``.load-*`` directory. Mounting needs root (else skipped).
"""

from __future__ import annotations

import os
import subprocess
import warnings

import pytest
import torch
import torch.distributed as dist

from harness.ranks import spawn
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.engine.tiers.parts import PartStore
from lightning_dcp.errors import CheckpointError


def _tree(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {"state_dict": {f"w{rank}": torch.randn(450, 1000, generator=g)}}  # 1.8 MB per rank, each its own FQN


def _save(rank: int, world_size: int, base: str, out: str) -> None:
    dist.init_process_group("gloo")
    tier = MemoryTier(f"{base}/shm{rank}", replicas=1, async_save=False, persist_every=0)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    seen = []
    for step in (2, 4):
        try:
            with checkpointer.into_memory():
                checkpointer.save(
                    _tree(step, rank), f"{base}/durable/step={step}", objects={"step": step}, collective=True, step=step
                )
            checkpointer.wait(collective=True)
            seen.append("saved")
        except CheckpointError as err:
            seen.append(f"{type(err).__name__}: {err}")
    checkpointer.close()
    torch.save(seen, f"{out}/{rank}.pt")


def _fill(rank: int, world_size: int, base: str) -> None:
    """Step 2 replicated, step 4 on each node only (``replicas=0``, ``keep=2``): the areas are nearly full."""
    dist.init_process_group("gloo")
    tier = MemoryTier(f"{base}/shm{rank}", replicas=1, keep=2, async_save=False, persist_every=0)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    for step in (2, 4):
        tier.replicas = 1 if step == 2 else 0
        with checkpointer.into_memory():
            checkpointer.save(
                _tree(step, rank), f"{base}/durable/step={step}", objects={"step": step}, collective=True, step=step
            )
        checkpointer.wait(collective=True)
    checkpointer.close()


def _resume(rank: int, world_size: int, base: str, out: str) -> None:
    dist.init_process_group("gloo")
    checkpointer = Checkpointer(CheckpointerConfig(memory=MemoryTier(f"{base}/shm{rank}")))
    checkpointer.memory_route.bind(Location(f"{base}/durable"))
    target = {"state_dict": {f"w{r}": torch.empty(450, 1000) for r in range(2)}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = checkpointer.load(f"{base}/durable/last", target=target, collective=True)
    expected = {**_tree(2, 0)["state_dict"], **_tree(2, 1)["state_dict"]}
    exact = all(torch.equal(target["state_dict"][k], v) for k, v in expected.items()) and loaded.objects["step"] == 2
    checkpointer.close()
    torch.save((loaded.url, loaded.tier, exact, [str(w.message) for w in caught]), f"{out}/{rank}.pt")


@pytest.fixture
def areas(tmp_path):
    base = str(tmp_path)
    mounted = []
    for n in range(2):
        os.makedirs(f"{base}/shm{n}")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", f"{base}/shm{n}"], capture_output=True)
        if done.returncode != 0:
            for path in mounted:
                subprocess.run(["umount", "-l", path], check=False)
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(f"{base}/shm{n}")
    yield base
    for path in mounted:
        subprocess.run(["umount", "-l", path], check=False)


def _hidden(base: str) -> list[str]:
    return sorted(e for n in range(2) for e in os.listdir(f"{base}/shm{n}") if e.startswith("."))


def test_a_replica_that_does_not_fit_fails_every_rank_alike_and_keeps_the_older_checkpoint(areas, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spawn(_save, 2, areas, str(out), timeout=90)
    seen = [torch.load(out / f"{r}.pt") for r in range(2)]
    assert seen[0][0] == seen[1][0] == "saved"
    assert seen[0][1] == seen[1][1]  # the same error on both ranks
    assert seen[0][1].startswith("CheckpointError: Replicating 'step=4'") and "No space left" in seen[0][1]
    for n in range(2):  # step 4 dropped on both nodes, step 2 (own part and replica) kept, nothing half-written
        assert sorted((p.name, p.node) for p in PartStore(f"{areas}/shm{n}").parts()) == [("step=2", 0), ("step=2", 1)]
    assert _hidden(areas) == []


@pytest.mark.full
def test_a_resume_in_full_areas_falls_back_to_the_older_complete_checkpoint(areas, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    spawn(_fill, 2, areas, timeout=90)
    for n in range(2):
        assert {p.name for p in PartStore(f"{areas}/shm{n}").parts()} == {"step=2", "step=4"}
    spawn(_resume, 2, areas, str(out), timeout=90)
    for r in range(2):
        url, tier, exact, warned = torch.load(out / f"{r}.pt")
        assert (url.rsplit("/", 1)[-1], tier, exact) == ("step=2", "memory", True)
        if r == 0:
            assert any("'step=4'" in w and "No space left" in w for w in warned), warned
    assert _hidden(areas) == []
