"""The state-tree keys: a nested state dict flattened into DCP's flat keys (FQNs) and the paths back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def flatten(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``torch.distributed.checkpoint``'s ``flatten_state_dict``: the same flat keys and paths, in the same order.

    Mappings are walked with their keys as strings; a list is walked (by integer index) when it holds a tensor, or a
    mapping or list that is walked itself; anything else is a leaf. Tens of thousands of leaves are flattened at
    every save, and DCP's closure-based traversal costs several times this loop.

    Raises:
        ValueError: Two paths give the same flat key (as DCP raises).
    """
    flat: dict[str, Any] = {}
    mappings: dict[str, tuple] = {}
    tensor, parameter = torch.Tensor, torch.nn.Parameter

    def visit(path: tuple, key: str, value: Any) -> None:
        kind = type(value)
        if kind is not tensor and kind is not parameter:
            if kind is dict or (kind is not list and isinstance(value, Mapping)):
                for k, v in value.items():
                    k = str(k)
                    child = type(v)
                    if child is tensor or child is parameter:  # the common leaf, without a call
                        name = f"{key}.{k}"
                        if name in flat:
                            raise ValueError(f"duplicated flatten key {name}")
                        flat[name] = v
                        mappings[name] = (*path, k)
                    else:
                        visit((*path, k), f"{key}.{k}", v)
                return
            if isinstance(value, list) and not terminal_list(value):
                for i, v in enumerate(value):
                    visit((*path, i), f"{key}.{i}", v)
                return
        if key in flat:
            raise ValueError(f"duplicated flatten key {key}")
        flat[key] = value
        mappings[key] = path

    for k, v in state_dict.items():
        k = str(k)
        visit((k,), k, v)
    return flat, mappings


def terminal_list(values: list) -> bool:
    """DCP's test of whether a list is a leaf: it holds no tensor and nothing that is walked."""
    for entry in values:
        if isinstance(entry, torch.Tensor):
            return False
        if isinstance(entry, Mapping) or (isinstance(entry, list) and not terminal_list(entry)):
            return False
    return True
