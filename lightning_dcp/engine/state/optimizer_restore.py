"""Giving an optimizer its saved state with torch.optim's semantics: its own ``load_state_dict``, or the same result.

A saved optimizer state is ``optimizer.state_dict()`` with each parameter id replaced by its FQN (or the ids
themselves, from a stock strategy's save). ``Optimizer.load_state_dict`` takes it as it is: it maps the saved
groups' parameters onto its own groups' by position (the FQNs serve as ids), gives each parameter the state saved
for it (none where none was saved: a parameter that never stepped), casts each state tensor to its parameter's
dtype and device, and takes every option of every saved group. That is what stock Lightning's restore does with the
``optimizer.state_dict()`` it saved, so :func:`load_optimizer_state_dict` hands it exactly that, after mapping full
tensors of DTensor parameters (a single-file checkpoint) onto this rank's shards. What it honours, as
``load_state_dict`` does: an optimizer's own ``load_state_dict`` (a subclass's, or one set on the instance), its
load hooks, optimizer-specific layouts (LBFGS, SparseAdam, Adafactor, any optimizer following torch.optim's
contract), parameters frozen since the save (their state is kept), param groups added after construction (restored
after the callbacks that add them, as Lightning orders it).

Two shortcuts give exactly ``load_state_dict``'s result without its per-tensor work, and only where nothing can
differ: a stock ``load_state_dict`` without hooks, no ``fused``/``capturable`` group, and state values that are
the optimizer's own tensors (a restore in place) or tensors that its casts would return unchanged.

Under FSDP1 (flat parameters; GPU only) DCP's ``set_optimizer_state_dict`` is kept, as its targets are
(:func:`~lightning_dcp.engine.state.module_state.optimizer_target`).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dcp._compat.torch_dcp import ShardedTensor, optimizer_load_hooked
from lightning_dcp.engine.state.module_state import has_fsdp1
from lightning_dcp.errors import CheckpointError, NotACheckpointError, StateDictMismatchError

__all__ = ["check_groups", "check_kind", "load_optimizer_state_dict", "optimizer_kind"]


def load_optimizer_state_dict(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Any],
    *,
    where: str = "the checkpoint",
    kind: list[str] | None = None,
) -> None:
    """Give ``optimizer`` the saved ``state``, as ``optimizer.load_state_dict`` of the saved ``state_dict()`` would.

    Args:
        module: The module whose parameters the optimizer holds (FQNs name them in ``state``).
        optimizer: The optimizer to restore; its param groups must match the saved ones in number and sizes.
        state: ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}`` with parameter FQNs
            (or ids) as names: this rank's shards loaded in place, or full tensors from a single file (then a
            DTensor parameter's state tensors of its global shape are cut to this rank's shards).
        where: The checkpoint, for messages.
        kind: The saved optimizer's :func:`optimizer_kind`, where the save recorded it (:func:`check_kind`).

    Not collective (each rank applies what it read).

    Raises:
        NotACheckpointError: ``state`` has no valid ``param_groups``.
        StateDictMismatchError: The optimizer has another number of param groups, or groups of other sizes, than the
            saved one, or is another kind of optimizer (:func:`check_kind`); the message names both and the fix.
        CheckpointError: A sharded parameter's state was saved as a per-rank plain tensor (the save warned).
    """
    if has_fsdp1(module):  # FSDP's optimizer state API maps its flat parameters (DCP's own restore, as before)
        full = not any(isinstance(v, (DTensor, ShardedTensor)) for v in _leaves(state.get("state", {})))
        set_optimizer_state_dict(module, optimizer, dict(state), options=StateDictOptions(full_state_dict=full))
        return
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups
    ):
        raise NotACheckpointError(
            f"{where}: its optimizer state has no valid 'param_groups'; resume from another checkpoint."
        )
    check_kind(optimizer, kind, where)
    _check_groups(optimizer, groups, where)
    saved = state.get("state") or {}
    names = [name for group in groups for name in group["params"]]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    saved = _onto_shards(saved, names, params, where)
    split = {"state": saved, "param_groups": [{**g, "params": _Members(g["params"])} for g in groups]}
    if _stock_load(optimizer):
        if _holds_optimizer_tensors(optimizer, split):
            _set_param_groups(optimizer, split["param_groups"])
            return
        uncast = _uncast_state(optimizer, split)
        if uncast is not None:
            _set_param_groups(optimizer, split["param_groups"], state=uncast)
            return
    optimizer.load_state_dict(split)


def optimizer_kind(optimizer: torch.optim.Optimizer) -> list[str]:
    """The qualified names of ``optimizer``'s class and its bases (what a save records of each optimizer)."""
    return [f"{c.__module__}.{c.__qualname__}" for c in type(optimizer).__mro__ if c is not object]


def check_kind(
    optimizer: torch.optim.Optimizer,
    saved_kind: list[str] | None,
    where: str,
    *,
    what: str = "Its optimizer state",
) -> None:
    """Refuse a saved state of another kind of optimizer (``saved_kind``: :func:`optimizer_kind` at the save).

    ``load_state_dict`` takes any state: AdamW's loaded into SGD replaces SGD's options by AdamW's. The kinds fit
    when either class derives from the other (a subclass of the saved optimizer, AdamW for Adam). A checkpoint that
    recorded no kind (older saves, stock files) is not checked. ``where``: the checkpoint; ``what``: the saved
    state, in messages.

    Raises:
        StateDictMismatchError: The classes are unrelated; the message names both.
    """
    if not saved_kind:
        return
    mine = optimizer_kind(optimizer)
    if saved_kind[0] in mine or mine[0] in saved_kind:
        return
    raise StateDictMismatchError(
        where,
        reason=f"{what} was saved from a {saved_kind[0]}, which is not a {type(optimizer).__name__} (nor the other"
        " way round): another kind of optimizer. Resume with the optimizer the checkpoint was saved with, or leave"
        " the optimizer state out (load the weights only).",
    )


def check_groups(
    optimizer: torch.optim.Optimizer, groups: list[Mapping[str, Any]], where: str, *, what: str = "Its optimizer state"
) -> None:
    """Refuse a saved state with another number of param groups (``groups``: saved, or a target before the read)."""
    if len(groups) != len(optimizer.param_groups):
        saved = [len(g["params"]) if isinstance(g.get("params"), list) else "?" for g in groups]
        _refuse(optimizer, saved, where, what)


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    return [value]


def _check_groups(optimizer: torch.optim.Optimizer, groups: list[Mapping[str, Any]], where: str) -> None:
    """Raise what ``load_state_dict`` would (a bare ``ValueError``) as an error that names the sizes and the fix."""
    saved = [len(group["params"]) for group in groups]
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if saved != mine:
        _refuse(optimizer, saved, where, "Its optimizer state")


def _refuse(optimizer: torch.optim.Optimizer, saved: list[Any], where: str, what: str) -> None:
    mine = [len(group["params"]) for group in optimizer.param_groups]
    raise StateDictMismatchError(
        where,
        reason=f"{what} ({type(optimizer).__name__}) has {len(saved)} param group(s) of"
        f" {saved} parameters, but the optimizer has {len(mine)} of {mine}. torch.optim restores a state into the same"
        " groups in the same order: build the optimizer as at the save (`configure_optimizers`); groups that a"
        " callback adds during training (BackboneFinetuning, `add_param_group`) are re-added when that callback's"
        " own state is restored, so keep the callback in the resumed Trainer.",
    )


def _onto_shards(
    saved: Mapping[Any, Any], names: list[Any], params: list[torch.Tensor], where: str
) -> Mapping[Any, Any]:
    """``saved`` with each full state tensor of a DTensor parameter's global shape cut to this rank's shard.

    A restore in place already holds DTensors; a single-file checkpoint holds full tensors (each rank read them
    all), which ``distribute_tensor`` narrows locally (``src_data_rank=None``: no communication). A plain tensor of
    one rank's shard's shape (a per-rank state, which no checkpoint keeps for every rank) is refused.

    Raises:
        CheckpointError: Such a per-rank state; the message names it and the fix.
    """
    sharded = {name: param for name, param in zip(names, params, strict=True) if isinstance(param, DTensor)}
    if not sharded:
        return saved
    out = dict(saved)
    for name, param in sharded.items():
        values = saved.get(name)
        if not isinstance(values, Mapping):
            continue
        placed = dict(values)
        local = tuple(param.to_local().shape)
        for key, value in values.items():
            if type(value) is not torch.Tensor or value.dim() == 0:
                continue
            if value.shape == param.shape:
                whole = value.to(param.device_mesh.device_type)
                placed[key] = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
            elif tuple(value.shape) == local:
                raise CheckpointError(
                    f"{where}: the optimizer state {key!r} of the sharded parameter {name!r} was saved as a plain"
                    f" tensor of one rank's shard ({local} of {tuple(param.shape)}; the save warned of it): each rank"
                    " held its own and the checkpoint keeps one copy, so it cannot be restored. Resume without this"
                    " optimizer's state (load the weights only), and make the optimizer create its state as DTensors"
                    " (`torch.zeros_like(param)`) or save with `state_dict_type='full'`.",
                )
        out[name] = placed
    return out


def _stock_load(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.load_state_dict`` is torch.optim's own, without hooks (none set on the instance either)."""
    return (
        type(optimizer).load_state_dict is torch.optim.Optimizer.load_state_dict
        and "load_state_dict" not in vars(optimizer)
        and not optimizer_load_hooked(optimizer)
    )


def _holds_optimizer_tensors(optimizer: torch.optim.Optimizer, split: dict[str, Any]) -> bool:
    """Whether ``optimizer.load_state_dict(split)`` would give every parameter the very state values it holds.

    So it is after a restore in place (the target took the optimizer's own tensors where they fit): ``load_state_dict``
    would re-key and re-cast 3,600 tensors onto themselves (~7 ms for 1,200 parameters with AdamW) and only its
    parameter groups' options would change. Only for a stock ``load_state_dict`` (:func:`_stock_load`).
    """
    saved, own = split["state"], optimizer.state
    if len(saved) != len(own) or _casts_step(optimizer, split):
        return False
    for param, values in _saved_per_param(optimizer, split):
        if values is None:
            if param in own:
                return False  # the optimizer holds state the checkpoint does not: load_state_dict drops it
            continue
        mine = own.get(param)
        if type(values) is not dict or type(mine) is not dict or values.keys() != mine.keys():
            return False
        for key, value in values.items():
            if value is not mine[key]:
                return False
    return True


def _uncast_state(optimizer: torch.optim.Optimizer, split: dict[str, Any]) -> dict[Any, Any] | None:
    """The state ``optimizer.load_state_dict(split)`` would build when its casts change nothing; else ``None``.

    So it is for a fresh optimizer's state that the restore allocated like its parameters
    (:func:`~lightning_dcp.engine.state.optimizer_target.fill_pending`) and filled: ``load_state_dict`` casts
    each state tensor to its parameter's dtype and device (``to`` returns the tensor itself when both match) and
    hands ``step`` on as it is, then keeps each parameter's values in a new dict (skipping that took the ``conv``
    resume's ``apply`` from 0.045-0.050 s to 0.037 s, 4,800 state tensors). Only for a stock ``load_state_dict``
    (:func:`_stock_load`), no ``fused`` or ``capturable`` group (whose ``step`` is cast) and state values that are
    all tensors of the parameter's device (and dtype, for a floating-point parameter) with nothing saved for a name
    no group lists.
    """
    saved = split["state"]
    if _casts_step(optimizer, split):
        return None
    state: dict[Any, Any] = collections.defaultdict(dict)
    tensor = torch.Tensor
    for param, values in _saved_per_param(optimizer, split):
        if values is None:
            continue
        if type(values) is not dict:
            return None
        floating = param.is_floating_point()
        for key, value in values.items():
            if not isinstance(value, tensor) or value.device != param.device:
                return None
            if floating and key != "step" and value.dtype != param.dtype:
                return None
        state[param] = dict(values)
    return state if len(state) == len(saved) else None


def _casts_step(optimizer: torch.optim.Optimizer, split: dict[str, Any]) -> bool:
    """Whether a group, the optimizer's or the saved one, is ``fused`` or ``capturable`` (``step`` is cast then)."""
    return any(
        group.get("fused") or group.get("capturable") or loaded.get("fused") or loaded.get("capturable")
        for group, loaded in zip(optimizer.param_groups, split["param_groups"], strict=True)
    )


def _saved_per_param(optimizer: torch.optim.Optimizer, split: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """``(parameter, its saved state or None)`` for every parameter of the optimizer's groups, in order."""
    saved = split["state"]
    for group, loaded in zip(optimizer.param_groups, split["param_groups"], strict=True):
        for name, param in zip(loaded["params"], group["params"], strict=True):
            yield param, saved.get(name)


def _set_param_groups(
    optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]], *, state: dict[Any, Any] | None = None
) -> None:
    """What ``Optimizer.load_state_dict`` ends with when its casts change nothing.

    The saved groups' options (deep-copied) with the optimizer's parameters, handed to ``__setstate__`` with
    ``state`` (default: the optimizer's own, unchanged), as torch 2.6-2.13's ``load_state_dict`` does after its casts.
    """
    updated = []
    for group, loaded in zip(optimizer.param_groups, groups, strict=True):
        new = copy.deepcopy({k: v for k, v in loaded.items() if k != "params"})
        new["params"] = group["params"]
        if "param_names" in group and "param_names" not in new:
            new["param_names"] = group["param_names"]
        updated.append(new)
    optimizer.__setstate__({"state": optimizer.state if state is None else state, "param_groups": updated})


class _Members(list):
    """A list of parameter names whose ``in`` is a set lookup.

    ``Optimizer.load_state_dict`` asks, for every state tensor, which saved group holds its parameter with
    ``name in group["params"]``: a scan of the list, so thousands of parameters cost seconds. The saved groups only
    live through that call (each group's ``params`` is replaced by the optimizer's own list).
    """

    def __contains__(self, value: object) -> bool:
        members = self.__dict__.get("members")
        if members is None:
            members = self.__dict__["members"] = frozenset(self)
        try:
            return value in members
        except TypeError:  # unhashable: the list's own scan
            return list.__contains__(self, value)
