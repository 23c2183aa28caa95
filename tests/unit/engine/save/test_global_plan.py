"""The coordinator's save planning grouped by plan signature: every item written once, by a rank that holds it."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import FileSystemWriter

from lightning_dcp.engine.format import layout
from lightning_dcp.engine.save.global_plan import Group, global_plan, split_private
from lightning_dcp.engine.save.planning import BalancedSavePlanner, plan_signature


def _state(rank: int, shard: int, shards: int) -> dict:
    """A rank's state: replicated tensors, its shard of a sharded-like tensor (own keys), its RNG blob."""
    state = {
        layout.MODEL_KEY: {f"w{i}": torch.empty(64, 1024, device="meta") for i in range(6)},
        layout.RANK_KEY: {str(rank): b"rng"},
        "shard": {f"part{shard}": torch.empty(8, 8, device="meta")},
        "loop": {"step": 5},  # a non-tensor value: every rank plans it, one writes it
    }
    if rank == 0:
        state[layout.EXTRA_KEY] = b"trainer"
    return state


def _local(rank: int, shards: int):
    planner = BalancedSavePlanner(split=True, chunk_bytes=64 << 10)
    planner.set_up_planner(_state(rank, rank % shards, shards), is_coordinator=rank == 0)
    return planner.create_local_plan()


def test_grouped_planning_writes_every_item_once_by_a_holder_with_dcps_metadata(tmp_path):
    world, shards = 12, 3
    locals_ = [_local(r, shards) for r in range(world)]
    split = [split_private(p) for p in locals_]
    groups: dict[bytes, list[int]] = {}
    for rank, (shared, _) in enumerate(split):
        groups.setdefault(plan_signature(shared), []).append(rank)
    assert sorted(groups.values()) == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]  # one plan sent per group
    planner = BalancedSavePlanner(split=True, chunk_bytes=64 << 10)
    planner.set_up_planner({}, is_coordinator=True)
    positions, metadata = global_plan(
        planner, [Group(ranks, split[ranks[0]][0]) for ranks in groups.values()], [p for _, p in split]
    )
    written: dict = {}
    for rank, mine in enumerate(positions):
        own = [*split[rank][0].items, *split[rank][1].items]
        for position in mine:
            item = own[position]
            assert item.index not in written, item.index  # once
            assert any(i.index == item.index for i in locals_[rank].items)  # by a rank that holds it
            written[item.index] = rank
    everything = {i.index for p in locals_ for i in p.items}
    assert set(written) == everything
    # The metadata is DCP's own global planning of all ranks' plans (same entries, chunks and mappings).
    reference = BalancedSavePlanner(split=True, chunk_bytes=64 << 10)
    reference.set_up_planner({}, is_coordinator=True)
    _, expected = reference.create_global_plan(FileSystemWriter(str(tmp_path)).prepare_global_plan(locals_))
    assert metadata.state_dict_metadata.keys() == expected.state_dict_metadata.keys()
    for key, md in expected.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in metadata.state_dict_metadata[key].chunks}
            assert chunks == {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}, key
    assert metadata.planner_data == expected.planner_data
    # The replicated chunks (12 of 64 KiB) are spread over the ranks: nobody writes more than two.
    replicated = [r for index, r in written.items() if index.fqn.startswith(layout.MODEL_KEY)]
    assert max(replicated.count(r) for r in range(world)) <= 2


def test_ranks_whose_replicated_values_differ_get_every_item_written_by_rank_0():
    """``from_rank0`` (the coordinator found the ranks' non-tensor values differ): rank 0 writes all it holds."""
    world = 4
    locals_ = [_local(r, 1) for r in range(world)]
    split = [split_private(p) for p in locals_]
    planner = BalancedSavePlanner(split=True, chunk_bytes=64 << 10)
    planner.set_up_planner({}, is_coordinator=True)
    groups = [Group(list(range(world)), split[0][0])]
    positions, _ = global_plan(planner, groups, [p for _, p in split], from_rank0=True)
    shared = len(split[0][0].items)
    assert sorted(positions[0][:shared]) == list(range(shared))  # every shared item, from rank 0's own copy
    for rank in range(1, world):  # the others write their private items only (their RNG blobs)
        assert [split[rank][1].items[p - shared].index.fqn for p in positions[rank]] == [f"{layout.RANK_KEY}.{rank}"]


def test_the_coordinator_decides_rank_0_where_the_ranks_values_differ():
    from lightning_dcp.engine.save import saving

    summary = (b"s", saving.SavePlan([]), None, None)
    same = [(*summary, b"d1"), (*summary, b"d1")]
    assert saving._decide(same, None)[1][2] is False
    differ = [(*summary, b"d1"), (*summary, b"d2")]
    assert saving._decide(differ, None)[1][2] is True
    cached = saving._Cached([(b"s", saving.plan_signature(saving.SavePlan([])))] * 2, saving.SavePlan([]), None)
    assert saving._decide(same, cached)[0] == "reuse"  # the plan of then: the same decision
    assert saving._decide(differ, cached)[0] == "plan"  # the decision changed: planned again
    planner = BalancedSavePlanner(split=False)
    planner.set_up_planner({"o": {"lr": 0.1, "w": torch.zeros(2)}}, is_coordinator=True)
    plan = planner.create_local_plan()
    digest = saving._values_digest(planner, plan)
    planner.set_up_planner({"o": {"lr": 0.2, "w": torch.ones(2)}}, is_coordinator=True)
    assert saving._values_digest(planner, plan) != digest  # another learning rate
    planner.set_up_planner({"o": {"lr": 0.1, "w": torch.ones(2)}}, is_coordinator=True)
    assert saving._values_digest(planner, plan) == digest  # tensors are not compared
