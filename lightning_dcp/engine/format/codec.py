"""The safe codec of the non-tensor state: what Lightning users keep in checkpoints, in terms ``weights_only`` reads.

``torch.load(weights_only=True)`` refuses every class outside a short list, so a Hydra config (OmegaConf
``DictConfig``), a ``functools.partial`` optimizer or a ``pathlib.Path`` in the hyperparameters would make a
checkpoint unloadable. :func:`encode` turns each such value into a *tag*, a one-entry dict
``{TAG: (kind, name, payload)}`` of plain values (``name``: the dotted name of a class or function, ``payload``:
plain values and tensors), which any ``torch.load(weights_only=True)`` reads; :func:`decode` turns tags back into
the objects. Kinds:

- ``omegaconf``: ``DictConfig`` / ``ListConfig``, as the node tree of its root (interpolations and ``???``
  unresolved, the flags set on each node) and the path to the node;
- ``partial``: ``functools.partial`` of an allowed callable (torch optimizers and lr schedulers, or registered);
- ``namespace`` (``argparse.Namespace``), ``path`` (``pathlib``), ``datetime`` / ``date`` / ``time`` /
  ``timedelta`` / ``timezone``, ``frozenset``;
- ``dataclass``, ``namedtuple``, ``enum``, ``type``: instances, members and classes of allowed classes;
- numpy arrays and scalars (their own tag, :data:`NUMPY_TAG`, as written since the first format).

Decoding never imports, calls or constructs anything outside the allow-list: names are looked up in it (never
imported; omegaconf is imported only for an ``omegaconf`` tag), classes are built with their own constructors from
checked plain values, dataclasses are filled field by field as pickle fills them (no ``__init__``), and a partial's
callable is never called. Everything else passes through unchanged when ``torch.load(weights_only=True)`` reads it
back (tensors, plain values, classes registered with ``torch.serialization.add_safe_globals``), and is refused
otherwise (:class:`UnstorableValue`, naming the key path).

The allow-list: the built-ins above, plus what :func:`~lightning_dcp.engine.format.allowlist.add_safe_globals`
registered, plus what ``torch.serialization.add_safe_globals`` registered.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import functools
import io
import sys
from collections import OrderedDict
from typing import Any

import torch

from lightning_dcp._compat import omegaconf_hydra
from lightning_dcp.engine.format import allowlist
from lightning_dcp.engine.format.codec_tags import (
    _PATHS,
    _PLAIN,
    NUMPY_TAG,
    TAG,
    DisallowedName,
    MalformedTag,
    UnstorableValue,
    _fields_of,
)
from lightning_dcp.engine.format.decoding import decode

try:  # numpy is optional for lightning_dcp
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with Lightning's dependencies
    np = None

__all__ = [
    "NUMPY_TAG",
    "TAG",
    "DisallowedName",
    "MalformedTag",
    "UnstorableValue",
    "decode",
    "encode",
    "weights_only_loads",
]


def encode(value: Any) -> Any:
    """``value`` with every object the codec knows replaced by its tag; other values pass through unchanged.

    Raises:
        UnstorableValue: A value that neither a tag nor ``torch.load(weights_only=True)`` can bring back; its
            ``path`` is the key path within ``value`` (``['hyper_parameters']['net']``).
    """
    kind = type(value)
    if kind in _PLAIN or kind is torch.Tensor or kind is torch.nn.Parameter:
        return value
    if kind is dict or kind is OrderedDict:
        out = kind()
        for key, item in value.items():
            out[key] = _within(key, item)
        return out
    if kind is list or kind is tuple:
        items = [_within(i, item) for i, item in enumerate(value)] if value else []
        return items if kind is list else tuple(items)
    tagged = _encode_object(value)
    if tagged is not None:
        return tagged
    if weights_only_loads(value):  # other tensor types, sets, torch.Size / dtype / device, torch-registered classes
        return value
    raise UnstorableValue("", allowlist.name_of(kind) or repr(kind), _hint(value))


def _within(step: Any, value: Any, *, attribute: bool = False) -> Any:
    """:func:`encode` of the item at key or index ``step`` (or of the ``attribute`` named ``step``).

    A refusal's key path gets the step in front; it is only formatted then.
    """
    kind = type(value)
    if kind in _PLAIN or kind is torch.Tensor:
        return value
    try:
        return encode(value)
    except UnstorableValue as err:
        err.path = (f".{step}" if attribute else f"[{step!r}]") + err.path
        raise


# ---------------------------------------------------------------------------------------------- encoding
def _encode_object(value: Any) -> dict[str, Any] | None:
    """The tag of ``value``, or ``None`` when the codec has no kind for it."""
    kind = type(value)
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return _numpy_tag(value)
    if isinstance(value, enum.Enum):
        return _tag("enum", _allowed(kind, "enum class", isinstance(kind, type)), value.name)
    if isinstance(value, type):
        return _tag("type", _allowed(value, "class", True), None)
    if kind is functools.partial or (kind is omegaconf_hydra.hydra_partial_class() and kind is not None):
        return _partial_tag(value)
    if kind is argparse.Namespace:
        return _tag("namespace", None, encode(dict(vars(value))))
    if _PATHS.get(kind.__name__) is kind:
        return _tag("path", kind.__name__, str(value))
    if kind in (datetime.datetime, datetime.time):
        fields = [getattr(value, f) for f in _fields_of(kind)]
        return _tag(kind.__name__, None, (*fields, value.fold, _within("tzinfo", value.tzinfo, attribute=True)))
    if kind is datetime.date:
        return _tag("date", None, (value.year, value.month, value.day))
    if kind is datetime.timedelta:
        return _tag("timedelta", None, (value.days, value.seconds, value.microseconds))
    if kind is datetime.timezone:
        offset, *name = value.__getinitargs__()  # (offset,) or (offset, name): utc is timezone(timedelta(0))
        return _tag("timezone", name[0] if name else None, (offset.days, offset.seconds, offset.microseconds))
    if kind is frozenset:
        return _tag("frozenset", None, [_within("<item>", v, attribute=True) for v in value])
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        name = _allowed(kind, "named tuple class", True)
        return _tag(
            "namedtuple", name, [_within(f, v, attribute=True) for f, v in zip(kind._fields, value, strict=True)]
        )
    if dataclasses.is_dataclass(value):
        name = _allowed(kind, "dataclass", True)
        return _tag(
            "dataclass",
            name,
            {f.name: _within(f.name, getattr(value, f.name), attribute=True) for f in dataclasses.fields(value)},
        )
    if _is_omegaconf(value):
        try:
            tree, node_path = omegaconf_hydra.omegaconf_tree(value)
        except Exception as err:  # omegaconf raises its own types for configs it cannot walk
            raise UnstorableValue("", type(value).__name__, f"Its tree cannot be read ({err}).") from None
        return _tag("omegaconf", None, (encode(tree), encode(node_path)))
    return None


def _partial_tag(value: functools.partial) -> dict[str, Any]:
    """``(args, keywords)``, plus ``{"hydra": {attribute: str}}`` for Hydra's own partial (``_partial_: true``)."""
    hydra = type(value) is not functools.partial
    attributes = dict(value.__dict__)
    extras = {"hydra": {a: attributes.pop(a, None) for a in omegaconf_hydra.HYDRA_PARTIAL_ATTRIBUTES}} if hydra else {}
    if attributes or not all(isinstance(v, str) for v in extras.get("hydra", {}).values()):
        raise UnstorableValue(
            "", allowlist.name_of(type(value)), "A partial with attributes set on it cannot be stored."
        )
    func = _allowed(value.func, "callable of functools.partial", True, step=".func")
    args = _within("args", value.args, attribute=True)
    keywords = _within("keywords", dict(value.keywords), attribute=True)
    return _tag("partial", func, (args, keywords, extras) if extras else (args, keywords))


def _tag(kind: str, name: str | None, payload: Any) -> dict[str, Any]:
    return {TAG: (kind, name, payload)}


def _allowed(obj: Any, what: str, condition: bool, *, step: str = "") -> str:
    """The dotted name of ``obj`` when the allow-list holds it under that name."""
    name = allowlist.name_of(obj)
    if not condition or name is None or allowlist.lookup(name) is not obj:
        raise UnstorableValue(step, name or repr(obj), _register_hint(name, what))
    return name


def _register_hint(name: str | None, what: str) -> str:
    shown = name or "..."
    return (
        f"It is a {what} outside lightning_dcp's allow-list: allow it for saving and loading with"
        f" `lightning_dcp.add_safe_globals([{shown}])` in the module that defines it (so that every process, also"
        " those a strategy launches, registers it), or store plain values there."
    )


def _hint(value: Any) -> str:
    if isinstance(value, torch.nn.Module):
        return (
            "A module's weights are already in the checkpoint's state_dict: leave it out of the hyperparameters with"
            " `self.save_hyperparameters(ignore=[...])` (naming the argument), as Lightning recommends."
        )
    return (
        "Store plain values there (dict, list, str, numbers, tensors; e.g. `dataclasses.asdict(...)`); dataclasses,"
        " named tuples and enums are stored once their class is registered with"
        " `lightning_dcp.add_safe_globals([...])`."
    )


def weights_only_loads(value: Any) -> bool:
    """Whether ``torch.load(weights_only=True)`` reads ``value`` back from a ``torch.save``."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True


def _numpy_tag(value: Any) -> dict[str, Any] | None:
    if value.dtype.kind not in "biufc" or value.dtype == np.uint16:
        return None
    if isinstance(value, np.ndarray):
        return {NUMPY_TAG: ("ndarray", str(value.dtype), torch.from_numpy(np.ascontiguousarray(value).copy()))}
    return {NUMPY_TAG: ("scalar", str(value.dtype), value.item())}


def _is_omegaconf(value: Any) -> bool:
    module = sys.modules.get("omegaconf")
    return module is not None and isinstance(value, (module.DictConfig, module.ListConfig))
