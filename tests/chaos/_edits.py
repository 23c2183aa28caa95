"""Object-level edits of DCP metadata and near-miss tensors: hostile inputs built from a real checkpoint's own."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

from tests.chaos import _inputs as inputs


def near_tensor(meta: Any) -> st.SearchStrategy[torch.Tensor]:
    """A tensor of the entry's dtype whose shape is the entry's, or one element off in some dimensions."""
    if not hasattr(meta, "size"):
        return st.just(torch.zeros(1))
    shape = list(meta.size)
    deltas = st.lists(st.sampled_from([-1, 0, 0, 1]), min_size=len(shape), max_size=len(shape))
    extra = st.lists(st.integers(1, 3), max_size=1)
    return st.tuples(deltas, extra).map(
        lambda t: torch.full([max(0, d + e) for d, e in zip(shape, t[0], strict=True)] + t[1], 2.5).to(
            meta.properties.dtype
        )
    )


def mutate_object(draw: st.DrawFn, root: Any, original: Metadata) -> None:
    """Replace one slot anywhere in DCP metadata (a field, a dict item or key, a list item) with a hostile value."""
    slots = list(_object_slots(root))
    if not slots:
        return
    kind, owner, key = draw(st.sampled_from(slots))
    peers = [v for v in _object_values(original) if type(v).__module__.startswith("torch")]
    current = _get(kind, owner, key)
    value = draw(
        st.one_of(
            inputs.json_values(),
            st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.complex128, torch.Size([]), None]),
            st.sampled_from(peers) if peers else st.none(),
            st.lists(st.integers(-2, 2**40), max_size=3).map(torch.Size),
            st.sampled_from([-1, 0, 1, 2**31, 2**62, 2**63, 10**9])
            if isinstance(current, int)
            else st.sampled_from(["", "../x", "__0_0.distcp", ".commit", "state_dict.0.weight", "lightning"]),
        )
    )
    value = copy.deepcopy(value)  # a peer taken from the original must not be edited in place later
    if kind == "dictkey":
        owner[value if _hashable(value) else str(value)] = owner.pop(key)
    elif kind == "delete":
        owner.pop(key)
    else:
        _set(kind, owner, key, value)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _object_slots(obj: Any, depth: int = 0) -> Iterator[tuple[str, Any, Any]]:
    if depth > 6:
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield "attr", obj, field.name
            yield from _object_slots(getattr(obj, field.name), depth + 1)
    elif isinstance(obj, dict):
        for key, value in list(obj.items())[:64]:
            yield "item", obj, key
            yield "dictkey", obj, key
            yield "delete", obj, key
            if dataclasses.is_dataclass(key):  # MetadataIndex: its fields too (the dict is pickled right after)
                yield from _object_slots(key, depth + 1)
            yield from _object_slots(value, depth + 1)
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:16]):
            yield "item", obj, i
            yield from _object_slots(value, depth + 1)


def _object_values(obj: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 6:
        return
    yield obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _object_values(getattr(obj, field.name), depth + 1)
    elif isinstance(obj, dict):
        for value in list(obj.values())[:64]:
            yield from _object_values(value, depth + 1)


def _get(kind: str, owner: Any, key: Any) -> Any:
    return getattr(owner, key) if kind == "attr" else owner[key]


def _set(kind: str, owner: Any, key: Any, value: Any) -> None:
    if kind == "attr":
        object.__setattr__(owner, key, value)  # frozen dataclasses too (MetadataIndex)
    else:
        owner[key] = value


# ------------------------------------------------------------------------------------------------ the runner
