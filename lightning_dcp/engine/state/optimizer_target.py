"""The restore target of an optimizer that holds no state yet, built from what the checkpoint records.

DCP's ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` first run ``_init_optim_state`` on an optimizer
without state: a whole optimizer step on zero gradients (learning rate set to 0), so that the state tensors exist to
be filled. On a fresh process resuming a BERT-base model with AdamW on 2 CPU ranks that step took 4.1 of the
restore's 5.0 s. A resume does not need it: the checkpoint says which state tensors each parameter has (the flat
keys ``<optimizer path>.state.<FQN>.<key>``), their dtypes and global shapes (the record index in ``.commit``, or
``.metadata``). So:

- :func:`no_init_step`: around DCP's calls, one parameter gets a zero gradient for the duration, so DCP's
  ``_init_optim_state`` returns at once (it initialises only when no parameter has a gradient); the gradient is
  dropped again afterwards. Nothing steps, nothing else changes.
- :class:`PendingState`: what :func:`~lightning_dcp.engine.state.module_state.optimizer_state_dict` gives as the
  ``state`` of such an optimizer: empty (as ``optimizer.state_dict()`` is: a save writes no state, as stock
  Lightning's does), knowing each FQN's parameter.
- :func:`fill_pending`: once the restore knows the checkpoint's entries, it allocates each saved state tensor in a
  pending target: like the parameter (same device, and for a DTensor parameter a DTensor on the same mesh with the
  same placements) where the saved shape is the parameter's, otherwise a plain CPU tensor (``step``). The load then
  fills them in place, and ``optimizer.load_state_dict`` takes them as it takes stock Lightning's loaded state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["PendingState", "fill_pending", "no_init_step", "pending_states", "saved_entries"]

SavedEntries = Mapping[str, "tuple[torch.dtype, tuple[int, ...]] | None"]
"""Flat DCP key -> ``(dtype, global shape)`` of a saved tensor, ``None`` for a bytes entry."""


class PendingState(dict):
    """The (empty) ``state`` of an optimizer target whose optimizer holds no state yet; see the module docstring.

    Args:
        params: FQN -> the optimizer's parameter, in the optimizer's ``param_groups`` order (the ids of a
            checkpoint keyed by parameter id follow it).

    Copies and pickles are plain dicts of its entries: a save hands it on as ``optimizer.state_dict()``'s ``{}``.
    """

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params = params
        self.filled = False

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))

    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo: dict) -> dict:
        import copy

        return {k: copy.deepcopy(v, memo) for k, v in self.items()}


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


def pending_states(tree: Mapping[str, Any]) -> list[tuple[str, PendingState]]:
    """``(flat key prefix of its state entries, pending state)`` of each unfilled optimizer target in ``tree``.

    Optimizer targets sit at a top-level key (Fabric: ``{"optimizer": {"state": ..., "param_groups": ...}}``) or in
    a top-level list (the Trainer: ``{"optimizer_states": [...]}``).
    """
    found: list[tuple[str, PendingState]] = []
    for key, value in tree.items():
        candidates = [(f"{key}.", value)] if isinstance(value, dict) else []
        if isinstance(value, list):
            candidates = [(f"{key}.{i}.", item) for i, item in enumerate(value)]
        for prefix, osd in candidates:
            state = osd.get("state") if isinstance(osd, dict) else None
            if isinstance(state, PendingState) and not state.filled:
                found.append((prefix + "state.", state))
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


def fill_pending(tree: Mapping[str, Any], entries: SavedEntries) -> None:
    """Allocate, in every pending optimizer target of ``tree``, the state entries the checkpoint holds for it.

    A saved entry whose parameter the optimizer lacks is left out (the load reports it as it did before); state
    keyed by parameter id (a stock strategy's save) is allocated under the FQN of the id's parameter (the load
    re-keys it). Bytes entries get a placeholder the load replaces.
    """
    pendings = pending_states(tree)
    if not pendings:
        return
    for prefix, pending in pendings:
        order = list(pending.params)
        for key, entry in entries.items():
            if not key.startswith(prefix):
                continue
            found = _split(key[len(prefix) :], pending.params, order)
            if found is None:
                continue
            fqn, path = found
            leaf = pending.setdefault(fqn, {})
            for part in path[:-1]:
                leaf = leaf.setdefault(part, {})
            leaf[path[-1]] = b"" if entry is None else _allocate(pending.params[fqn], path[-1], *entry)
        pending.filled = True


def _split(rest: str, params: Mapping[str, Any], order: list[str]) -> tuple[str, list[str]] | None:
    """``(FQN, state key path)`` of ``rest`` (``"<FQN>.<key>"``): the longest FQN the optimizer has, else an id."""
    end = rest.rfind(".")
    while end > 0:
        head = rest[:end]
        if head in params:
            return head, rest[end + 1 :].split(".")
        end = rest.rfind(".", 0, end)
    head, _, tail = rest.partition(".")
    if tail and head.isdigit() and int(head) < len(order):
        return order[int(head)], tail.split(".")
    return None


def _allocate(param: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised state tensor for ``param``: like it where the saved shape is its shape, else a CPU tensor."""
    if name != "step" and shape == tuple(param.shape):
        if isinstance(param, DTensor):
            return torch.empty_like(param, dtype=dtype)  # a DTensor: the parameter's mesh and placements
        return torch.empty(shape, dtype=dtype, device=param.device)
    return torch.empty(shape, dtype=dtype)
