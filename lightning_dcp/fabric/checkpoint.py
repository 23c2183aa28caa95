"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` on the engine, with Fabric's semantics.

A save writes every rank's part of the state as one committed, checksummed DCP checkpoint
(:mod:`lightning_dcp.fabric.state` says what goes where) plus each rank's RNG states. A load reads lightning_dcp
checkpoints (written through Fabric or the Trainer; resharding to the current world size) and single ``torch.save``
files (Fabric's own format, or the ``.pt`` that ``python -m lightning_dcp.consolidate`` writes), and follows
``Strategy.load_checkpoint``:

- ``state=None`` or ``{}``: the whole checkpoint with full CPU tensors (optimizer state in
  ``optimizer.state_dict()`` layout, as in a ``torch.save`` checkpoint);
- a dict: modules, optimizers and stateful objects are restored in place, other keys are replaced by the saved
  values; the saved entries not asked for come back (tensors among them as full CPU tensors, the modules and
  optimizers nobody asked for left unread). A requested key the checkpoint lacks is an error unless
  ``strict=False``; so are differing module keys. Everything is checked before anything is loaded;
- a module (``fabric.load_raw``): its weights, from a raw state-dict file or from the one module of a checkpoint.

A stateful data loader in the state (a ``DataLoader`` with ``state_dict()``: torchdata's ``StatefulDataLoader``,
LitData's ``StreamingDataLoader``) is saved by every rank as its own (``rank_states.{rank}``, with the RNG states) and
given back to the same rank at the same world size. At another world size LitData's loader gets rank 0's state and
restripes the epoch's rest itself; any other loader is refused (:func:`lightning_dcp.engine.state.loaders.refuse`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from lightning.fabric.wrappers import _FabricOptimizer
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.nn import Module
from torch.optim import Optimizer

from lightning_dcp.engine import (
    STEP_GATE,
    Checkpointer,
    Loaded,
    Location,
    Probe,
    RestoreRecord,
    designates_last,
    layout,
    on_rank0,
    parsed_meanwhile_forgotten,
    probe,
    rank_and_world,
    read_torch_file,
)
from lightning_dcp.engine.state.loaders import is_stateful_loader, refuse, reshards_itself
from lightning_dcp.engine.state.module_state import load_model_state_dict
from lightning_dcp.engine.state.optimizer_restore import load_optimizer_state_dict
from lightning_dcp.engine.state.rng import collect_rng_states, resume_rng_states
from lightning_dcp.errors import CheckpointError, NotACheckpointError
from lightning_dcp.fabric.state import (
    LOADERS_INFO,
    check_requested,
    is_stateful,
    load_targets,
    owner_of,
    rank0_paths,
    saved_keys,
    split_state,
    unwrap,
)

__all__ = ["load_state", "save_state"]


def save_state(
    checkpointer: Checkpointer,
    path: str,
    state: Mapping[str, Any],
    *,
    filters: Mapping[str, Callable[[str, Any], bool]] | None = None,
    info: Mapping[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    synced: Collection[int] | None = None,
) -> None:
    """Save a Fabric state dict as a DCP checkpoint at ``path``; every rank writes its part.

    ``synced``: the ids of the parameters DDP all-reduces (``None``: not under DDP); the others are written from
    rank 0 (:func:`~lightning_dcp.fabric.state.rank0_paths`).

    Collective: call on all ranks with the same ``path``.

    Raises:
        CheckpointError: Writing failed on some rank (nothing was committed), or the state cannot be split.
    """
    for value in state.values():  # an optimizer whose steps skip torch.optim's hooks: async saves copy at the call
        value = value.optimizer if isinstance(value, _FabricOptimizer) else value
        if isinstance(value, Optimizer):
            STEP_GATE.check(value)
    loaders = {key: obj.state_dict() for key, obj in state.items() if is_stateful_loader(obj)}
    tree, objects, layout_info = split_state({k: v for k, v in state.items() if k not in loaders}, filters=filters)
    rank_objects: dict[str, Any] = {"rng": collect_rng_states()}
    if loaders:  # each rank's own position (and workers' state): per rank, never rank 0's for all
        rank_objects[LOADERS_INFO], layout_info[LOADERS_INFO] = loaders, sorted(loaders)
    checkpointer.save(
        tree,
        path,
        objects=objects,
        rank_objects=rank_objects,
        info={**(info or {}), **layout_info},
        storage_options=storage_options,
        collective=True,
        volatile=_volatile(state, tree, layout_info),
        from_rank0=rank0_paths(state, tree, layout_info, synced=synced),
        step=next((v for k in _STEP_KEYS if isinstance(v := state.get(k), int) and not isinstance(v, bool)), None),
    )


def _volatile(state: Mapping[str, Any], tree: Mapping[str, Any], info: Mapping[str, Any]) -> list[torch.Tensor]:
    """What may change in place before the next optimizer step: module buffers and tensors of neither role."""
    volatile = [b for value in state.values() if isinstance(value, Module) for b in unwrap(value).buffers()]
    held = {*info.get(layout.MODULES_INFO, ()), *info.get(layout.OPTIMIZERS_INFO, ())}
    stack = [value for key, value in tree.items() if key not in held]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            volatile.append(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return volatile


_STEP_KEYS = ("global_step", "step", "iteration", "iter_num")
"""Entries of a Fabric state that hold the training step (the first found is recorded in ``.commit``)."""


def load_state(
    checkpointer: Checkpointer,
    path: str,
    state: Module | Optimizer | dict[str, Any] | None,
    *,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` as ``Strategy.load_checkpoint`` does (see this module's docstring).

    With a memory tier, a ``last`` path of a directory (and the tier's ``memory_dir/last``) loads the newest committed
    checkpoint across memory, the peers' replicas and that directory, which becomes the one the tier persists into.

    Collective: call on all ranks with the same ``path``.

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        NotACheckpointError: Not a readable checkpoint (or an incomplete save).
        StateDictMismatchError: Keys, shapes or dtypes differ from ``state``; nothing was loaded.
        CheckpointError: Non-tensor state that ``weights_only`` refuses, or a request the checkpoint cannot serve.
    """
    weights_only = True if weights_only is None else weights_only
    checkpointer.wait(collective=True)  # a background save to this path must land before it is probed
    started = time.perf_counter()
    loaded = _load_state(checkpointer, path, state, strict=strict, weights_only=weights_only)
    checkpointer.saves.restore = RestoreRecord(url=path, tier=None, restore_s=time.perf_counter() - started)
    return loaded


def _load_state(
    checkpointer: Checkpointer,
    path: str,
    state: Module | Optimizer | dict[str, Any] | None,
    *,
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    location = checkpointer.location(path)
    route = checkpointer.memory_route
    if route is not None and not route.covers(location) and designates_last(location):
        route.bind(location.parent())  # a restarted run: `last` of the saves' directory
    with parsed_meanwhile_forgotten():  # the probe's parsed metadata too dies with the collector paused
        if route is not None and route.covers(location):  # the newest across memory and the durable tiers
            head = checkpointer.load(path, target={}, strict=False, collective=True, only=[], weights_only=weights_only)
            with route.copy_of(head) as newest:
                return _load_one(checkpointer, newest, state, strict=strict, weights_only=weights_only)
        return _load_one(checkpointer, path, state, strict=strict, weights_only=weights_only)


def _load_one(
    checkpointer: Checkpointer,
    path: str,
    state: Module | Optimizer | dict[str, Any] | None,
    *,
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    """:func:`load_state` of the one checkpoint (or file) at ``path``. Collective."""
    found = on_rank0(True, lambda: probe(checkpointer.location(path)))
    if found.kind == "file":
        return _load_file(checkpointer.location(found.url), state, strict=strict, weights_only=weights_only)
    if found.kind == "lightning":
        raise NotACheckpointError(
            f"{found.url!r} was written by Lightning's own sharded strategy (it has meta.pt), not by lightning_dcp."
            " Load it with that strategy, then `fabric.save` it again under a dcp_* strategy."
        )
    if not state:
        return _load_everything(checkpointer, found, weights_only=weights_only)
    if isinstance(state, Optimizer):
        raise CheckpointError(
            f"{found.url!r} keys optimizer state by parameter names: load it together with its module,"
            " `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )
    head = checkpointer.load(
        found.url, target={}, strict=False, collective=True, weights_only=weights_only, objects_only=True, checked=found
    )
    info = head.objects.pop(layout.INFO_KEY, {})
    roles = layout.tree_roles(info)
    if isinstance(state, Module):
        _load_module(checkpointer, found, state, roles, strict=strict, weights_only=weights_only)
        return {}
    loaders = _loader_states(found.url, state, head, info.get(LOADERS_INFO, []))  # refused before anything loads
    remainder = _load_dict(checkpointer, found, state, head, roles, strict, weights_only, loaders, info)
    for key, value in loaders.items():
        if key in state:
            state[key].load_state_dict(value)
        else:
            remainder[key] = value
    _restore_rng(head)
    return remainder


def _loader_states(url: str, state: dict[str, Any], head: Loaded, keys: list[str]) -> dict[str, Any]:
    """The saved loader states to give back: this rank's own, or rank 0's to a loader that reshards itself.

    Raises:
        CheckpointError: At another world size, a requested loader that cannot reshard its position.
    """
    saved = (head.rank_objects or {}).get(LOADERS_INFO, {})
    if head.rank_objects_exact or not saved:
        return dict(saved)
    refused = [k for k in keys if k in state and is_stateful_loader(state[k]) and not reshards_itself(state[k])]
    if refused:
        raise refuse(
            [repr(k) for k in refused],
            saved_world_size=head.saved_world_size,
            world_size=rank_and_world(True)[1],
            path=url,
            hint="Or leave these keys out of the state given to `fabric.load`: their loaders then start the epoch"
            " afresh.",
        )
    return {k: v for k, v in saved.items() if k in state and reshards_itself(state[k])}


# ------------------------------------------------------------------------------------------------ directories
def _load_everything(checkpointer: Checkpointer, found: Probe, *, weights_only: bool) -> dict[str, Any]:
    loaded = checkpointer.load(found.url, collective=True, weights_only=weights_only, checked=found)
    tree = {k: v for k, v in loaded.tree.items() if k != layout.RANK_KEY}
    info = loaded.objects.get(layout.INFO_KEY, {})
    roles = layout.tree_roles(info)
    if roles.trainer:
        checkpoint = layout.join_checkpoint(tree, loaded.objects, in_place=False, where=loaded.url)
        checkpoint.pop(layout.INFO_KEY, None)
        return checkpoint
    checkpoint = {k: v for k, v in loaded.objects.items() if k != layout.INFO_KEY}
    for key, value in tree.items():
        if key in roles.optimizers:  # as `optimizer.state_dict()` gives it (an empty state is not stored by DCP)
            value = layout.fqns_to_param_ids({"state": {}, **value})
        checkpoint[key] = value
    return checkpoint


def _load_module(
    checkpointer: Checkpointer,
    found: Probe,
    module: Module,
    roles: layout.TreeRoles,
    *,
    strict: bool,
    weights_only: bool,
) -> None:
    url = found.url
    if len(roles.modules) != 1:
        raise CheckpointError(
            f"{url!r} holds {len(roles.modules)} modules ({list(roles.modules)}): name the one to load,"
            " e.g. `fabric.load(path, {'model': model}, strict=False)`."
        )
    key = roles.modules[0]
    targets = load_targets(url, {key: module}, found.metadata, roles=roles, strict=strict)
    if key not in targets.tree:
        raise NotACheckpointError(f"{url!r} holds no weights under {key!r}.")
    loaded = checkpointer.load(
        url, target=targets.tree, strict=False, collective=True, only=[key], weights_only=weights_only, checked=found
    )
    set_model_state_dict(unwrap(module), loaded.tree[key], options=StateDictOptions(strict=False))


def _load_dict(
    checkpointer: Checkpointer,
    found: Probe,
    state: dict[str, Any],
    head: Loaded,
    roles: layout.TreeRoles,
    strict: bool,
    weights_only: bool,
    loaders: Mapping[str, Any],
    info: Mapping[str, Any],
) -> dict[str, Any]:
    url, metadata = found.url, found.metadata
    saved = saved_keys(metadata)
    objects = dict(head.objects)
    check_requested(url, state, [*saved, *objects, *loaders], strict=strict)
    unasked = [k for k in saved if k not in state and k not in roles.modules and k not in roles.optimizers]
    kinds, lists = info.get(layout.OPTIMIZER_KINDS, {}), info.get(layout.OPTIMIZER_LISTS, {})
    targets = load_targets(url, state, metadata, roles=roles, strict=strict, extra_keys=unasked, kinds=kinds)
    tree: dict[str, Any] = {}
    if targets.tree:
        only = list(targets.tree)
        loaded = checkpointer.load(
            url, target=targets.tree, strict=False, collective=True, only=only, weights_only=weights_only, checked=found
        )
        tree = loaded.tree
    for key, module in targets.modules.items():  # filled in place: DCP's set_* where they do more than copy
        load_model_state_dict(module, tree[key], strict=False)
    for key, (owner, optimizer) in targets.optimizers.items():  # torch.optim's semantics: its own load_state_dict
        layout.restore_lists(tree[key], lists.get(key, ()))
        load_optimizer_state_dict(owner, optimizer, tree[key], where=url)
    remainder = objects
    for key, obj in list(state.items()):
        if key in targets.modules or key in targets.optimizers:
            continue
        if key in tree:
            _restore(state, key, obj, tree[key])
        elif key in remainder:
            _restore(state, key, obj, remainder.pop(key))
    remainder.update({key: tree[key] for key in unasked})
    return remainder


def _restore(state: dict[str, Any], key: str, obj: Any, value: Any) -> None:
    """An object with ``load_state_dict`` is restored in place; any other value is replaced (Fabric's rule)."""
    if is_stateful(obj) and not isinstance(obj, (Module, Optimizer)):
        obj.load_state_dict(value)
    else:
        state[key] = value


def _restore_rng(head: Loaded) -> None:
    saved = head.rank_objects
    if not saved or "rng" not in saved:
        return
    rank, world_size = rank_and_world(True)
    if resume_rng_states(saved["rng"], exact=head.rank_objects_exact, rank=rank):
        return
    rank_zero_warn(
        f"The checkpoint was saved at world size {head.saved_world_size} and is loaded at {world_size}: per-rank"
        " random states cannot carry over one-to-one, so each rank's generators (torch, numpy, python) are"
        " re-seeded deterministically from rank 0's saved state and the rank. Model, optimizer and the other"
        " saved values are exact."
    )


# ------------------------------------------------------------------------------------------------------ files
def _expect_state_dict(url: str, where: str, value: Any) -> None:
    """Raise unless ``value`` (what the file holds for a module or optimizer) is a state dict."""
    if not isinstance(value, dict):
        raise NotACheckpointError(
            f"{url!r} holds a {type(value).__name__} under {where}, where a state dict (a dict of tensors) belongs:"
            " it was not saved from this module or optimizer. Load it without that key, or from the right file."
        )


def _load_file(
    location: Location, state: Module | Optimizer | dict[str, Any] | None, *, strict: bool, weights_only: bool
) -> dict[str, Any]:
    """A ``torch.save`` file, read whole on every rank (as Fabric does), applied as full state dicts."""
    checkpoint = read_torch_file(location, map_location="cpu", weights_only=weights_only)
    full = StateDictOptions(full_state_dict=True, strict=strict)
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(f"{location.url!r} holds a {type(checkpoint).__name__}, not a checkpoint dict.")
    if not state:
        return checkpoint
    if isinstance(state, (Module, Optimizer)):
        _expect_state_dict(location.url, "the file", checkpoint)
    if isinstance(state, Module):
        set_model_state_dict(unwrap(state), checkpoint, options=full)
        return {}
    if isinstance(state, Optimizer):
        state.load_state_dict(checkpoint)
        return {}
    check_requested(location.url, state, checkpoint, strict=strict)
    modules = {k: unwrap(v) for k, v in state.items() if isinstance(v, Module)}
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, (Module, Optimizer)):
            _expect_state_dict(location.url, repr(key), value)
        if isinstance(obj, Module):
            set_model_state_dict(modules[key], value, options=full)
        elif isinstance(obj, Optimizer):  # full tensors (ids or FQNs): cut to this rank's shards where sharded
            load_optimizer_state_dict(owner_of(key, obj, modules), obj, value, where=location.url)
        else:
            _restore(state, key, obj, value)
    return checkpoint
