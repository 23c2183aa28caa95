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
