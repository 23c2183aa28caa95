"""``get_model_state_dict`` / ``get_optimizer_state_dict`` with their per-call work done once per model.

DCP's ``get_model_state_dict`` and ``get_optimizer_state_dict`` (``torch.distributed.checkpoint.state_dict``) map
every parameter to its FQN at every call: for a model of thousands of small tensors that costs more than writing
them (about 100 ms for 4,800 tensors here). For a model without sharded parameters (single device, DDP), their
result is ``module.state_dict()`` and ``optimizer.state_dict()`` with parameter ids replaced by FQNs. The first
call for a model (and optimizer) runs DCP's function and checks that the plain state dict gives exactly the same
keys and tensors; while the model's keys and the optimizer's parameters stay the same, later calls build the result
from the plain state dicts. Anything else (DTensor or ShardedTensor values, FSDP1, a mismatch) always goes through
DCP. An optimizer without state yet is never stepped by DCP here
(:func:`~lightning_dcp.engine.state.optimizer_target.no_init_step`): its state is empty, as ``optimizer.state_dict()``
gives it.

A restore does not go through DCP's ``set_optimizer_state_dict`` (which refuses a parameter that requires grad but has
no saved state, and splits the saved groups by the optimizer's present ones): its target is built from the
checkpoint (:mod:`~lightning_dcp.engine.state.optimizer_target`) and applied with the optimizer's own
``load_state_dict`` (:mod:`~lightning_dcp.engine.state.optimizer_restore`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_dcp._compat.torch_dcp import ShardedTensor, own_state_tensors, parameter_fqns
from lightning_dcp.engine.state.optimizer_target import OptimizerTarget, no_init_step

__all__ = [
    "has_fsdp1",
    "load_model_state_dict",
    "model_state_dict",
    "optimizer_state_dict",
    "optimizer_target",
    "parameters_by_fqn",
]

_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()
_OPTIMIZERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, tuple[int, ...], list[str]]] = (
    weakref.WeakKeyDictionary()
)


def model_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(module)`` (default options): FQN keys, detached tensors (DTensor shards as they are).

    Collective where DCP's is (FSDP); call on all ranks.
    """
    keys = _MODELS.get(module)
    if keys is not None:
        state = module.state_dict()
        if tuple(state) == keys and _plain(state.values()):
            return state
        _MODELS.pop(module, None)
    if _plain_tree(module):  # DCP's result is module.state_dict(): its FQN mapping maps nothing
        state = module.state_dict()
        if _plain(state.values()):
            _MODELS[module] = tuple(state)
            return state
    state = get_model_state_dict(module, options=StateDictOptions())
    if _plain(state.values()) and not _has_fsdp1(module):
        plain = module.state_dict()
        if list(plain) == list(state) and all(_same(plain[k], v) for k, v in state.items()):
            _MODELS[module] = tuple(state)
    return state


def optimizer_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict(module, optimizer)`` (default options): state and param_groups keyed by FQN.

    What a save writes: ``optimizer.state_dict()`` with each parameter id replaced by its FQN (state only for the
    parameters that have it, every param group with all its options). For an optimizer without state yet the
    ``state`` is empty, as in ``optimizer.state_dict()``, instead of DCP's: DCP would first run an optimizer step on
    zero gradients to create it (``_init_optim_state``), changing the optimizer (its ``step`` counts) and costing a
    whole step. Under FSDP1 DCP's behaviour is kept.

    Collective where DCP's is (FSDP); call on all ranks.
    """
    if not optimizer.state and not _has_fsdp1(module):
        return _stateless(module, optimizer)
    cached = _OPTIMIZERS.get(optimizer)
    if cached is not None and cached[0]() is module and optimizer.state:
        ids = _param_ids(optimizer)
        if ids == cached[1]:
            built = _by_fqn(optimizer.state_dict(), cached[2])
            if built is not None:
                return built
        _OPTIMIZERS.pop(optimizer, None)
    state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions())
    _warn_per_rank_state(optimizer)
    if optimizer.state and module in _MODELS:
        fqns = [fqn for group in state.get("param_groups", ()) for fqn in group["params"]]
        built = _by_fqn(optimizer.state_dict(), fqns)
        if built is not None and _equal_optimizer_states(built, state):
            _OPTIMIZERS[optimizer] = (weakref.ref(module), _param_ids(optimizer), fqns)
    return state


_WARNED: set[tuple[str, str]] = set()


def _warn_per_rank_state(optimizer: torch.optim.Optimizer) -> None:
    """Warn (once per kind and key) of state that no checkpoint can reshard: a sharded parameter's per-rank tensor.

    torch.optim's optimizers keep a DTensor parameter's state as DTensors (``zeros_like(param)``), which DCP writes
    shard by shard. A plain tensor of the shape of this rank's shard is each rank's own: DCP writes one rank's copy
    under its key, so no resume, at any world size, gives every rank its own back
    (:func:`~lightning_dcp.engine.state.optimizer_restore.load_optimizer_state_dict` refuses it).
    """
    for param, values in optimizer.state.items():
        if not isinstance(param, DTensor) or not isinstance(values, dict):
            continue
        local = tuple(param.to_local().shape)
        for key, value in values.items():
            if type(value) is torch.Tensor and value.dim() > 0 and tuple(value.shape) == local != tuple(param.shape):
                found = (type(optimizer).__name__, str(key))
                if found not in _WARNED:
                    _WARNED.add(found)
                    warnings.warn(
                        f"lightning_dcp: {type(optimizer).__name__} keeps its state {key!r} of a sharded (DTensor)"
                        f" parameter as a plain tensor of this rank's shard ({local} of {tuple(param.shape)}): each"
                        " rank's is its own, and a checkpoint keeps one copy under its key, so no resume can restore"
                        " it. Make the optimizer create its state as DTensors (`torch.zeros_like(param)`), or save"
                        " with `state_dict_type='full'`.",
                        stacklevel=3,
                    )


def optimizer_target(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The restore target of ``optimizer``, made by the read from what the checkpoint holds.

    An empty :class:`~lightning_dcp.engine.state.optimizer_target.OptimizerTarget`. Under FSDP1 (flat parameters,
    GPU only) DCP's own target (:func:`optimizer_state_dict`) and restore are kept: FSDP's optimizer state API maps
    its flat parameters.
    """
    if _has_fsdp1(module):
        return optimizer_state_dict(module, optimizer)
    return OptimizerTarget.of(parameters_by_fqn(module), optimizer)


def parameters_by_fqn(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` under each of its FQNs as DCP names them (a tied one under each name).

    For a plain model (:func:`model_state_dict` found its FQNs are its own names) these are
    ``named_parameters(remove_duplicate=False)``; otherwise DCP's mapping of each name.
    """
    if module in _MODELS or _plain_tree(module):
        return dict(module.named_parameters(remove_duplicate=False))
    return parameter_fqns(module)


def _stateless(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`optimizer_state_dict` of an optimizer without state: DCP's FQN mapping, no step, no state.

    For a plain model (:func:`model_state_dict` found its FQNs are its own names) the mapping is DCP's without DCP:
    each parameter's first name in ``named_parameters()``, in the groups of ``optimizer.state_dict()``.
    """
    state = _plain_optimizer_state(module, optimizer) if module in _MODELS else None
    if state is None:
        with no_init_step(optimizer):
            state = get_optimizer_state_dict(module, optimizer, options=StateDictOptions())
    state["state"] = {}  # as optimizer.state_dict() gives it (DCP may have created it for the parameter it marked)
    return state


def _plain_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """DCP's ``get_optimizer_state_dict`` of an optimizer without state over a plain model; ``None``: ask DCP."""
    names: dict[torch.Tensor, str] = {}
    for name, param in module.named_parameters():  # DCP's loop: a shared parameter under its first name
        names.setdefault(param, name)
    fqns = [names.get(p) for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    if any(fqn is None for fqn in fqns) or saved["state"]:
        return None  # a parameter the model does not hold: DCP raises for it
    groups, start = [], 0
    for group in saved["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": fqns[start : start + count]})
        start += count
    return {"state": {}, "param_groups": groups}


_WRAPPERS = ("FullyShardedDataParallel", "OptimizedModule")


def _plain_tree(module: torch.nn.Module) -> bool:
    """Whether DCP's ``_get_fqns`` maps each of ``module``'s state_dict keys to itself.

    So it does without DDP, FSDP1 or ``torch.compile`` wrappers, activation-checkpoint wrappers, or modules that
    declare ``_fqn_modifiers`` anywhere in the tree (DCP's function asks each module on a key's path for these).
    """
    for name, sub in module.named_modules(remove_duplicate=False):  # torch.compile: OptimizedModule (not imported)
        kind = type(sub)
        if issubclass(kind, DistributedDataParallel) or kind.__name__ in _WRAPPERS:
            return False
        if hasattr(kind, "_fqn_modifiers") or "_checkpoint_wrapped_module" in name:
            return False
    return True


def load_model_state_dict(module: torch.nn.Module, state: dict[str, Any], *, strict: bool) -> None:
    """``set_model_state_dict(module, state)`` (``strict``), skipped where it would copy every tensor onto itself.

    A restore fills the module's own tensors in place (its target is :func:`model_state_dict`); DCP's function then
    maps every parameter to its FQN and runs ``module.load_state_dict``, whose copies change nothing (about 0.5 s for
    2,800 tensors). It is skipped when that is all it would do: a plain model (as :func:`model_state_dict` found),
    ``state`` has exactly the module's keys and each value is a plain tensor sharing the module tensor's memory,
    shape, strides and dtype, and no module has load hooks or its own ``load_state_dict``/``_load_from_state_dict``
    (batch and instance norms' only add or drop keys ``state`` holds or lacks alike). Anything else goes to DCP.

    Collective where DCP's is (FSDP); call on all ranks.
    """
    if not _holds_module_tensors(module, state):
        set_model_state_dict(module, state, options=StateDictOptions(strict=strict))


def _holds_module_tensors(module: torch.nn.Module, state: Any) -> bool:
    """Whether loading ``state`` into ``module`` would only copy each of the module's tensors onto itself.

    Each value must be a plain tensor of the dtype and over the very memory (storage, offset, sizes, strides) of the
    module tensor ``module.state_dict()`` gives for its key, in a module that saves and loads its state the stock way
    (:func:`~lightning_dcp._compat.torch_dcp.own_state_tensors`).
    """
    keys = _MODELS.get(module)
    if keys is None or not isinstance(state, dict) or len(state) != len(keys):
        return False
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    current = own_state_tensors(module)
    if current is None or len(current) != len(keys):
        return False
    plain, get = torch.Tensor, state.get
    for (key, mine), expected in zip(current, keys, strict=True):
        value = get(key)
        if key != expected or type(value) is not plain or value.dtype is not mine.dtype or not value.is_set_to(mine):
            return False  # is_set_to: the same storage, offset, sizes and strides
    return True


def _by_fqn(state: dict[str, Any], fqns: list[str]) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with parameter ids replaced by ``fqns[id]``; ``None`` if the ids do not fit."""
    groups = state["param_groups"]
    if sum(len(group["params"]) for group in groups) != len(fqns):
        return None
    try:
        return {
            "state": {fqns[pid]: value for pid, value in state["state"].items()},
            "param_groups": [{**group, "params": [fqns[pid] for pid in group["params"]]} for group in groups],
        }
    except (IndexError, TypeError):
        return None


def _equal_optimizer_states(built: dict[str, Any], reference: dict[str, Any]) -> bool:
    try:
        if list(built["state"]) != list(reference["state"]) or len(built["param_groups"]) != len(
            reference["param_groups"]
        ):
            return False
        pairs = [(built["state"][fqn], values) for fqn, values in reference["state"].items()]
        pairs += list(zip(built["param_groups"], reference["param_groups"], strict=True))
        return all(
            list(mine) == list(theirs) and all(_same(mine[k], v) for k, v in theirs.items()) for mine, theirs in pairs
        )
    except Exception:  # values that do not compare (never expected): no shortcut for this optimizer
        return False


def _param_ids(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(id(p) for group in optimizer.param_groups for p in group["params"])


def _plain(values: Any) -> bool:
    return not any(isinstance(v, (DTensor, ShardedTensor)) for v in values)


def has_fsdp1(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds FSDP1 (``FullyShardedDataParallel``) wrappers."""
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules())


_has_fsdp1 = has_fsdp1


def _same(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and bool(a == b))
    return (
        type(a) is type(b)
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.device == b.device
        and a.requires_grad == b.requires_grad
    )
