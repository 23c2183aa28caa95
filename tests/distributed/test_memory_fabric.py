"""Fabric with the memory tier, on 4 real gloo processes as 2 simulated nodes of 2 ranks (an area each under /dev/shm).

``DCPDDPStrategy(memory=MemoryTier(...))`` is the one line: every ``fabric.save`` goes to memory, replicated to the
other node, every 2nd persisted. Then node 1's area is wiped and the durable directory removed, and fresh processes
``fabric.load(".../last", state)``: the newest checkpoint comes from node 0's area (node 1's part from its replica),
with the exact weights and optimizer state (another world size from a replica: tests/distributed/test_memory_tier.py).
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest

from harness.ranks import spawn
from lightning_dcp import MemoryTier
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.parts import PartStore
from lightning_dcp.engine.tiers.runs import RUN_FILE
from lightning_dcp.fabric import DCPDDPStrategy
from tests._trainer import assert_same, load_result, save_result
from tests.distributed.test_fabric import _fabric, _full, _setup, _train
from tests.distributed.test_memory_tier import base  # noqa: F401  (the fixture: a fresh directory under /dev/shm)


def _save_worker(rank: int, world_size: int, root: str) -> None:
    tier = MemoryTier(f"{root}/shm{rank // 2}", replicas=1, persist_every=2)
    fabric = _fabric(world_size, DCPDDPStrategy(memory=tier))
    model, optimizer = _setup(fabric)
    for step in (2, 4, 6):
        _train(fabric, model, optimizer, 2)
        fabric.save(f"{root}/durable/step-{step}", {"model": model, "optimizer": optimizer, "step": step})
    save_result(root, "saved", rank, _full(model, optimizer))
    fabric.strategy.wait_for_save()
    assert tier.topology.nodes == 2 and {"write", "replicate"} <= set(tier.timings)


def _load_worker(rank: int, world_size: int, root: str) -> None:
    fabric = _fabric(world_size, DCPDDPStrategy(memory=MemoryTier(f"{root}/shm{rank // 2}")))
    model, optimizer = _setup(fabric, seed=99)  # other weights: everything must come from memory
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(f"{root}/durable/last", state) == {}
    assert state["step"] == 6
    assert_same(_full(model, optimizer), load_result(root, "saved"), "restored from memory")
    _train(fabric, model, optimizer, 1)  # training goes on


def test_fabric_saves_to_memory_and_restores_from_a_replica(base):  # noqa: F811
    spawn(_save_worker, 4, base)
    for node in range(2):  # each node: its own part and the other's replica of the newest save only
        assert sorted((p.name, p.node) for p in PartStore(f"{base}/shm{node}").parts()) == [
            ("step-6", 0),
            ("step-6", 1),
        ]
    assert sorted(set(os.listdir(f"{base}/durable")) - {RUN_FILE}) == ["step-4"]  # persist_every=2: the second save
    assert Location(f"{base}/durable/step-4").is_committed()

    shutil.rmtree(f"{base}/shm1")  # node 1 lost with its memory, and no durable copy of step 6 anywhere
    for entry in set(os.listdir(f"{base}/durable")) - {RUN_FILE}:  # every durable checkpoint (the run stays)
        shutil.rmtree(f"{base}/durable/{entry}")
    spawn(_load_worker, 4, base)  # node 1 (an empty area) gets its part from node 0's replica
    assert not any(name.startswith(".load") for name in os.listdir(f"{base}/shm0"))  # assembled copies removed
    assert_same(load_result(base, "saved", 3), load_result(base, "saved"), "the ranks' saved states")  # DDP: alike


class _Preempted(Exception):
    pass


def _preempted_worker(rank: int, world_size: int, root: str) -> None:
    def user_handler(signum, frame):  # stands for what SIGTERM did before (the default ends the process)
        raise _Preempted

    signal.signal(signal.SIGTERM, user_handler)
    tier = MemoryTier(f"{root}/shm{rank}", replicas=1, persist_every=0)  # never persisted on a count
    fabric = _fabric(world_size, DCPDDPStrategy(memory=tier))
    model, optimizer = _setup(fabric)
    saved = []
    try:
        for step in (1, 2, 3, 4):
            _train(fabric, model, optimizer, 1)
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # one rank preempted: recorded, training goes on
            saved.append(step)
            save_result(root, f"saved-{step}", rank, _full(model, optimizer))
            fabric.save(f"{root}/durable/step-{step}", {"model": model, "optimizer": optimizer, "step": step})
    except _Preempted:
        save_result(root, "stopped", rank, {"after": saved[-1]})
    assert signal.getsignal(signal.SIGTERM) is user_handler  # the handler that was there before is back


def _durable_worker(rank: int, world_size: int, root: str) -> None:
    fabric = _fabric(world_size, DCPDDPStrategy())
    model, optimizer = _setup(fabric, seed=99)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(f"{root}/durable/step-3", state)
    assert state["step"] == 3
    assert_same(_full(model, optimizer), load_result(root, "saved-3"), "persisted at SIGTERM")


@pytest.mark.full
def test_fabric_persists_the_newest_memory_checkpoint_at_sigterm_then_stops_every_rank(base):  # noqa: F811
    spawn(_preempted_worker, 2, base)
    assert [load_result(base, "stopped", r)["after"] for r in (0, 1)] == [3, 3]  # every rank, at the same save
    assert sorted(set(os.listdir(f"{base}/durable")) - {RUN_FILE}) == [
        "step-3"
    ]  # the newest memory checkpoint, and only it
    assert Location(f"{base}/durable/step-3").is_committed()
    shutil.rmtree(f"{base}/shm0")
    shutil.rmtree(f"{base}/shm1")  # the machines are gone: the durable copy is all there is
    spawn(_durable_worker, 2, base)
