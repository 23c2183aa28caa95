"""The memory tier's part format (engine/tiers/parts.py): commit by rename, what counts as restorable, eviction."""

from __future__ import annotations

import os

import torch

from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.format.marker import encode_commit
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.engine.tiers.parts import PartStore, complete


def _marker(counter: int, files: dict[str, int]) -> bytes:
    entries = {name: {"size": size, "records": [[0, size, 1]]} for name, size in files.items()}
    return encode_commit(metadata_bytes=b"meta", files=entries, order={"counter": counter, "step": counter})


def _commit(store: PartStore, name: str, node: int, marker: bytes, files: list[str]) -> str:
    staging = store.staging(name, node, "t0k3n")
    store.take_slot(staging)
    for f in files:
        with open(os.path.join(staging, f), "wb") as out:
            out.write(b"x" * 4)
    return store.commit(staging, name=name, node=node, nodes=2, files=files, metadata=b"meta", marker=marker)


def test_parts_are_restorable_only_when_every_node_part_is_held(tmp_path):
    a, b = PartStore(str(tmp_path / "a")), PartStore(str(tmp_path / "b"))
    one = _marker(1, {"__0_0.distcp": 4, "__1_0.distcp": 4})
    two = _marker(2, {"__0_0.distcp": 4, "__1_0.distcp": 4})
    _commit(a, "s1", 0, one, ["__0_0.distcp"])
    _commit(b, "s1", 1, one, ["__1_0.distcp"])
    _commit(a, "s2", 0, two, ["__0_0.distcp"])  # node 1 died before committing its part of s2
    parts = [(0, p) for p in a.parts()] + [(1, p) for p in b.parts()]
    assert [name for _, name, _ in complete(parts)] == ["s1"]
    _commit(a, "s2", 1, two, ["__1_0.distcp"])  # a replica of node 1's part on node a
    assert [name for _, name, _ in complete([(0, p) for p in a.parts()])] == ["s2"]  # s1: part 1 is on b only
    # a staging directory (a save or replica cut short) is never a part, and is cleaned up
    os.makedirs(a.staging("s3", 0, "dead"))
    assert {p.name for p in a.parts()} == {"s1", "s2"}
    assert len(a.remove_stale()) == 1


def test_a_torn_part_is_not_listed_and_an_evicted_one_becomes_a_free_slot(tmp_path):
    store = PartStore(str(tmp_path))
    path = _commit(store, "s1", 0, _marker(1, {"__0_0.distcp": 4}), ["__0_0.distcp"])
    part = store.read("s1@0")
    assert part is not None and part.files == ["__0_0.distcp"] and part.key[0] == 1
    store.uncommit(path)  # a removal cut short: the marker goes first
    assert store.parts() == []
    path = _commit(store, "s2", 0, _marker(2, {"__0_0.distcp": 4}), ["__0_0.distcp"])
    store.free(store.read("s2@0"), slots=1)
    assert store.parts() == [] and len(store.free_slots()) == 1
    slot_file = os.path.join(store.free_slots()[0], "__0_0.distcp")
    inode = os.stat(slot_file).st_ino
    staging = store.staging("s3", 0, "abc")
    store.take_slot(staging)  # the next save reuses the slot's files (and their pages)
    assert os.stat(os.path.join(staging, "__0_0.distcp")).st_ino == inode and store.free_slots() == []


def _mixed(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {
            "odd": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),  # 7 bytes: the next record's offset
            "bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16),
            "f16": torch.randn(3, 1000, generator=g).to(torch.float16),
            "i64": torch.randint(0, 1 << 40, (300,), generator=g),
            "mask": torch.rand(129, generator=g) > 0.5,
            "scalar": torch.tensor(float(seed)),
            "empty": torch.empty(0, 4),
            "big": torch.randn(700, 1024, generator=g),  # several 1 MiB pieces, the last one partial
        }
    }


def test_a_memory_save_copies_every_dtype_exactly_and_reuses_its_slot(tmp_path):
    tier = MemoryTier(tmp_path / "shm", replicas=0, async_save=False, persist_every=0)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    checkpointer.memory_route.bind(Location(str(tmp_path / "durable")))
    for seed in (1, 2, 3):  # the third save overwrites the first one's files through the free slot
        with checkpointer.into_memory():
            checkpointer.save(_mixed(seed), str(tmp_path / "durable" / f"s{seed}"), objects={"seed": seed}, step=seed)
        target = {"state_dict": {k: torch.empty_like(v) for k, v in _mixed(0)["state_dict"].items()}}
        loaded = checkpointer.load(str(tmp_path / "shm" / "last"), target=target)
        assert loaded.tier == "memory" and loaded.objects["seed"] == seed
        for key, value in _mixed(seed)["state_dict"].items():
            assert target["state_dict"][key].dtype == value.dtype and torch.equal(target["state_dict"][key], value), key
    assert [p.name for p in tier.store.parts()] == ["s3"] and len(tier.store.free_slots()) == 1
    checkpointer.close()


def test_a_sync_memory_save_holds_the_state_of_its_call_though_hashed_and_committed_behind_it(tmp_path):
    """The call copies; the digests are taken from the area afterwards: changes after the call never reach it."""
    tier = MemoryTier(tmp_path / "shm", replicas=0, async_save=False, persist_every=0)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    checkpointer.memory_route.bind(Location(str(tmp_path / "durable")))
    state = _mixed(4)
    expected = {k: v.clone() for k, v in state["state_dict"].items()}
    with checkpointer.into_memory():
        checkpointer.save(state, str(tmp_path / "durable" / "s4"), objects={"seed": 4}, step=4)
    for value in state["state_dict"].values():  # at once, while the save hashes and commits in the background
        if value.dtype.is_floating_point:
            value.add_(1.0)
        else:
            value.zero_()
    assert tier.timings["stage"] > 0
    checkpointer.wait()
    assert tier.timings["write"] >= tier.timings["stage"]
    target = {"state_dict": {k: torch.empty_like(v) for k, v in expected.items()}}
    loaded = checkpointer.load(str(tmp_path / "shm" / "last"), target=target)  # every record checked on read
    assert loaded.tier == "memory" and loaded.url.endswith("s4")
    assert all(torch.equal(target["state_dict"][k], v) for k, v in expected.items())
    checkpointer.close()


def test_the_optimizer_step_after_an_async_memory_save_waits_for_its_copy_and_never_reaches_it(tmp_path):
    tier = MemoryTier(tmp_path / "shm", replicas=0, async_save=True, persist_every=0)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    checkpointer.memory_route.bind(Location(str(tmp_path / "durable")))
    weight = torch.nn.Parameter(torch.randn(1024, 1024))  # 4 MiB: copied behind the call
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.ones_like(weight)
    before = weight.detach().clone()
    with checkpointer.into_memory():
        checkpointer.save({"state_dict": {"w": weight}}, str(tmp_path / "durable" / "s1"), objects={}, step=1)
    optimizer.step()  # waits for the copy (not for the digests and the commit)
    assert tier._inflight.copied.is_set()
    checkpointer.wait()
    target = {"state_dict": {"w": torch.empty(1024, 1024)}}
    checkpointer.load(str(tmp_path / "shm" / "last"), target=target)
    assert torch.equal(target["state_dict"]["w"], before) and torch.equal(weight.detach(), before - 1.0)
    checkpointer.close()
