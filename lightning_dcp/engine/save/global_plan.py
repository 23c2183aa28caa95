"""Coordinating a save of many ranks: local plans grouped by what they hold, one global plan built from the groups.

DCP's coordinator gathers every rank's local plan, deduplicates the items that several ranks hold and builds the
metadata from all of them. Under DDP every rank holds the same replicated state, so at N ranks the coordinator
receives N copies of the same plan, and under HSDP N / S copies of each of S plans: its work and the bytes it
receives grow with N times the model's tensor count. Here a rank's local plan is split in two:

- its *private* items, which only it writes: its own RNG blob (``rank_states.{rank}``) and, on rank 0, the
  ``lightning`` blob; they go to the coordinator from every rank (one or two small items each);
- the rest, its *shared* plan, summarized by a 16-byte signature. Ranks whose shared plans have the same signature
  form a group; only the group's lowest rank (its representative) sends its shared plan.

The coordinator assigns every distinct item to one rank among those that hold it (the least loaded, largest items
first; a heap per group, so an item held by all N ranks costs ``O(log N)``), builds the metadata with DCP's own
global planning over the deduplicated items (flattening mappings, validation), and sends each rank only the
positions, in its own local plan, of the items it writes. Work and bytes grow with the number of distinct plans and
items, plus a small term per rank.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint import SavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from lightning_dcp.engine.format.layout import EXTRA_KEY, RANK_KEY
from lightning_dcp.engine.save.datafiles import item_nbytes

__all__ = ["Group", "global_plan", "split_private"]


@dataclasses.dataclass
class Group:
    """Ranks whose shared plans are equal (the same signature), and that plan (sent by the lowest of them)."""

    ranks: list[int]
    plan: SavePlan


def _private(fqn: str) -> bool:
    return fqn == EXTRA_KEY or fqn.startswith(RANK_KEY + ".")


def split_private(plan: SavePlan) -> tuple[SavePlan, SavePlan]:
    """``(shared, private)`` parts of a local plan (items and flattening mappings)."""
    shared = [item for item in plan.items if not _private(item.index.fqn)]
    private = [item for item in plan.items if _private(item.index.fqn)]
    mappings = plan.planner_data if isinstance(plan.planner_data, dict) else None
    shared_data, private_data = plan.planner_data, None
    if mappings is not None:
        shared_data = {k: v for k, v in mappings.items() if not _private(k)}
        private_data = {k: v for k, v in mappings.items() if _private(k)}
    return dataclasses.replace(plan, items=shared, planner_data=shared_data), SavePlan(private, None, private_data)


def global_plan(
    planner: SavePlanner,
    groups: Sequence[Group],
    private: Sequence[SavePlan],
    *,
    from_rank0: bool = False,
) -> tuple[list[list[int]], Metadata]:
    """Which items every rank writes, and the checkpoint's metadata (coordinator only).

    Args:
        planner: The coordinator's save planner; its ``create_global_plan`` builds the metadata of one plan.
        groups: The groups of ranks with equal shared plans (every rank in exactly one group).
        private: Per rank, the items only it writes.
        from_rank0: Every item rank 0 holds is written by rank 0 (the ranks' replicated values may differ).

    Returns:
        ``(positions, metadata)``: ``positions[rank]`` indexes that rank's own ``shared.items + private.items``
        (:func:`split_private`; equal shared plans list the same items in the same order), a small list to send.
    """
    world_size = len(private)
    owner: dict[MetadataIndex, int] = {}
    load = [0] * world_size
    for rank, plan in enumerate(private):
        for item in plan.items:
            load[rank] += item_nbytes(item) or 1
    holders: dict[MetadataIndex, list[int]] = {}  # index -> groups holding it
    items: dict[MetadataIndex, WriteItem] = {}
    for g, group in enumerate(groups):
        for item in group.plan.items:
            holders.setdefault(item.index, []).append(g)
            items.setdefault(item.index, item)
    heaps = [[(load[r], r) for r in group.ranks] for group in groups]
    for heap in heaps:
        heapq.heapify(heap)
    sizes = [len(group.ranks) for group in groups]
    nbytes = {index: item_nbytes(item) for index, item in items.items()}
    # Items fewer ranks hold first (they have less choice), then the largest first.
    order = sorted(
        holders,
        key=lambda i: (
            sizes[holders[i][0]] if len(holders[i]) == 1 else sum(sizes[g] for g in holders[i]),
            -nbytes[i],
            i.fqn,
            tuple(i.offset or ()),
        ),
    )
    group_of = [0] * world_size
    for g, group in enumerate(groups):
        for rank in group.ranks:
            group_of[rank] = g
    for index in order:
        held = holders[index]
        if from_rank0 and groups and group_of[0] in held:
            owner[index] = 0
            continue
        g = held[0] if len(held) == 1 else min(held, key=lambda g: heaps[g][0])
        heap = heaps[g]
        if len(heap) == 1:  # one rank holds it: no choice to make
            used, rank = heap[0]
            heap[0] = (used + (nbytes[index] or 1), rank)
        else:
            used, rank = heapq.heappop(heap)
            heapq.heappush(heap, (used + (nbytes[index] or 1), rank))
        owner[index] = rank
    positions: list[list[int]] = [[] for _ in range(world_size)]
    for g, group in enumerate(groups):
        for position, item in enumerate(group.plan.items):
            rank = owner[item.index]
            if group_of[rank] == g:  # written from this group's plan
                positions[rank].append(position)
    for rank, plan in enumerate(private):
        shared = len(groups[group_of[rank]].plan.items) if groups else 0
        positions[rank] += range(shared, shared + len(plan.items))
    mappings: dict[str, Any] = {}
    for plan in (*(group.plan for group in groups), *private):
        if isinstance(plan.planner_data, dict):
            mappings.update(plan.planner_data)
    merged_items = [item for plan in private for item in plan.items] + list(items.values())
    first = groups[0].plan if groups else SavePlan([])
    merged = dataclasses.replace(first, items=merged_items, planner_data=mappings or first.planner_data)
    _, metadata = planner.create_global_plan([merged])
    return positions, metadata
