"""The on-disk layout of a lightning_dcp checkpoint, and how a Lightning checkpoint dict maps onto it.

A checkpoint is one DCP directory. Its DCP state dict has three top-level entries:

- ``"state_dict"``: the model state (FQN keys; plain tensors, or DTensors written by their owners);
- ``"optimizer_states"``: a list, one optimizer state dict per optimizer (absent for ``weights_only``);
- ``"lightning"``: one ``bytes`` blob written by rank 0 only, a ``torch.save`` of everything else Lightning puts in
  a checkpoint (epoch, global_step, loops, callbacks, lr schedulers, hparams, datamodule and precision state,
  ``on_save_checkpoint`` additions) plus an ``"lightning_dcp"`` info dict.

Everything is inside DCP's files, so DCP's ``.metadata`` (written last) commits all of it at once, and every read
goes through ``weights_only`` unpickling.

A Fabric checkpoint (:mod:`lightning_dcp.fabric`) uses the same files with the user's own top-level keys: each
module's state (``get_model_state_dict``, FQN keys) and each optimizer's state (``get_optimizer_state_dict``, FQN
keys) under the key it had in ``fabric.save(path, state)``, other tensors under theirs, and the remaining objects in
the ``lightning`` blob. Its info records which keys hold modules and optimizers (``"modules"``, ``"optimizers"``);
a checkpoint whose info lacks them has the Trainer layout above. :func:`tree_roles` tells the two apart.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_dcp._compat.torch_dcp import set_element
from lightning_dcp.engine.format.archive import load_checked
from lightning_dcp.engine.format.blob import encode_extra
from lightning_dcp.engine.format.keys import terminal_list
from lightning_dcp.errors import CheckpointError, NotACheckpointError

__all__ = [
    "EXTRA_KEY",
    "FORMAT_VERSION",
    "INFO_KEY",
    "LOADERS_INFO",
    "MODEL_KEY",
    "OPTIMIZER_KEY",
    "OPTIMIZER_KINDS",
    "OPTIMIZER_LISTS",
    "RANK_KEY",
    "SafeLoadPlanner",
    "SaveParts",
    "TreeRoles",
    "build_state",
    "fqns_to_param_ids",
    "require_trainer_layout",
    "restore_lists",
    "join_checkpoint",
    "list_paths",
    "metadata_target",
    "saved_optimizer_count",
    "saved_world_size",
    "split_checkpoint",
    "tree_roles",
]

MODEL_KEY = "state_dict"
OPTIMIZER_KEY = "optimizer_states"
EXTRA_KEY = "lightning"
RANK_KEY = "rank_states"
"""``rank_states.{rank}``: one ``bytes`` blob per rank (its RNG states), written by that rank."""
INFO_KEY = "lightning_dcp"
FORMAT_VERSION = 1
MODULES_INFO = "modules"
"""Info entry of a Fabric checkpoint: the top-level keys that hold a module's state (FQN -> tensor)."""
OPTIMIZERS_INFO = "optimizers"
"""Info entry of a Fabric checkpoint: the top-level keys that each hold one optimizer's state (FQN layout)."""
LOADERS_INFO = "loaders"
"""Info entry of a Fabric checkpoint: the keys of its stateful data loaders. Each rank saved their states as its own,
under this name in its ``rank_states.{rank}`` blob (``{key: loader.state_dict()}``)."""

OPTIMIZER_KINDS = "optimizer_kinds"
"""Info entry: per optimizer (its index, or its key in a Fabric checkpoint), the qualified names of its class and bases
(:func:`~lightning_dcp.engine.state.optimizer_restore.optimizer_kind`)."""
OPTIMIZER_LISTS = "optimizer_lists"
"""Info entry: per optimizer (its index, or its key in a Fabric checkpoint), the paths of lists in its state
(:func:`list_paths`)."""
PARAM_ID = "param_id"
"""Optimizer layout of ``torch.optim.Optimizer.state_dict()``: state keyed by integer parameter index."""
FQN = "fqn"
"""Optimizer layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``: keyed by FQN."""


def optimizer_layout(optimizer_states: list[Mapping[str, Any]]) -> str:
    """Tell the two optimizer state layouts apart (``"fqn"`` or ``"param_id"``) from the params lists."""
    for osd in optimizer_states:
        for group in osd.get("param_groups", ()):
            for param in group.get("params", ()):
                return PARAM_ID if isinstance(param, int) else FQN
    return FQN


@dataclasses.dataclass(frozen=True)
class TreeRoles:
    """Which top-level keys of a checkpoint's tree hold model weights and which hold optimizer state."""

    modules: tuple[str, ...]
    """Keys whose value is a module's state dict (FQN -> tensor): ``("state_dict",)`` in the Trainer layout."""
    optimizers: tuple[str, ...]
    """Fabric: keys that each hold one optimizer's state. Trainer: ``("optimizer_states",)``, a list of them."""
    trainer: bool
    """Whether this is the Trainer layout (no ``"modules"`` recorded)."""

    def optimizer_index(self, path: tuple) -> int | None:
        """The optimizer a nested-state path (``("optimizer", "state", ...)``) belongs to; ``None``: no optimizer."""
        if not path or path[0] not in self.optimizers:
            return None
        return int(path[1]) if self.trainer and len(path) > 1 else self.optimizers.index(path[0])


def tree_roles(info: Mapping[str, Any]) -> TreeRoles:
    """The roles of a checkpoint's top-level keys, from the info dict recorded in its blob (``"lightning_dcp"``).

    A Fabric checkpoint lists its module and optimizer keys; any other checkpoint (no ``"modules"`` entry) has the
    Trainer layout: weights under ``"state_dict"``, a list of optimizer states under ``"optimizer_states"``.
    """
    if MODULES_INFO not in info:
        return TreeRoles(modules=(MODEL_KEY,), optimizers=(OPTIMIZER_KEY,), trainer=True)
    return TreeRoles(modules=tuple(info[MODULES_INFO]), optimizers=tuple(info.get(OPTIMIZERS_INFO, ())), trainer=False)


def require_trainer_layout(url: str, info: Mapping[str, Any]) -> None:
    """Raise unless the checkpoint at ``url`` (whose blob recorded ``info``) has the Trainer layout.

    A Fabric checkpoint holds the user's own keys (``{"model": ..., "optimizer": ...}``), none of the Trainer state
    Lightning's loaders need (``"state_dict"``, ``"pytorch-lightning_version"``, loops).

    Raises:
        NotACheckpointError: It is a Fabric checkpoint; the message names its keys and how to load it.
    """
    roles = tree_roles(info)
    if not roles.trainer:
        raise NotACheckpointError(
            f"{url!r} is a Fabric checkpoint (written by `fabric.save`, modules under {list(roles.modules)}), not a"
            " Trainer checkpoint: it holds no Lightning Trainer state. Load it with `fabric.load(path, state)`, or"
            f" take its weights into a LightningModule with `lightning_dcp.load_model_weights(model, path,"
            f" key={roles.modules[0] if roles.modules else 'KEY'!r})`."
        )


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split a Lightning checkpoint dict into the engine's tree, objects and info (see this module's docstring).

    Args:
        checkpoint: What ``Trainer.save_checkpoint`` hands to the strategy. Not modified; tensors are not copied.

    Returns:
        ``(tree, objects, info)``: ``{"state_dict", "optimizer_states"}`` and any other entry that is a state dict
        of tensors (``EMAWeightAveraging``'s ``"current_model_state"``) for DCP, the rest of the dict for the
        rank-0 blob, and ``{"optimizer_layout": ..., "optimizer_lists": ...}`` to record (:func:`list_paths`).

    Raises:
        CheckpointError: The dict has no ``"state_dict"``.
    """
    if MODEL_KEY not in checkpoint:
        raise CheckpointError(f"The checkpoint dict has no {MODEL_KEY!r} entry; got keys {sorted(checkpoint)}.")
    tree: dict[str, Any] = {MODEL_KEY: checkpoint[MODEL_KEY]}
    optimizers = None
    if OPTIMIZER_KEY in checkpoint:
        states = list(checkpoint[OPTIMIZER_KEY])
        optimizers = optimizer_layout(states)
        lists = {str(i): found for i, osd in enumerate(states) if (found := list_paths(osd))}
        if optimizers == PARAM_ID:
            # DCP rebuilds integer path components as list indices: store the ids as strings.
            states = [{**osd, "state": {str(k): v for k, v in osd.get("state", {}).items()}} for osd in states]
        tree[OPTIMIZER_KEY] = states
    objects: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if key in (MODEL_KEY, OPTIMIZER_KEY):
            continue
        if key not in (EXTRA_KEY, RANK_KEY) and _tensor_dict(value):
            tree[key] = value  # e.g. EMAWeightAveraging's "current_model_state": DCP entries, not the rank-0 blob
        else:
            objects[key] = value
    info: dict[str, Any] = {"optimizer_layout": optimizers}
    if optimizers is not None and lists:
        info[OPTIMIZER_LISTS] = lists
    return tree, objects, info


def _tensor_dict(value: Any) -> bool:
    """A non-empty mapping of names to tensors (a state dict)."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())
    )


@dataclasses.dataclass(frozen=True)
class SaveParts:
    """What one rank hands a save: the parts :func:`build_state` makes its DCP state dict of.

    Attributes:
        tree: Top-level keys to nested state dicts (see :func:`build_state`).
        objects: Rank 0's non-tensor state (ignored on other ranks).
        rank_objects: This rank's own state.
        info: Facts recorded in the blob's ``"lightning_dcp"`` entry.
        from_rank0: Paths in ``tree`` of replicated values written from rank 0's copy.
    """

    tree: Mapping[str, Any]
    objects: Mapping[str, Any] | None = None
    rank_objects: Mapping[str, Any] | None = None
    info: Mapping[str, Any] | None = None
    from_rank0: Iterable[tuple[Any, ...]] = ()

    def state(self, rank: int, **info: Any) -> dict[str, Any]:
        """The DCP state dict of ``rank``'s part (:func:`build_state`): ``info`` entries added to :attr:`info`.

        Raises:
            CheckpointError: ``tree`` uses a reserved key.
        """
        return build_state(
            self.tree,
            objects=self.objects if rank == 0 else None,
            info={**(self.info or {}), **info},
            rank=rank,
            rank_objects=self.rank_objects,
            from_rank0=self.from_rank0,
        )


def build_state(
    tree: Mapping[str, Any],
    *,
    objects: Mapping[str, Any] | None,
    info: Mapping[str, Any],
    rank: int = 0,
    rank_objects: Mapping[str, Any] | None = None,
    from_rank0: Iterable[tuple[Any, ...]] = (),
) -> dict[str, Any]:
    """The DCP state dict of one rank's part of a save.

    Args:
        tree: Top-level keys to nested state dicts; reserved keys (``"lightning"``, ``"rank_states"``) are refused.
        objects: The rank-0 blob's content (``None`` on the other ranks: exactly one copy is written).
        info: Recorded under ``"lightning_dcp"`` in the blob, with the format version.
        rank: This process's rank.
        rank_objects: This rank's own state, stored as ``rank_states.{rank}``.
        from_rank0: Paths in ``tree`` (``("state_dict", "bn.running_mean")``, ``("optimizer_states", 0, "state",
            "body.0.weight")``, or a whole entry ``("ema",)``; list indices as ``int``) of
            replicated values that may differ between ranks, such as BatchNorm statistics between DDP's broadcasts:
            left out of every other rank's part, so rank 0's copy is the one written, as stock Lightning writes rank
            0's checkpoint. A path whose value holds a DTensor (a shard each rank owns) is kept everywhere.

    Raises:
        CheckpointError: ``tree`` uses a reserved key.
    """
    reserved = {EXTRA_KEY, RANK_KEY} & set(tree)
    if reserved:
        raise CheckpointError(f"The keys {sorted(reserved)} are reserved by lightning_dcp; rename these entries.")
    state: dict[str, Any] = dict(tree)
    if rank != 0:
        copies: set[int] = {id(state)}
        for path in from_rank0:
            _drop(state, tuple(path), copies)
    if objects is not None:
        extra = dict(objects)
        extra[INFO_KEY] = {**info, "format_version": FORMAT_VERSION}
        state[EXTRA_KEY] = encode_extra(extra)
    if rank_objects is not None:
        state[RANK_KEY] = {str(rank): encode_extra(rank_objects)}
    return state


def _drop(state: dict[str, Any], path: tuple[Any, ...], copies: set[int]) -> None:
    """Remove ``path`` (dict keys, list indices) from the nested ``state``.

    The containers on the way are copied (once; ``copies`` holds the copies' ids), never the caller's changed.
    """
    holder: Any = state
    for part in path[:-1]:
        child = _child(holder, str(part))
        if not isinstance(child, (Mapping, list)):
            return
        if id(child) not in copies:  # the tree given to the save stays as it is
            child = dict(child) if isinstance(child, Mapping) else list(child)
            holder[int(part) if isinstance(holder, list) else part] = child
            copies.add(id(child))
        holder = child
    if not isinstance(holder, Mapping) or not path:
        return
    value = holder.get(path[-1])
    if value is not None and not _holds_dtensor(value):
        del holder[path[-1]]


def _holds_dtensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter
    if isinstance(value, Mapping):
        return any(_holds_dtensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_dtensor(v) for v in value)
    return False


def list_paths(optimizer_state: Mapping[str, Any]) -> list[list[str]]:
    """The paths (``["state", FQN, key, ...]``) of the lists in an optimizer state dict's ``state`` that DCP walks.

    DCP saves a list holding tensors (LBFGS's ``old_dirs``, ``old_stps``, ``ro``, ``al``) as one entry per item
    (``...old_dirs.0``), and a restore through the record index, which has no paths, reads them back as dicts keyed
    ``"0"``, ``"1"``, ...; the save records these paths in its info so that :func:`restore_lists` makes them lists
    again. Lists without tensors are single entries and need nothing.
    """
    found: list[list[str]] = []

    def walk(value: Any, path: list[str]) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, [*path, str(key)])
        elif isinstance(value, list) and not terminal_list(value):
            found.append(path)
            for index, item in enumerate(value):
                walk(item, [*path, str(index)])

    state = optimizer_state.get("state")
    for name, values in state.items() if isinstance(state, Mapping) else ():
        if isinstance(values, Mapping):
            for key, item in values.items():  # a parameter's state: no tensor walk over its plain tensors
                if isinstance(item, (Mapping, list)):
                    walk(item, ["state", str(name), str(key)])
    return found


def restore_lists(optimizer_state: dict[str, Any], paths: Iterable[Iterable[str]]) -> None:
    """Make each container at ``paths`` (:func:`list_paths`) in a loaded optimizer state dict a list again.

    A container read as a dict keyed by indices becomes the list of its values in index order; one that is a list
    already (read with DCP's paths) or that the checkpoint lacks is left as it is. Outer lists are rebuilt first.
    """
    for path in sorted((list(p) for p in paths), key=len):
        holder: Any = optimizer_state
        for part in path[:-1]:
            holder = _child(holder, part)
            if holder is None:
                break
        value = None if holder is None or not path else _child(holder, path[-1])
        if not isinstance(value, Mapping) or not value or not all(str(k).isdigit() for k in value):
            continue
        items: list[Any] = [None] * (max(int(k) for k in value) + 1)
        for key, item in value.items():
            items[int(key)] = item
        if isinstance(holder, list):
            holder[int(path[-1])] = items
        else:
            holder[path[-1]] = items


def _child(container: Any, part: str) -> Any:
    if isinstance(container, list):
        return container[int(part)] if part.isdigit() and int(part) < len(container) else None
    if isinstance(container, Mapping):
        return container.get(part, container.get(int(part)) if part.isdigit() else None)
    return None


def saved_world_size(entries: Iterable[str]) -> int | None:
    """The world size a checkpoint was saved at, from its ``rank_states.*`` entries (``None`` without them).

    ``entries``: the checkpoint's flat keys (``metadata.state_dict_metadata``, or its record index).
    """
    prefix = RANK_KEY + "."
    return sum(1 for k in entries if k.startswith(prefix)) or None


def join_checkpoint(
    dcp_state: Mapping[str, Any], extra: Mapping[str, Any], *, in_place: bool, where: str = "The checkpoint"
) -> dict[str, Any]:
    """Reassemble a Lightning checkpoint dict from a loaded DCP state dict and its decoded extra state.

    ``in_place`` records (under ``"lightning_dcp"``) that tensors were loaded into a target from
    ``get_state_dict``, i.e. they are this rank's shards rather than full tensors. ``where``: the checkpoint, for
    messages.

    Raises:
        NotACheckpointError: The optimizer state does not match its own param groups (entries for parameters no
            group lists, or ids that are not integers where the objects say the state is keyed by id).
    """
    checkpoint = dict(extra)
    checkpoint[INFO_KEY] = {**extra.get(INFO_KEY, {}), "loaded_in_place": in_place}
    checkpoint[MODEL_KEY] = dcp_state.get(MODEL_KEY, {})  # DCP stores no entry for an empty dict
    for key, value in dcp_state.items():  # other state dicts saved as DCP entries (split_checkpoint)
        if key not in (MODEL_KEY, OPTIMIZER_KEY, EXTRA_KEY, RANK_KEY):
            checkpoint[key] = value
    if OPTIMIZER_KEY in dcp_state:
        # DCP stores no entry for an empty ``state: {}`` (SGD without momentum, a save before the first step).
        states = [{**osd, "state": dict(osd.get("state", {}))} for osd in dcp_state[OPTIMIZER_KEY]]
        lists = extra.get(INFO_KEY, {}).get(OPTIMIZER_LISTS, {})
        for i, osd in enumerate(states):
            restore_lists(osd, lists.get(str(i), ()))
        if extra.get(INFO_KEY, {}).get("optimizer_layout") == PARAM_ID:
            states = [{**osd, "state": _by_param_id(osd["state"], where)} for osd in states]
        elif not in_place:  # full tensors for a stock strategy or a user: ``optimizer.state_dict()``'s layout
            states = [fqns_to_param_ids(osd, where=where) for osd in states]
        checkpoint[OPTIMIZER_KEY] = states
    return checkpoint


def saved_optimizer_count(metadata: Metadata) -> int:
    """How many optimizers' states a checkpoint holds (0 for a weights-only checkpoint)."""
    indices = {int(path[1]) for path in (metadata.planner_data or {}).values() if path and path[0] == OPTIMIZER_KEY}
    return max(indices) + 1 if indices else 0


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items are unpickled with ``weights_only``.

    DCP's own planner reads them with ``torch.load(weights_only=False)``, which runs code from the file.

    Args:
        weights_only: Passed to ``torch.load`` for every non-tensor item (default True).
        allow_partial_load: Load only the keys the checkpoint has (see ``DefaultLoadPlanner``).
    """

    def __init__(self, *, weights_only: bool = True, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.weights_only = weights_only

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: D102 (DCP's planner contract)
        obj = load_checked(value, weights_only=self.weights_only)  # nothing allocated beyond what it holds
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def metadata_target(metadata: Metadata, *, prefixes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Build an empty nested state dict from DCP metadata: CPU tensors of the saved global shapes and dtypes.

    Args:
        metadata: The checkpoint's DCP metadata.
        prefixes: Only the flat keys starting with one of these (``None``: all).

    Returns:
        A nested dict that ``dcp.load`` fills in place (the whole checkpoint lives in this process's memory).
    """
    target: dict[str, Any] = {}
    mappings = metadata.planner_data or {}
    for key, meta in metadata.state_dict_metadata.items():
        if prefixes is not None and not key.startswith(prefixes):
            continue
        if isinstance(meta, TensorStorageMetadata):
            value: Any = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            value = b""
        else:  # pragma: no cover - DCP has only these two kinds today
            raise CheckpointError(f"Unsupported DCP metadata entry {key!r}: {type(meta).__name__}.")
        if key in mappings:
            set_element(target, mappings[key], value)
        else:
            target[key] = value
    return target


def fqns_to_param_ids(state: Mapping[str, Any], *, where: str = "The checkpoint") -> dict[str, Any]:
    """Re-key an FQN-keyed optimizer state by integer ids in param_groups order (``optimizer.state_dict()``).

    Raises:
        NotACheckpointError: ``state`` has no list of param groups with ``params`` lists, or holds state for a
            parameter no group lists (``where`` names the checkpoint in the message).
    """
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise NotACheckpointError(
            f"{where}: its optimizer state has no valid 'param_groups'; resume from another checkpoint."
        )
    id_of: dict[str, int] = {}
    for group in groups:
        for fqn in group["params"]:
            id_of.setdefault(fqn, len(id_of))
    unknown = [key for key in state.get("state", {}) if key not in id_of]
    if unknown:
        raise NotACheckpointError(
            f"{where}: its optimizer state holds entries for {unknown[:3]!r}, which none of its param groups lists"
            " (its optimizer entries and its saved objects disagree); resume from another checkpoint."
        )
    return {
        "state": {id_of[fqn]: v for fqn, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [id_of[f] for f in g["params"]]} for g in state["param_groups"]],
    }


def _by_param_id(state: Mapping[Any, Any], where: str) -> dict[int, Any]:
    """An optimizer ``state`` saved keyed by parameter ids, with its keys as ``int`` again (DCP stores them as str)."""
    odd = [k for k in state if not (type(k) is int or (isinstance(k, str) and k.isascii() and k.isdigit()))]
    if odd:
        raise NotACheckpointError(
            f"{where}: its objects say the optimizer state is keyed by parameter ids, but it holds entries for"
            f" {odd[:3]!r}; resume from another checkpoint."
        )
    return {int(k): v for k, v in state.items()}
