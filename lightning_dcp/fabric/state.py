"""How a Fabric state dict maps onto the engine's tree, objects and info, and how a checkpoint is checked against one.

``fabric.save(path, state)`` hands the strategy a flat dict of the user's objects. Each top-level key keeps its name
in the checkpoint (see :mod:`lightning_dcp.engine.format.layout`):

- a module: its ``get_model_state_dict`` (FQN keys; DTensor shards stay sharded), a DCP entry per tensor;
- an optimizer: its ``optimizer.state_dict()`` keyed by parameter FQN (``get_optimizer_state_dict``'s layout: state
  only for the parameters that have it, every param group with all its options);
- any other value holding tensors (a tensor, or a dict of tensors and plain values, also from an object's
  ``state_dict()``): DCP entries;
- everything else: the rank-0 blob, as ``torch.save`` would keep it.

``filter={key: fn}`` keeps the items ``(name, value)`` of that key's state dict for which ``fn`` is true, as Fabric
applies it (a key left without any item is not saved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_dcp.engine import layout
from lightning_dcp.engine.state.module_state import (
    model_state_dict,
    optimizer_state_dict,
    optimizer_target,
    parameters_by_fqn,
)
from lightning_dcp.engine.state.optimizer_restore import check_groups, check_kind, optimizer_kind
from lightning_dcp.engine.state.optimizer_target import OptimizerTarget, fill_pending, saved_entries
from lightning_dcp.errors import CheckpointError, StateDictMismatchError

__all__ = [
    "LOADERS_INFO",
    "Targets",
    "check_requested",
    "is_stateful",
    "load_targets",
    "owner_of",
    "rank0_paths",
    "saved_keys",
    "split_state",
    "unwrap",
]

FRONT_END = "fabric"
LOADERS_INFO = layout.LOADERS_INFO
"""Info entry of a Fabric checkpoint: the keys of the stateful data loaders, whose states each rank saved itself."""
_PLAIN = (bool, int, float, str, bytes, type(None))
_HINT = "Load a checkpoint of this model, or pass `strict=False` to load only the keys both have."


def unwrap(module: Module) -> Module:
    """The module whose FQNs name the checkpoint entries (DDP's wrapper removed; FSDP wrappers are understood)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows Fabric's ``_Stateful`` protocol (``state_dict()`` and ``load_state_dict()``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def owner_of(key: str, optimizer: Optimizer, modules: Mapping[str, Module]) -> Module:
    """The module of ``modules`` that holds every parameter of ``optimizer`` (its FQNs name the optimizer state).

    Raises:
        CheckpointError: No module in the state holds all of them.
    """
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if params <= {id(p) for p in module.parameters()}:
            return module
    raise CheckpointError(
        f"The optimizer under {key!r} optimizes parameters of no single module in the state (modules:"
        f" {sorted(modules)}). Put the module it trains into the same state dict, e.g."
        f" `{{'model': model, {key!r}: optimizer}}`: its parameter names key the optimizer state."
    )


def _tensor_tree(value: Any) -> tuple[bool, bool]:
    """``(fits, has_tensor)``: whether DCP stores ``value`` faithfully as nested entries, and holds a tensor.

    DCP flattens dicts (string keys; an empty dict would vanish) and stores other leaves pickled; lists holding
    tensors would come back rebuilt, so they go to the blob.
    """
    if isinstance(value, torch.Tensor):
        return True, True
    if isinstance(value, Mapping):
        if not value or not all(isinstance(k, str) for k in value):
            return False, False
        found = False
        for item in value.values():
            fits, has_tensor = _tensor_tree(item)
            if not fits:
                return False, False
            found = found or has_tensor
        return True, found
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _PLAIN) for v in value), False
    return isinstance(value, _PLAIN), False


def _filtered(key: str, value: Any, filters: Mapping[str, Callable[[str, Any], bool]]) -> tuple[bool, Any]:
    if key not in filters or not isinstance(value, dict):
        return True, value
    kept = {name: item for name, item in value.items() if filters[key](name, item)}
    return bool(kept), kept


def split_state(
    state: Mapping[str, Any],
    *,
    filters: Mapping[str, Callable[[str, Any], bool]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Turn a Fabric state dict into the engine's ``(tree, objects, info)``.

    Args:
        state: ``{key: module | optimizer | stateful object | tensor | any value}`` (Fabric's wrappers removed).
        filters: ``fabric.save(..., filter=...)``: per key, a predicate on the ``(name, value)`` items of its state
            dict.

    Returns:
        The tree (modules, optimizers, tensor-holding values), the blob's content (everything else) and the info
        to record (``"modules"``, ``"optimizers"``: the keys of each kind that were saved).

    Collective: call on all ranks (``get_optimizer_state_dict`` initialises lazy optimizer state collectively under
    FSDP).

    Raises:
        CheckpointError: An optimizer whose parameters no module in the state holds.
    """
    filters = filters or {}
    modules = {k: unwrap(v) for k, v in state.items() if isinstance(v, Module)}
    tree: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    roles: dict[str, list[str]] = {layout.MODULES_INFO: [], layout.OPTIMIZERS_INFO: []}
    lists: dict[str, list[list[str]]] = {}
    kinds: dict[str, list[str]] = {}
    for key, obj in state.items():
        role = None
        if isinstance(obj, Module):
            value, role = model_state_dict(modules[key]), layout.MODULES_INFO
        elif isinstance(obj, Optimizer):
            owner = owner_of(key, obj, modules)
            value, role = optimizer_state_dict(owner, obj), layout.OPTIMIZERS_INFO
        else:
            value = obj.state_dict() if is_stateful(obj) else obj
        keep, value = _filtered(key, value, filters)
        if not keep:
            continue
        if role is not None:
            tree[key] = value
            roles[role].append(key)
            if role == layout.OPTIMIZERS_INFO:
                kinds[key] = optimizer_kind(obj)
                if found := layout.list_paths(value):
                    lists[key] = found
        elif all(_tensor_tree(value)):
            tree[key] = value
        else:
            objects[key] = value
    info: dict[str, Any] = {"front_end": FRONT_END, **roles, "optimizer_layout": layout.FQN}
    if lists:
        info[layout.OPTIMIZER_LISTS] = lists
    if kinds:
        info[layout.OPTIMIZER_KINDS] = kinds
    return tree, objects, info


def rank0_paths(
    state: Mapping[str, Any],
    tree: Mapping[str, Any],
    info: Mapping[str, Any],
    *,
    synced: Collection[int] | None = None,
) -> list[tuple[Any, ...]]:
    """The paths in ``tree`` whose values rank 0 writes (:func:`~lightning_dcp.engine.format.layout.build_state`).

    Each module's buffers (BatchNorm statistics differ between DDP's broadcasts at each forward), every entry that is
    neither a module's nor an optimizer's state (tensors a user keeps, which may differ between ranks) and, given
    ``synced`` (the ids of the parameters DDP all-reduces), the other parameters with their optimizer state (frozen
    when DDP wrapped the module, trained apart on each rank since): stock Fabric writes rank 0's copy of all of these.
    """
    paths: list[tuple[Any, ...]] = []
    modules = info.get(layout.MODULES_INFO, ())
    for key in modules:
        module, saved = state.get(key), tree.get(key, {})
        if not isinstance(module, Module):
            continue
        params = parameters_by_fqn(unwrap(module))
        paths += [(key, name) for name in saved if name not in params]  # buffers (and modules' extra state)
        if synced is None or all(id(p) in synced for p in params.values()):
            continue
        unsynced = [fqn for fqn, p in params.items() if id(p) not in synced]
        paths += [(key, fqn) for fqn in unsynced if fqn in saved]
        for name in info.get(layout.OPTIMIZERS_INFO, ()):
            held = tree.get(name, {}).get("state", {})
            paths += [(name, "state", fqn) for fqn in unsynced if fqn in held]
    held_keys = {*modules, *info.get(layout.OPTIMIZERS_INFO, ())}
    return paths + [(key,) for key in tree if key not in held_keys]


# ------------------------------------------------------------------------------------------------------- load
def saved_keys(metadata: Metadata) -> dict[str, dict[str, Any]]:
    """Per top-level key of the checkpoint's tree, its flat DCP keys and their metadata (blobs left out)."""
    mappings = metadata.planner_data or {}
    keys: dict[str, dict[str, Any]] = {}
    for flat, meta in metadata.state_dict_metadata.items():
        head = mappings.get(flat, (flat,))[0]
        if head not in (layout.EXTRA_KEY, layout.RANK_KEY):
            keys.setdefault(str(head), {})[flat] = meta
    return keys


@dataclasses.dataclass
class Targets:
    """What a load reads into: in-place targets per key, and what each key is."""

    tree: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``{key: target}`` for ``dcp.load``: this rank's module and optimizer state, full CPU tensors otherwise."""
    modules: dict[str, Module] = dataclasses.field(default_factory=dict)
    optimizers: dict[str, tuple[Module, Optimizer]] = dataclasses.field(default_factory=dict)
    """``{key: (owner module, optimizer)}``."""


def check_requested(path: str, requested: Iterable[str], available: Iterable[str], *, strict: bool) -> list[str]:
    """The requested keys the checkpoint lacks; with ``strict`` any of them is an error, as in Fabric.

    Without ``strict`` the missing keys are left as they are, with a warning naming them (and saying when nothing at
    all was loaded). A module asked for under a key that a Trainer checkpoint does not have (``{"model": model}``;
    the Trainer keeps the weights under ``"state_dict"``) is answered with the way to load it.

    Raises:
        StateDictMismatchError: ``strict`` and a requested key is not in the checkpoint.
    """
    available = set(available)
    missing = sorted(set(requested) - available)
    if not missing:
        return missing
    hint = ""
    modules = [k for k in missing if isinstance(requested, Mapping) and isinstance(requested[k], Module)]
    if modules and layout.MODEL_KEY in available:
        hint = (
            f" {path!r} is a Trainer checkpoint: its model weights are under {layout.MODEL_KEY!r}. Load them with"
            f" `fabric.load(path, {{{layout.MODEL_KEY!r}: {modules[0]}}})`, or weights only with"
            f" `lightning_dcp.load_model_weights({modules[0]}, path)`."
        )
    if strict:
        raise StateDictMismatchError(
            path,
            missing_keys=missing,
            hint=hint.strip()
            or f"The checkpoint holds {sorted(available)}. Pass `strict=False` to load the keys it has (the others"
            " stay as they are).",
        )
    nothing = " Nothing was loaded." if not set(requested) & available else ""
    rank_zero_warn(
        f"lightning_dcp: {path!r} holds no {', '.join(map(repr, missing))} (it holds {sorted(available)}); with"
        f" `strict=False` they stay as they are.{nothing}{hint}",
    )
    return missing


def load_targets(
    path: str,
    state: Mapping[str, Any],
    metadata: Metadata,
    *,
    roles: layout.TreeRoles,
    strict: bool,
    extra_keys: Iterable[str] = (),
    kinds: Mapping[str, list[str]] | None = None,
) -> Targets:
    """Build the in-place load targets for ``state`` and check them against the checkpoint before anything loads.

    Args:
        path: The checkpoint (for messages).
        state: The user's state dict (wrappers removed).
        metadata: The checkpoint's DCP metadata.
        roles: Which of its keys are modules and optimizers.
        strict: Module keys must match exactly (otherwise the shared ones load); optimizers always must.
        extra_keys: Further tree keys to read as full CPU tensors (values not in ``state``, for the remainder).
        kinds: Per optimizer key, the saved optimizer's kind (the checkpoint's info), to refuse another kind.

    Collective: call on all ranks. An optimizer's target holds what the checkpoint records for it
    (:func:`~lightning_dcp.engine.state.optimizer_target.fill_pending`), whatever the optimizer holds now; it is
    applied with the optimizer's own ``load_state_dict`` once read.

    Raises:
        StateDictMismatchError: Keys (``strict``), shapes or dtypes differ, or an optimizer has another number of
            param groups than its saved state; the message names them.
    """
    saved = saved_keys(metadata)
    modules = {k: unwrap(v) for k, v in state.items() if isinstance(v, Module)}
    targets = Targets()
    for key, obj in state.items():
        if key not in saved:
            continue
        if isinstance(obj, Module):
            targets.tree[key] = _module_target(path, key, modules[key], saved[key], metadata, strict=strict)
            targets.modules[key] = modules[key]
        elif isinstance(obj, Optimizer):
            owner = owner_of(key, obj, modules)
            target = optimizer_target(owner, obj)  # made from what the checkpoint holds
            fill_pending({key: target}, saved_entries(metadata=metadata), paths=metadata.planner_data or None)
            if isinstance(target, OptimizerTarget):  # not FSDP1's (DCP's own, checked by DCP)
                _check_optimizer(path, key, obj, target, (kinds or {}).get(key))
            targets.tree[key] = target
            targets.optimizers[key] = (owner, obj)
        elif key not in roles.modules and key not in roles.optimizers:
            targets.tree[key] = _full_target(metadata, key)
    for key in extra_keys:
        if key in saved and key not in state:
            targets.tree[key] = _full_target(metadata, key)
    return targets


def _module_target(
    path: str, key: str, module: Module, saved: Mapping[str, Any], metadata: Metadata, *, strict: bool
) -> dict[str, Any]:
    mappings = metadata.planner_data or {}
    saved_fqns = {str(mappings.get(flat, (flat,))[1]): meta for flat, meta in saved.items() if flat != key}
    live = model_state_dict(module)
    missing = sorted(set(live) - set(saved_fqns))
    unexpected = sorted(set(saved_fqns) - set(live))
    mismatched = _mismatched({fqn: (saved_fqns[fqn], value) for fqn, value in live.items() if fqn in saved_fqns})
    if mismatched or (strict and (missing or unexpected)):
        raise StateDictMismatchError(
            path,
            missing_keys=[f"{key}.{k}" for k in missing] if strict else (),
            unexpected_keys=[f"{key}.{k}" for k in unexpected] if strict else (),
            mismatched={f"{key}.{k}": v for k, v in mismatched.items()},
            hint=_HINT,
        )
    return {fqn: value for fqn, value in live.items() if fqn in saved_fqns}


def _check_optimizer(
    path: str, key: str, optimizer: Optimizer, target: Mapping[str, Any], kind: list[str] | None
) -> None:
    """Refuse, before anything loads, an optimizer state of another kind of optimizer or number of param groups."""
    what = f"The optimizer state under {key!r}"
    check_kind(optimizer, kind, path, what=what)
    check_groups(optimizer, list(target.get("param_groups", ())), path, what=what)


def _mismatched(pairs: Mapping[str, tuple[Any, Any]]) -> dict[str, tuple]:
    out = {}
    for name, (meta, value) in pairs.items():
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata):
            if tuple(meta.size) != tuple(value.shape) or meta.properties.dtype != value.dtype:
                out[name] = (tuple(meta.size), meta.properties.dtype, tuple(value.shape), value.dtype)
    return out


def _full_target(metadata: Metadata, key: str) -> Any:
    """Full CPU tensors (and placeholders for small values) of the saved entries under ``key``."""
    return layout.metadata_target(metadata, prefixes=(key,))[key]
