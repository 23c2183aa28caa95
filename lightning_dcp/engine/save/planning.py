"""The save planner: large replicated tensors split into row chunks, and every rank given an equal share of bytes.

Under DDP every rank holds the same (replicated) tensors; DCP writes each one once, choosing a rank per tensor. With
a few huge tensors (embeddings, LM heads, their optimizer moments) whole-tensor granularity leaves ranks unevenly
loaded: 9 tensors of 128 MiB over 2 ranks is 5 against 4. :class:`BalancedSavePlanner` splits every plain tensor
larger than ``chunk_bytes`` into row ranges (DCP ``SHARD`` write items: a tensor saved as several chunks, exactly
like an FSDP checkpoint, which every DCP reader loads and reshards) and then deduplicates with a balanced assignment:
the largest items first, each to the least-loaded rank that holds it. A row range of a contiguous tensor is itself
contiguous, so the writer sends it from the tensor's memory without a copy.

A tensor is split only when the save has more than one writer (ranks x threads); the rest is DCP's default planner.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lightning_dcp._compat.torch_dcp import ShardedTensor
from lightning_dcp.engine.format.keys import flatten
from lightning_dcp.engine.save.datafiles import item_nbytes
from lightning_dcp.engine.save.memo import PlanMemo

__all__ = ["CHUNK_BYTES", "BalancedSavePlanner", "balanced_dedup", "flatten", "plan_signature"]

CHUNK_BYTES = 32 << 20
"""Plain tensors larger than this are written as row chunks of about this size (when there are several writers)."""


class BalancedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with large plain tensors split into row chunks and a balanced deduplication.

    Args:
        split: Split plain tensors larger than ``chunk_bytes`` (use when ranks x writer threads > 1).
        chunk_bytes: Target bytes per chunk (default :data:`CHUNK_BYTES`).
    """

    def __init__(self, *, split: bool, chunk_bytes: int | None = None) -> None:
        super().__init__()
        self.split = split
        self.chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self._chunked: set[str] = set()
        self._flat: tuple[dict[str, Any], dict[str, tuple]] | None = None

    def use_flat(self, flat: dict[str, Any], mappings: dict[str, tuple]) -> None:
        """Plan the next save from this flat state dict (``flatten``'s output, possibly with values replaced).

        The state dict then given to :meth:`set_up_planner` is not flattened again (an async save flattened it in
        the caller and replaced what it copied there by the copies).
        """
        self._flat = (flat, mappings)

    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        """DCP's set-up, with the state dict flattened by :func:`flatten` (the same keys and paths, faster).

        DCP's pass that flattens FSDP1's ShardedTensors (a copy of the whole flat dict) runs only when one is there.
        """
        if not self.flatten_state_dict:
            super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
            return
        flat, self.mappings = flatten(state_dict) if self._flat is None else self._flat
        sharded = self.flatten_sharded_tensors and any(isinstance(v, ShardedTensor) for v in flat.values())
        keep = self.flatten_sharded_tensors
        self.flatten_state_dict, self.flatten_sharded_tensors = False, sharded  # flattened here already
        try:
            super().set_up_planner(flat, storage_meta=storage_meta, is_coordinator=is_coordinator)
        finally:
            self.flatten_state_dict, self.flatten_sharded_tensors = True, keep

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, with plain tensors larger than ``chunk_bytes`` split into row chunks.

        Plans of state dicts made only of plain tensors and objects are remembered by structure (keys, dtypes,
        shapes): a training run saves the same structure every time, and building thousands of write items anew
        costs more than writing small tensors. ``plan_signature`` is set to the plan's digest.
        """
        paths = self.mappings if self.flatten_state_dict else None
        key = _structure(self.state_dict, self.split, self.chunk_bytes, paths=paths)
        cached = _LOCAL_PLANS.get(None, key) if key is not None else None
        if cached is None:
            plan = super().create_local_plan()
            if self.split:
                plan = dataclasses.replace(plan, items=[chunk for item in plan.items for chunk in self._split(item)])
            cached = (plan, plan_signature(plan), frozenset(self._chunked))
            if key is not None:
                _LOCAL_PLANS.put(None, key, cached)
        plan, self.plan_signature, chunked = cached
        self._chunked = set(chunked)
        self.plan = dataclasses.replace(plan, planner_data=self.mappings) if self.flatten_state_dict else plan
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan after :func:`balanced_dedup` (coordinator only)."""
        # Deduplicated here, DCP's own deduplication then finds nothing left to remove.
        return super().create_global_plan(balanced_dedup(all_plans) if len(all_plans) > 1 else all_plans)

    def resolve_data(self, write_item: WriteItem) -> Any:
        """The tensor (a row range of it for a chunk: a view, no copy) or blob of ``write_item``."""
        fqn = write_item.index.fqn
        if fqn in self._chunked:
            chunk = write_item.tensor_data.chunk
            tensor = self.state_dict[fqn].detach()
            return tensor.narrow(0, chunk.offsets[0], chunk.sizes[0])
        if write_item.type == WriteItemType.TENSOR:  # a plain tensor is its own data (DCP looks it up generically)
            value = self.state_dict.get(fqn)
            if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
                return value
        return super().resolve_data(write_item)

    def _split(self, item: WriteItem) -> list[WriteItem]:
        if item.type != WriteItemType.TENSOR:
            return [item]
        size = item.tensor_data.size
        nbytes = item_nbytes(item)
        if len(size) == 0 or size[0] < 2 or nbytes <= self.chunk_bytes:
            return [item]
        pieces = min(size[0], math.ceil(nbytes / self.chunk_bytes))
        rows = math.ceil(size[0] / pieces)
        self._chunked.add(item.index.fqn)
        out = []
        for start in range(0, size[0], rows):
            offsets = torch.Size([start] + [0] * (len(size) - 1))
            sizes = torch.Size([min(rows, size[0] - start), *size[1:]])
            out.append(
                WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=item.tensor_data.properties,
                        size=size,
                    ),
                )
            )
        return out


def plan_signature(plan: SavePlan) -> bytes:
    """A digest of everything in a local plan that the global plan depends on (stable across processes)."""
    hasher = xxhash.xxh3_128()
    for item in plan.items:
        hasher.update(repr((item.index.fqn, item.index.offset, item.type.value)).encode())
        data = item.tensor_data
        if data is not None:
            hasher.update(repr((data.chunk.offsets, data.chunk.sizes, data.size, data.properties)).encode())
    hasher.update(repr(sorted((plan.planner_data or {}).items())).encode())
    return hasher.digest()


_LOCAL_PLANS = PlanMemo(size=8)  # (plan, its signature, chunked FQNs) by structure: thread-safe (background saves)


def _structure(state_dict: dict[str, Any], *args: Any, paths: dict[str, Any] | None = None) -> tuple | None:
    """What a local plan of the flat ``state_dict`` depends on (keys, dtypes, shapes, nesting), or ``None``.

    ``paths``: each flat key's path in the nested state dict (the plan's ``planner_data``, which ``.metadata`` keeps
    and a load rebuilds the nesting from): ``{"x": [t]}`` and ``{"x": {"0": t}}`` flatten to the same key ``x.0``
    with paths ``("x", 0)`` and ``("x", "0")``. ``None`` when it holds anything but plain CPU tensors and objects:
    DTensors and other tensor subclasses are planned anew at every call.
    """
    key: list[Any] = [args]
    tensor, parameter = torch.Tensor, torch.nn.Parameter
    path = (paths or {}).get
    for fqn, value in state_dict.items():
        kind = type(value)
        if kind is tensor or kind is parameter:
            if not value.is_cpu:
                return None
            key.append((fqn, path(fqn), value.dtype, value.shape, value.requires_grad, value.layout))
        elif isinstance(value, tensor):
            return None
        else:
            key.append((fqn, path(fqn)))
    return tuple(key)


def balanced_dedup(plans: list[SavePlan]) -> list[SavePlan]:
    """Keep each write item on one of the ranks that planned it, the least-loaded one when it is planned.

    Deterministic (ties go to the lowest rank); items planned by one rank only stay where they are.
    """
    holders: dict[MetadataIndex, list[int]] = {}
    items: dict[MetadataIndex, WriteItem] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders.setdefault(item.index, []).append(rank)
            items.setdefault(item.index, item)
    load = [0] * len(plans)
    owner: dict[MetadataIndex, int] = {}
    # Items fewer ranks hold first (they have less choice), then the largest first.
    order = sorted(holders, key=lambda i: (len(holders[i]), -item_nbytes(items[i]), i.fqn, tuple(i.offset or ())))
    for index in order:
        rank = min(holders[index], key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += item_nbytes(items[index]) or 1
    return [
        dataclasses.replace(plan, items=[item for item in plan.items if owner[item.index] == rank])
        for rank, plan in enumerate(plans)
    ]
