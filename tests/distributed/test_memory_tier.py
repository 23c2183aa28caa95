"""The memory tier on 4 real gloo processes as 2 simulated nodes of 2 ranks, each node its own area under /dev/shm.

One spawn saves three checkpoints (synchronously, then in the background) through ``Checkpointer.into_memory``; the
pytest process then checks what each area holds (own parts, replicas, the persisted one); fresh processes (a
restarted job) restore ``last`` after node 1's area is wiped and the durable directory removed, from node 0's
replicas alone; and at world size 2, from node 0's area. Whole-job kills: tests/integration/test_memory_tier.py.
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
import torch
import torch.distributed as dist

from harness.ranks import spawn
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.engine.tiers.parts import PartStore, complete
from lightning_dcp.engine.tiers.runs import RUN_FILE


def _tree(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"state_dict": {"w": torch.randn(512, 512, generator=g), "b": torch.randn(512, generator=g)}}


def _save(rank: int, world_size: int, base: str) -> None:
    dist.init_process_group("gloo")
    tier = MemoryTier(f"{base}/shm{rank // 2}", replicas=1, async_save=False, persist_every=2)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    for step in (1, 2, 3):
        tier.async_save = step == 3  # the last one in the background
        with checkpointer.into_memory():
            checkpointer.save(
                _tree(step), f"{base}/durable/step={step}", objects={"step": step}, collective=True, step=step
            )
    checkpointer.wait(collective=True)
    assert tier.topology.nodes == 2 and tier.topology.node == rank // 2
    assert set(tier.timings) >= {"write", "replicate"}
    checkpointer.close()


def _load(rank: int, world_size: int, base: str, ranks_per_node: int) -> None:
    dist.init_process_group("gloo")
    checkpointer = Checkpointer(CheckpointerConfig(memory=MemoryTier(f"{base}/shm{rank // ranks_per_node}")))
    checkpointer.memory_route.bind(Location(f"{base}/durable"))
    target = {"state_dict": {"w": torch.empty(512, 512), "b": torch.empty(512)}}
    loaded = checkpointer.load(f"{base}/durable/last", target=target, collective=True)
    expected = _tree(3)["state_dict"]
    assert all(torch.equal(target["state_dict"][k], v) for k, v in expected.items())
    assert loaded.objects["step"] == 3 and loaded.tier == "memory" and loaded.url.endswith("step=3")
    checkpointer.close()


@pytest.fixture
def base():
    path = f"/dev/shm/lightning_dcp-test-{uuid.uuid4().hex[:8]}"
    os.makedirs(path)  # the areas below it are made when the tier is set up
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.full
def test_memory_tier_replicates_and_restores_from_any_node(base):
    spawn(_save, 4, base)
    areas = [PartStore(f"{base}/shm{n}") for n in range(2)]
    for area in areas:  # each node: its own part and its peer's replica of the newest checkpoint only
        assert sorted((p.name, p.node) for p in area.parts()) == [("step=3", 0), ("step=3", 1)]
    assert complete([(0, p) for p in areas[0].parts()])[0][1] == "step=3"
    assert sorted(set(os.listdir(f"{base}/durable")) - {RUN_FILE}) == ["step=2"]  # persist_every=2: the second save
    assert Location(f"{base}/durable/step=2").is_committed()

    shutil.rmtree(f"{base}/shm1")  # node 1 lost with its memory, and no durable tier to fall back on
    for entry in set(os.listdir(f"{base}/durable")) - {RUN_FILE}:  # every durable checkpoint (the run stays)
        shutil.rmtree(f"{base}/durable/{entry}")
    spawn(_load, 4, base, 2)  # node 1 (an empty area) gets its part from node 0's replica
    spawn(_load, 2, base, 2)  # world size 2: one node, from its own part and the replica
