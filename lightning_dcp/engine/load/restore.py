"""Reading one checkpoint: the tree into a target (resharding) or as new tensors, plus its blobs.

:meth:`~lightning_dcp.engine.checkpointer.Checkpointer.load` picks the candidates (``last`` and its fallbacks) and
calls :func:`load_one` on each until one loads. A candidate is one of our DCP directories, Lightning's own sharded
layout (``meta.pt`` beside DCP's files, mapped onto our keys here) or a single ``torch.save`` file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.nn import Parameter

from lightning_dcp.engine.catalog.integrity import check_checkpoint
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.format.blob import decode_extra
from lightning_dcp.engine.format.record_index import IndexEntry, parse_index, record_ends
from lightning_dcp.engine.gc_pause import gc_paused
from lightning_dcp.engine.load import index_load, local_load, page_cache
from lightning_dcp.engine.load.dcp_reader import storage_reader
from lightning_dcp.engine.load.loading import (
    Probe,
    check_trainer_state,
    fit_target,
    lightning_model_key,
    load_file,
    probe,
    read_lightning_meta,
)
from lightning_dcp.engine.load.local_load import FastLoadPlanner
from lightning_dcp.engine.state.optimizer_target import drop_unsaved, fill_pending, saved_entries
from lightning_dcp.engine.storage.location import Location, read_commit
from lightning_dcp.errors import checkpoint_failure

__all__ = ["Loaded", "load_one"]


@dataclasses.dataclass
class Loaded:
    """What :meth:`~lightning_dcp.engine.checkpointer.Checkpointer.load` read.

    Attributes:
        url: The checkpoint actually loaded (after pointers and a fallback from a broken ``last``).
        kind: ``"dcp"`` (lightning_dcp), ``"lightning"`` (Lightning's sharded layout with ``meta.pt``) or ``"file"``
            (one ``torch.save`` file, returned whole in ``objects``).
        tree: The loaded tree: the filled target, or full CPU tensors without a target.
        objects: The decoded rank-0 blob (or ``meta.pt``, or the whole file); ``{}`` when not read.
        rank_objects: This rank's own blob (rank 0's at another world size), ``None`` when not read or not saved.
        rank_objects_exact: Whether ``rank_objects`` is this rank's own (same world size as at save).
        in_place: Whether tensors were loaded into a given target (this rank's shards) rather than full tensors.
        missing_keys: Model FQNs of the target that the checkpoint lacks (non-strict loads).
        unexpected_keys: Model FQNs the checkpoint holds that the target lacks (non-strict loads).
        saved_world_size: The world size at save, when recorded.
    """

    url: str
    kind: Literal["dcp", "lightning", "file"]
    tree: dict[str, Any]
    objects: dict[str, Any]
    rank_objects: dict[str, Any] | None = None
    rank_objects_exact: bool = False
    in_place: bool = False
    missing_keys: list[str] = dataclasses.field(default_factory=list)
    unexpected_keys: list[str] = dataclasses.field(default_factory=list)
    saved_world_size: int | None = None


def load_one(
    location: Location,
    *,
    target: dict[str, Any] | None,
    strict: bool,
    collective: bool,
    weights_only: bool,
    only: Sequence[str] | None,
    exclude: Sequence[str],
    map_location: Any | None,
    model_key: str,
    node_local: bool = False,
    objects_only: bool = False,
    prefetch: bool = True,
    resolved: bool = False,
    checked: Probe | None = None,
) -> Loaded:
    """Load the one checkpoint at ``location`` into ``target`` or as new tensors.

    :func:`probe` checks it first, resolving ``location`` (a ``last`` name, pointers) unless ``resolved``.

    The arguments are those of :meth:`~lightning_dcp.engine.checkpointer.Checkpointer.load`, which tries its
    candidates (a ``last`` fallback) with this function one by one.

    ``node_local``: every rank reads its own copy of the same checkpoint at its own ``location`` (the memory tier
    assembles one per node); rank 0's copy is probed for all. ``objects_only``: with an empty ``target``, read the
    blobs and no other saved state dict. ``prefetch``: once the probe has the record index of a local checkpoint
    that every rank reads whole (a target of plain tensors), read its data files into the page cache in the
    background (:func:`~lightning_dcp.engine.load.page_cache.prefetch`); ``False`` when the caller already started that.
    ``resolved``: ``location`` is a candidate the catalog chose (a ``last`` name already stands for one checkpoint), so
    the probe checks it as it is rather than resolving it again. ``checked``: the caller's own :func:`probe` of
    ``location`` with its parsed ``metadata``, on every rank (broadcast from rank 0): the checkpoint is loaded as
    that probe found and checked it, through its metadata, without probing it again.

    Collective: call on all ranks when ``collective``.

    Raises:
        CheckpointError: Any failure of this checkpoint (a subclass names the file); StateDictMismatchError when
            ``target`` does not fit it.
    """
    with gc_paused():  # tens of thousands of small objects: collections would cost more than the load
        probed: list[Probe] = []
        # A local resume into a target may skip .metadata: the record index in .commit serves it (index_load).
        indexed = (
            target is not None
            and (bool(target) or objects_only)
            and only is None
            and not exclude
            and location.local
            and not node_local
        )

        if checked is not None:  # the caller's probe has the metadata, not the record index
            indexed = False
        prefetching = prefetch and indexed and _reads_everything(target)  # worth reading every file into the page cache

        def rank0() -> Probe:  # rank 0 decides; the others read the same (immutable) metadata themselves, in parallel
            probed.append(probe(location, indexed=indexed, resolve=not resolved))
            records = probed[0].records
            if records is not None and prefetching:  # the disk reads while the ranks plan
                where = location.at(probed[0].url).path
                page_cache.prefetch(where, ends=lambda: record_ends(records))
            return dataclasses.replace(probed[0], metadata=None, records=None)

        rank, world_size = rank_and_world(collective)
        ahead: dict[str, IndexEntry] | None = None
        if checked is not None:
            found = checked
            probed.append(checked)
        else:
            if rank != 0 and location.local:
                ahead = _parse_ahead(location, indexed=indexed)
                if ahead is not None and prefetching:
                    page_cache.prefetch(location.path, ends=lambda: record_ends(ahead))
            found = on_rank0(collective, rank0)
        if not node_local:
            location = location.at(found.url)
        if found.kind == "file":
            objects = load_file(location, map_location=map_location, weights_only=weights_only)
            return Loaded(url=location.url, kind="file", tree={}, objects=objects)
        if found.indexed and target is not None:
            records = probed[0].records if probed else ahead
            loaded = Loaded(url=location.url, kind="dcp", tree={}, objects={}, in_place=True)
            loaded.saved_world_size = layout.saved_world_size(records or {})
            state = dict(target)
            if records is not None:  # optimizer targets: the entries the checkpoint holds for them, as recorded
                fill_pending(state, saved_entries(records=records))
                drop_unsaved(state)
            state = _with_blobs(state, loaded.saved_world_size, rank, world_size)
            try:
                done = index_load.load_indexed(
                    location.path,
                    state,
                    records,
                    weights_only=weights_only,
                    distributed=distributed(collective),
                    whole=not objects_only,
                )
            except Exception as err:  # raised on every rank alike: the lowest failing rank's error
                raise checkpoint_failure(err, f"Loading the checkpoint at {location.url!r} failed") from err
            if done:
                return _finish(loaded, state, in_place=True, weights_only=weights_only, world_size=world_size)
        metadata = probed[0].metadata if probed and probed[0].metadata is not None else None
        if metadata is None and found.indexed:  # the probe read the index only: what it would have checked
            metadata = _checked_metadata(location, collective)
        elif metadata is None:
            metadata = read_metadata(location)
        lightning_layout = found.kind == "lightning"
        model_key = lightning_model_key(metadata) if lightning_layout else model_key
        loaded = Loaded(url=location.url, kind=found.kind, tree={}, objects={}, in_place=target is not None)
        loaded.saved_world_size = layout.saved_world_size(metadata.state_dict_metadata)
        if target is None:
            state = layout.metadata_target(metadata)
        else:
            state = {k: v for k, v in target.items() if only is None or k in only}
            if lightning_layout:
                state = _to_lightning_layout(state, model_key)
            # optimizer targets: the entries the checkpoint holds for them (lists, ids and FQNs by their saved paths)
            fill_pending(state, saved_entries(metadata=metadata), paths=metadata.planner_data or None)
            drop_unsaved(state)
            state, loaded.missing_keys, loaded.unexpected_keys = fit_target(
                location.url, state, metadata, strict=strict, model_key=model_key, exclude=exclude
            )
            if not lightning_layout and only is None:
                for key in [] if objects_only else _other_tree_keys(metadata, state):  # other saved state dicts:
                    state.update(layout.metadata_target(metadata, prefixes=(key + ".",)))  # full CPU tensors
                state = _with_blobs(state, loaded.saved_world_size, rank, world_size)
        try:
            local_load.load(
                state,
                reader=storage_reader(location),
                planner=FastLoadPlanner(weights_only=weights_only, allow_partial_load=not strict),
                distributed=distributed(collective),
            )
        except Exception as err:  # raised on every rank alike: the lowest failing rank's error
            raise checkpoint_failure(err, f"Loading the checkpoint at {location.url!r} failed") from err
        if lightning_layout:
            loaded.objects = {} if only is not None else read_lightning_meta(location, weights_only=weights_only)
            loaded.tree = _from_lightning_layout(state, model_key)
            return loaded
        return _finish(loaded, state, in_place=target is not None, weights_only=weights_only, world_size=world_size)


def _with_blobs(state: dict[str, Any], saved_world_size: int | None, rank: int, world_size: int) -> dict[str, Any]:
    """``state`` with places for the Trainer-state blob and this rank's own blob, which the load fills.

    The rank's own blob is rank 0's at another world size than at save.
    """
    state[layout.EXTRA_KEY] = b""
    if saved_world_size:
        own = rank if saved_world_size == world_size else 0
        state[layout.RANK_KEY] = {str(own): b""}
    return state


def _finish(loaded: Loaded, state: dict[str, Any], *, in_place: bool, weights_only: bool, world_size: int) -> Loaded:
    """``loaded`` with the loaded tree and its decoded blobs."""
    if layout.EXTRA_KEY in state:
        blob = state.pop(layout.EXTRA_KEY)
        loaded.objects = decode_extra(blob, path=loaded.url, entry=layout.EXTRA_KEY, weights_only=weights_only)
    blobs = state.pop(layout.RANK_KEY, None) if in_place else None
    if blobs:
        loaded.rank_objects = decode_extra(
            next(iter(blobs.values())), path=loaded.url, entry=layout.RANK_KEY, weights_only=weights_only
        )
        loaded.rank_objects_exact = loaded.saved_world_size == world_size
    loaded.tree = state
    return loaded


def _checked_metadata(location: Location, collective: bool) -> Metadata:
    """The metadata of a checkpoint probed through its index, checked on rank 0 as :func:`probe` checks others.

    That is :func:`~lightning_dcp.engine.catalog.integrity.check_checkpoint`. Collective when ``collective``.
    """
    kept: list[Metadata] = []

    def check() -> None:
        kept.append(check_checkpoint(location))
        check_trainer_state(location, kept[0])

    on_rank0(collective, check)
    return kept[0] if kept else read_metadata(location)


def _parse_ahead(location: Location, *, indexed: bool) -> dict[str, IndexEntry] | None:
    """Parse the checkpoint at ``location`` (if it is a checkpoint directory) while rank 0 probes it.

    With ``indexed``, its ``.commit`` and the record index in it (returned; ``None`` without one), which a restore
    through the index needs on every rank. Otherwise (or without an index) its ``.metadata``: the parse is
    remembered by the file's bytes (:func:`~lightning_dcp.engine.catalog.metadata.load_metadata`), so when rank 0
    settles on this checkpoint, reading its metadata again costs one read of the file. Anything that fails here is left
    for the probe to report.
    """
    try:
        if indexed:
            marker = read_commit(location)
            records = None if marker is None else parse_index(marker)
            if records is not None:
                return records
        read_metadata(location)
    except Exception:  # not a checkpoint directory, or a broken one: rank 0's probe says which
        pass
    return None


def _reads_everything(target: dict[str, Any] | None) -> bool:
    """Whether a restore into ``target`` reads every record on this rank.

    So it does when its model state is plain tensors (DDP, one device) rather than this rank's shards (DTensor).
    """
    model = target.get(layout.MODEL_KEY) if target else None
    return isinstance(model, dict) and all(type(v) is torch.Tensor or type(v) is Parameter for v in model.values())


def _other_tree_keys(metadata: Any, target: dict[str, Any]) -> list[str]:
    """Top-level keys of saved tensor entries the target lacks (besides the blobs and the model/optimizer keys)."""
    mappings = metadata.planner_data or {}
    keys = {mappings.get(k, (k,))[0] for k, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks")}
    known = {layout.MODEL_KEY, layout.OPTIMIZER_KEY, layout.EXTRA_KEY, layout.RANK_KEY, *target}
    return sorted(k for k in keys if isinstance(k, str) and k not in known)


def _to_lightning_layout(target: dict[str, Any], model_key: str) -> dict[str, Any]:
    """Our target keys -> Lightning's sharded layout (``state_dict``/``model``, ``optimizer_{i}``)."""
    keyed = {model_key: target[layout.MODEL_KEY]}
    for i, state in enumerate(target.get(layout.OPTIMIZER_KEY, [])):
        keyed[f"optimizer_{i}"] = state
    return keyed


def _from_lightning_layout(target: dict[str, Any], model_key: str) -> dict[str, Any]:
    """Lightning's sharded layout -> ``{"state_dict": ..., "optimizer_states": [...]}``."""
    optimizers = sorted((int(k.split("_", 1)[1]), v) for k, v in target.items() if k.startswith("optimizer_"))
    result: dict[str, Any] = {layout.MODEL_KEY: target[model_key]}
    if optimizers:
        result[layout.OPTIMIZER_KEY] = [state for _, state in optimizers]
    return result
