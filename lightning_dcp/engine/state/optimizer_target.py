"""The restore target of an optimizer's state: built from what the checkpoint holds, not from the live optimizer.

A checkpoint keeps each optimizer's ``optimizer.state_dict()`` with parameter ids replaced by FQNs: the flat keys
``<optimizer path>.state.<FQN>.<key>`` for the parameters that have state (torch.optim keeps none for a parameter
that never stepped) and ``<optimizer path>.param_groups.<n>.<option>`` for every param group with all its options,
in the optimizer's own layout (LBFGS keeps its whole state under its first parameter, partly in lists). A restore
must give the optimizer exactly that, as stock Lightning's ``optimizer.load_state_dict`` of its saved file does,
whatever the optimizer holds when the checkpoint is read: no state yet (a fresh process), fewer param groups (a
callback such as ``BackboneFinetuning`` re-adds its groups between the read and the restore), parameters frozen
since. So the target of the read is made from the checkpoint's own entries, once the restore knows them:

- :class:`OptimizerTarget` (:meth:`OptimizerTarget.of`): empty, knowing the module's parameters by FQN (so that a
  state tensor of a parameter's shape is allocated like the parameter: a DTensor of the same mesh and placements
  reshards through DCP) and the optimizer's present state tensors (filled in place where a saved entry has their
  dtype and shape: a second ``fit`` in one process allocates nothing);
- :func:`fill_pending`: allocates in every unfilled target of a tree each saved entry under its path, tensors
  uninitialised and placeholders for the non-tensor values (param-group options among them), which the read fills.

``optimizer.load_state_dict`` then gives the optimizer that state, mapping the saved groups onto its own by position
as torch.optim does (:mod:`~lightning_dcp.engine.state.optimizer_restore`). The record index in ``.commit`` names
entries without their paths, so lists of tensors in a state (LBFGS's history) are read as dicts keyed ``"0"``,
``"1"``, ...; the save notes where lists were (:func:`~lightning_dcp.engine.format.layout.list_paths`) and the load
turns them back.

:func:`no_init_step`: around DCP's ``get_optimizer_state_dict`` of an optimizer without state, which would otherwise
run a whole optimizer step on zero gradients to create it (``_init_optim_state``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_dcp._compat.torch_dcp import set_element

__all__ = ["OptimizerTarget", "drop_unsaved", "fill_pending", "no_init_step", "pending_targets", "saved_entries"]

SavedEntries = Mapping[str, "tuple[torch.dtype, tuple[int, ...]] | None"]
"""Flat DCP key -> ``(dtype, global shape)`` of a saved tensor, ``None`` for a bytes entry."""


class OptimizerTarget(dict):
    """The restore target of one optimizer: empty until :func:`fill_pending` gives it the checkpoint's entries.

    Args:
        params: FQN -> parameter of the module that names the optimizer's state (DCP's FQNs).
        current: FQN -> the optimizer's present state of that parameter (its tensors are reused where they fit).
        order: The optimizer's parameters in ``param_groups`` order (for state keyed by parameter id: a stock
            strategy's save).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], current: Mapping[str, Any], order: list[torch.Tensor]):
        super().__init__()
        self.params = params
        self.current = current
        self.order = order
        self.filled = False

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> OptimizerTarget:
        """The empty target of ``optimizer``, whose parameters ``params`` (FQN -> parameter) names."""
        names: dict[torch.Tensor, str] = {}
        for fqn, param in params.items():
            names.setdefault(param, fqn)
        current = {names[p]: v for p, v in optimizer.state.items() if p in names and isinstance(v, dict)}
        return cls(params, current, [p for group in optimizer.param_groups for p in group["params"]])


@contextlib.contextmanager
def no_init_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Keep DCP's ``_init_optim_state`` from stepping ``optimizer`` inside this block.

    Where the optimizer holds no state and no parameter has a gradient, the smallest parameter that requires grad
    gets a zero gradient (``zeros_like``: a DTensor for a DTensor parameter) for the duration; it is ``None`` again
    afterwards. Otherwise nothing is done (DCP does not step an optimizer with state or with gradients).
    """
    if optimizer.state:
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        yield
        return
    candidates = [p for p in params if p.requires_grad]
    marked = min(candidates, key=lambda p: p.numel()) if candidates else None
    if marked is not None:
        marked.grad = torch.zeros_like(marked)
    try:
        yield
    finally:
        if marked is not None:
            marked.grad = None


def pending_targets(tree: Mapping[str, Any]) -> list[tuple[tuple, OptimizerTarget]]:
    """``(path in the tree, target)`` of each unfilled optimizer target of ``tree``.

    Optimizer targets sit at a top-level key (Fabric: ``{"optimizer": target}``) or in a top-level list (the Trainer:
    ``{"optimizer_states": [target, ...]}``).
    """
    found: list[tuple[tuple, OptimizerTarget]] = []
    for key, value in tree.items():
        candidates = [((key,), value)] if isinstance(value, dict) else []
        if isinstance(value, list):
            candidates = [((key, i), item) for i, item in enumerate(value)]
        for path, target in candidates:
            if isinstance(target, OptimizerTarget) and not target.filled:
                found.append((path, target))
    return found


def saved_entries(*, records: Mapping[str, Any] | None = None, metadata: Any = None) -> dict[str, Any]:
    """:data:`SavedEntries` from a record index (``parse_index``) or from DCP ``.metadata``."""
    out: dict[str, Any] = {}
    if records is not None:
        for key, record in records.items():
            if type(record) is tuple:  # a tensor saved in chunks: its global shape spans them all
                dims = len(record[0].shape)
                shape = tuple(max(c.chunk[d] + c.shape[d] for c in record) for d in range(dims))
                out[key] = (record[0].dtype, shape)
            else:
                out[key] = None if record.dtype is None else (record.dtype, tuple(record.shape))
        return out
    for key, meta in metadata.state_dict_metadata.items():
        size = getattr(meta, "size", None)
        out[key] = None if size is None else (meta.properties.dtype, tuple(size))
    return out


def fill_pending(tree: Mapping[str, Any], entries: SavedEntries, *, paths: Mapping[str, tuple] | None = None) -> None:
    """Allocate, in every unfilled optimizer target of ``tree``, each entry the checkpoint holds for it.

    Args:
        tree: The restore's tree (see :func:`pending_targets`).
        entries: The checkpoint's entries (:func:`saved_entries`).
        paths: Each flat key's path in the saved tree (DCP ``.metadata``'s ``planner_data``), where known. Without
            it a flat key is split by the module's FQNs (the longest one that prefixes it; else a parameter id; else
            its last component is the state key), and lists come back as dicts keyed by index.

    A state tensor of a parameter's (global) shape is allocated like the parameter (device; a DTensor on the same
    mesh and placements), any other (``step``, a factored second moment, LBFGS's flat history) as a CPU tensor; the
    optimizer's present tensor is taken instead where it has the saved dtype and shape. Bytes entries get a
    placeholder the read replaces.
    """
    for base, target in pending_targets(tree):
        prefix = ".".join(str(part) for part in base) + "."
        state_prefix, params, scalars = prefix + "state.", target.params, {}
        skip = len(state_prefix)
        found = False
        for key, entry in entries.items():
            if not key.startswith(prefix):
                continue
            path = _saved_path(paths, key, base)
            if path is None and key.startswith(state_prefix):  # most entries: "<FQN>.<state key>" of a parameter
                name, dot, option = key[skip:].rpartition(".")
                if dot and name in params:  # the longest FQN that prefixes it, as _split_state finds it
                    path = ("state", name, option)
            if path is None:
                path = _parse(key[len(prefix) :], target)
            if path is None:
                continue
            value = b"" if entry is None else _tensor(target, path, *entry, scalars=scalars)
            if len(path) == 3 and path[0] == "state":  # a parameter's state value: most entries, set directly
                states = target.get("state")
                if states is None:
                    states = target["state"] = {}
                leaf = states.get(path[1])
                if leaf is None:
                    leaf = states[path[1]] = {}
                leaf[path[2]] = value
            else:
                set_element(target, path, value)
            found = True
        if found:
            target.setdefault("state", {})  # DCP stores no entry for an empty ``state`` (a save before any step)
        target.filled = True


def drop_unsaved(tree: dict[str, Any]) -> None:
    """Remove from ``tree`` the optimizer targets for which the checkpoint held nothing (a weights-only save).

    A top-level target (Fabric), or a top-level list of them (the Trainer) when every one is empty: the loaded
    checkpoint then has no optimizer state at all, as stock Lightning's weights-only file has none (Lightning's
    restore says so itself).
    """
    for key in list(tree):
        value = tree[key]
        targets = value if isinstance(value, list) else [value]
        if targets and all(isinstance(t, OptimizerTarget) and t.filled and not t for t in targets):
            del tree[key]


def _saved_path(paths: Mapping[str, tuple] | None, key: str, base: tuple) -> tuple | None:
    """The saved path of ``key`` below the target's own path ``base``, when ``paths`` knows it."""
    if paths is None or key not in paths:
        return None
    path = tuple(paths[key])
    if len(path) <= len(base) or any(str(a) != str(b) for a, b in zip(path, base, strict=False)):
        return None
    return path[len(base) :]


def _parse(rest: str, target: OptimizerTarget) -> tuple | None:
    """The path of ``rest`` (a flat key below the target) in an optimizer state dict, without saved paths."""
    if rest.startswith("state."):
        return ("state", *_split_state(rest[len("state.") :], target))
    if rest.startswith("param_groups."):
        index, _, option = rest[len("param_groups.") :].partition(".")
        return ("param_groups", int(index), *option.split(".")) if index.isdigit() and option else None
    return tuple(rest.split("."))


def _split_state(rest: str, target: OptimizerTarget) -> list[str]:
    """``[name, *state key path]`` of ``rest`` (``"<FQN or id>.<key>..."``).

    The name is the longest FQN of the module that prefixes it, else a parameter id, else everything up to the
    last component.
    """
    params = target.params
    end = rest.rfind(".")
    while end > 0:
        if rest[:end] in params:
            return [rest[:end], *rest[end + 1 :].split(".")]
        end = rest.rfind(".", 0, end)
    head, _, tail = rest.partition(".")
    if tail and head.isdigit():
        return [head, *tail.split(".")]
    name, _, key = rest.rpartition(".")
    return [name, key] if name else [rest]


def _tensor(
    target: OptimizerTarget,
    path: tuple,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    *,
    scalars: dict[torch.dtype, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The tensor a saved entry at ``path`` is read into (see :func:`fill_pending`).

    ``scalars`` (dtype -> a CPU scalar) lets many 0-dim tensors (each parameter's ``step``) be made with
    ``empty_like``, which skips the argument parsing of ``torch.empty`` (about half of its ~4 us per call on CPU).
    """
    if path[0] != "state" or len(path) < 3:
        return torch.empty(shape, dtype=dtype)  # a tensor option of a param group (a tensor lr)
    name = str(path[1])
    param = target.params.get(name)
    if param is None and name.isdigit() and int(name) < len(target.order):
        param = target.order[int(name)]  # state keyed by parameter id
    elif len(path) == 3:
        mine = target.current.get(name)
        mine = mine.get(path[2]) if mine else None
        if isinstance(mine, torch.Tensor) and mine.dtype == dtype and mine.shape == shape:
            return mine  # the optimizer's own tensor: filled in place
    if param is not None and path[-1] != "step" and param.shape == shape:
        if isinstance(param, DTensor):
            return torch.empty_like(param, dtype=dtype)  # a DTensor: the parameter's mesh and placements
        # on the parameter's device, contiguous (a read target), never requiring grad, as torch.empty would be
        return torch.empty_like(param, dtype=dtype, memory_format=torch.contiguous_format)
    if scalars is not None and not shape:
        scalar = scalars.get(dtype)
        if scalar is None:
            scalar = scalars[dtype] = torch.empty((), dtype=dtype)
        return torch.empty_like(scalar)
    return torch.empty(shape, dtype=dtype)
