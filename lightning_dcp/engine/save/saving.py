"""Running a DCP save: plan, write, finish; what ``dcp.save`` does, in two phases and with fewer bytes exchanged.

``torch.distributed.checkpoint.save`` pickles every rank's whole plan to the coordinator and back at every save,
gathers every ``WriteResult`` object, and broadcasts the complete metadata to every rank at the end. With thousands
of tensors (or of ranks) that exchange costs more than writing the bytes. Here, with DCP's own planner and
storage-writer interfaces (the files are exactly the ones ``dcp.save`` writes through the same writer):

1. :func:`prepare` (collective): each rank makes its local plan and sends the coordinator a 16-byte signature of
   its shared part and its few private items (:mod:`lightning_dcp.engine.save.global_plan`). When every rank's plan is
   one of the last few saved through the same group (:mod:`~lightning_dcp.engine.save.memo`), every rank reuses its
   final plan of then (and the coordinator its metadata): nothing else is sent. Otherwise one rank per group of equal
   plans sends its plan, the coordinator makes the global plan and scatters each rank's part;
2. :func:`write` (collective): each rank writes its items, the coordinator gathers compact results
   ``(key, offset, file, offset, length, checksum)`` and finishes (``.metadata``, ``.commit``), and every rank
   learns the outcome.

A failure on any rank is raised on every rank (as ``dcp.save`` does, so that no rank waits forever), naming the rank
that failed. Splitting the phases lets an async save plan in the caller, stage only the items this rank writes, and
write in the background (:mod:`lightning_dcp.engine.save.async_save`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import secrets
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import SavePlanner, StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from lightning_dcp._compat.torch_dcp import StorageInfo
from lightning_dcp.engine.agreement import RankFailure, _portable, _raise_first, agree
from lightning_dcp.engine.gc_pause import gc_paused
from lightning_dcp.engine.save.dcp_io import compact_result
from lightning_dcp.engine.save.global_plan import Group, global_plan, split_private
from lightning_dcp.engine.save.memo import PlanMemo
from lightning_dcp.engine.save.planning import plan_signature

__all__ = ["PreparedSave", "RankFailure", "agree", "prepare", "save", "write"]

log = logging.getLogger("lightning_dcp.engine.checkpointer")  # the checkpointer's log: filters name it


@dataclasses.dataclass
class PreparedSave:
    """A planned save: what :func:`write` needs. ``metadata`` is the coordinator's (``None`` elsewhere)."""

    plan: SavePlan
    planner: SavePlanner
    writer: StorageWriter
    group: dist.ProcessGroup | None
    distributed: bool
    rank: int
    metadata: Metadata | None


@dataclasses.dataclass
class _Cached:
    signatures: list[Any]  # the coordinator's: per rank, (shared-plan signature, private-plan signature)
    plan: SavePlan
    metadata: Metadata | None
    generation: tuple[bytes, int] | None = None  # which global plan this is: every rank must hold it to reuse it
    from_rank0: bool = False  # the ranks' replicated values differed: rank 0 writes every one it holds


_PLANS = PlanMemo(size=8)  # by (group key, this rank's plan signature): several plans saved in turn each keep theirs
_GENERATIONS = itertools.count(1)  # the coordinator numbers every global plan it makes ...
_PROCESS = secrets.token_bytes(16)  # ... within this process: (process, number) is unique across processes, as a
# group's coordinator may be another process than the last group's, and a new group may reuse an old one's id().


def _next_generation() -> tuple[bytes, int]:
    """A name for a new global plan, unique across the processes of a job (and their restarts)."""
    return _PROCESS, next(_GENERATIONS)


def prepare(
    state_dict: dict[str, Any],
    *,
    writer: StorageWriter,
    planner: SavePlanner,
    group: dist.ProcessGroup | None = None,
    distributed: bool,
) -> PreparedSave:
    """Plan a save of ``state_dict``: every rank's final plan (see the module docstring).

    Collective over ``group`` (the default group when ``None``) when ``distributed``.

    Raises:
        RankFailure: Planning failed on some rank (on every rank).
    """
    rank = dist.get_rank(group) if distributed else 0
    coordinator = rank == 0
    local, error = None, None
    try:
        planner.set_up_planner(state_dict, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as err:
        error = err
    signature = None if local is None else getattr(planner, "plan_signature", None)
    if local is not None and (signature is None or local is not getattr(planner, "plan", None)):
        signature = plan_signature(local)
    if not distributed:
        _raise_first([error])
        key = (type(planner).__name__, type(writer).__name__, None, 1, 0)
        cached = _PLANS.get(None, (key, signature))
        if cached is None:
            plans, metadata = planner.create_global_plan([local])
            cached = _Cached([signature], writer.prepare_global_plan(plans)[0], metadata)
            _PLANS.put(None, (key, signature), cached)
        return PreparedSave(planner.finish_plan(cached.plan), planner, writer, group, False, 0, cached.metadata)
    size = dist.get_world_size(group)
    key = (type(planner).__name__, type(writer).__name__, id(group), size, rank)
    cached = None if local is None else _PLANS.get(None, (key, signature))
    shared, private, shared_signature, values = None, None, None, None
    if local is not None:
        shared, private, shared_signature = _split(local, signature)
        values = _values_digest(planner, shared)
    # 1. The coordinator learns every rank's shared-plan signature, private items, errors and the digest of its
    # replicated non-tensor values (small, O(ranks)).
    generation_held = cached.generation if cached is not None else None
    summary = (shared_signature, private, _portable(error), generation_held, values)
    gathered: list[Any] | None = [None] * size if coordinator else None
    dist.gather_object(summary, gathered, dst=_global_rank(group, 0), group=group)
    decision: list[Any] = [None]
    if coordinator:
        decision[0] = _decide(gathered, cached)
    dist.broadcast_object_list(decision, src=_global_rank(group, 0), group=group)
    kind, detail = decision[0]
    if kind == "error":
        raise RankFailure(*detail)
    if kind == "reuse":  # the same plans everywhere as last time: the same global plan, nothing else sent
        return PreparedSave(planner.finish_plan(cached.plan), planner, writer, group, True, rank, cached.metadata)
    # 2. Each group's lowest rank sends its shared plan; the coordinator makes every rank's final plan.
    representatives, generation, from_rank0 = detail
    plans_in: list[Any] | None = [None] * size if coordinator else None
    dist.gather_object(shared if rank in representatives else None, plans_in, dst=_global_rank(group, 0), group=group)
    outcome: list[Any] = [None]
    if coordinator:
        try:
            groups = [Group(ranks, plans_in[ranks[0]]) for ranks in _groups([g[0] for g in gathered])]
            positions, metadata = global_plan(planner, groups, [g[1] for g in gathered], from_rank0=from_rank0)
            scattered: list[Any] = [(p, None, metadata if i == 0 else None) for i, p in enumerate(positions)]
        except Exception as err:
            scattered = [(None, _portable(err), None)] * size
    dist.scatter_object_list(outcome, scattered if coordinator else None, src=_global_rank(group, 0), group=group)
    mine, error, metadata = outcome[0]
    failed = [None] * size
    failed[0] = error
    _raise_first(failed)
    # This rank's final plan: the items it writes, from its own local plan; the file prefix DCP's writer gives it.
    own = [*shared.items, *private.items]
    prefix = writer.prepare_global_plan([SavePlan([])] * size)[rank].storage_data
    central = dataclasses.replace(local, items=[own[p] for p in mine], storage_data=prefix)
    signatures = [(g[0], plan_signature(g[1])) for g in gathered] if coordinator else []
    _PLANS.put(None, (key, signature), _Cached(signatures, central, metadata, generation, from_rank0))
    return PreparedSave(planner.finish_plan(central), planner, writer, group, True, rank, metadata)


def _decide(gathered: list[tuple], cached: _Cached | None) -> tuple[str, Any]:
    """The coordinator's decision: ``("error", ...)``, ``("reuse", None)`` or ``("plan", ...)``.

    ``("error", (rank, error))``; ``("plan", (representatives, generation, from_rank0))``.

    ``from_rank0``: the ranks' replicated non-tensor values differ (:func:`_values_digest`), so their replicated
    tensors may too (a learning rate set by a per-rank scheduler gives each rank other weights): rank 0 writes every
    item it holds, as stock Lightning writes rank 0's checkpoint.
    """
    for rank, (_, _, error, _, _) in enumerate(gathered):
        if error is not None:
            return "error", (rank, error)
    digests = {g[4] for g in gathered if g[4] is not None}
    from_rank0 = len(digests) > 1
    if from_rank0 and not _WARNED:
        _WARNED.append(True)
        log.warning(
            "lightning_dcp: the ranks hold different values of replicated non-tensor state (optimizer param-group"
            " options such as a learning rate set from a metric that is not synced across ranks, e.g. a"
            " ReduceLROnPlateau monitoring a metric logged without `sync_dist=True`), so their weights may differ"
            " too: rank 0's state is saved, as stock Lightning saves rank 0's checkpoint. Log the monitored metric"
            " with `sync_dist=True` to keep the ranks alike."
        )
    signatures = [(g[0], plan_signature(g[1])) for g in gathered]
    if (
        cached is not None
        and cached.signatures == signatures
        and cached.from_rank0 == from_rank0
        and all(g[3] == cached.generation for g in gathered)
    ):
        return "reuse", None
    return "plan", ({ranks[0] for ranks in _groups([g[0] for g in gathered])}, _next_generation(), from_rank0)


_WARNED: list[bool] = []


def _values_digest(planner: SavePlanner, shared: SavePlan) -> bytes | None:
    """A digest of this rank's replicated non-tensor values (the bytes items of its shared plan, in plan order).

    Pickled as they are (param-group options, non-tensor optimizer state, modules' extra state are small); ``None``
    when the planner keeps no flat state dict or a value does not pickle (then nothing is compared).
    """
    flat = getattr(planner, "state_dict", None)
    if not isinstance(flat, dict):
        return None
    hasher = xxhash.xxh3_128()
    try:
        for item in shared.items:
            if item.type == WriteItemType.BYTE_IO:
                hasher.update(item.index.fqn.encode())
                hasher.update(pickle.dumps(flat[item.index.fqn], protocol=4))
    except Exception:  # an object that does not pickle, or a planner with other keys: not compared
        return None
    return hasher.digest()


def _groups(signatures: list[bytes]) -> list[list[int]]:
    """Ranks grouped by equal shared-plan signature, each group in rank order, groups by their lowest rank."""
    groups: dict[bytes, list[int]] = {}
    for rank, signature in enumerate(signatures):
        groups.setdefault(signature, []).append(rank)
    return list(groups.values())


_SPLITS = PlanMemo()


def _split(local: SavePlan, signature: bytes) -> tuple[SavePlan, SavePlan, bytes]:
    """``split_private(local)`` and the shared part's signature, remembered by the whole plan's signature."""
    found = _SPLITS.get(None, signature)
    if found is None:
        shared, private = split_private(local)
        found = (shared, private, plan_signature(shared))
        _SPLITS.put(None, signature, found)
    return found


def write(
    prepared: PreparedSave,
    *,
    error: BaseException | None = None,
    written: Callable[[], BaseException | None] | None = None,
) -> None:
    """Write this rank's items; the coordinator finishes the checkpoint (``.metadata``, ``.commit``).

    Collective over the prepared group when distributed (may run in a background thread). With ``error`` (this
    rank could not get its data ready) nothing is written and every rank fails with it. ``written`` is called once
    this rank is done with its data (written, failed or skipped), before any exchange; an error it returns fails
    the save on every rank as this rank's.

    Raises:
        RankFailure: Writing or finishing failed on some rank (on every rank).
    """
    compact = None
    try:
        if error is None:
            try:
                write_compact = getattr(prepared.writer, "write_compact", None)
                if write_compact is not None:
                    compact = write_compact(prepared.plan, prepared.planner)
                else:
                    future = prepared.writer.write_data(prepared.plan, prepared.planner)
                    future.wait()
                    compact = [compact_result(result) for result in future.value()]
            except Exception as err:
                error = err
    finally:
        late = written() if written is not None else None
    error = error or late
    if not prepared.distributed:
        _raise_first([error])
        _finish(prepared, [compact])
        return
    size = dist.get_world_size(prepared.group)
    gathered: list[Any] | None = [None] * size if prepared.rank == 0 else None
    dist.gather_object((compact, _portable(error)), gathered, dst=_global_rank(prepared.group, 0), group=prepared.group)
    outcome: list[Any] = [None]
    if prepared.rank == 0:
        errors = [e for _, e in gathered]
        if not any(errors):
            try:
                _finish(prepared, [c for c, _ in gathered])
            except Exception as err:
                errors[0] = err
        outcome[0] = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    dist.broadcast_object_list(outcome, src=_global_rank(prepared.group, 0), group=prepared.group)
    if outcome[0] is not None:
        raise RankFailure(*outcome[0])


def save(
    state_dict: dict[str, Any],
    *,
    writer: StorageWriter,
    planner: SavePlanner,
    group: dist.ProcessGroup | None = None,
    distributed: bool,
) -> None:
    """:func:`prepare` then :func:`write`. Collective when ``distributed``.

    The cyclic garbage collector is paused meanwhile: a full collection in a large training process takes a few
    hundred milliseconds, and one that starts inside a collective save holds every rank back. It runs afterwards.

    Raises:
        RankFailure: The save failed on some rank (on every rank); nothing was finished.
    """
    with gc_paused():
        write(prepare(state_dict, writer=writer, planner=planner, group=group, distributed=distributed))


# ---------------------------------------------------------------------------------------------- helpers
def _finish(prepared: PreparedSave, compact: list[list[tuple]]) -> None:
    finish_compact = getattr(prepared.writer, "finish_compact", None)
    if finish_compact is not None:
        finish_compact(prepared.metadata, compact)
        return
    results = [
        [
            WriteResult(
                index=MetadataIndex(fqn, None if offset is None else torch.Size(offset)),
                size_in_bytes=size,
                storage_data=StorageInfo(path, start, length),
            )
            for fqn, offset, size, path, start, length, _ in rank_results
        ]
        for rank_results in compact
    ]
    prepared.writer.finish(prepared.metadata, results)


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
