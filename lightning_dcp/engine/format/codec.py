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

The allow-list: the built-ins above, plus what :func:`add_safe_globals` registered, plus what
``torch.serialization.add_safe_globals`` registered.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import functools
import io
import pathlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_dcp._compat import omegaconf_hydra
from lightning_dcp.engine.format import allowlist

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

TAG = "\x00lightning_dcp.object"
"""Key of the one-entry dict that stands for an object the codec stores as ``(kind, name, payload)``."""
NUMPY_TAG = "\x00lightning_dcp.numpy"
"""Key of the one-entry dict that stands for a numpy array or scalar, ``(kind, dtype, payload)``."""

_PLAIN = (str, int, float, bool, type(None), bytes, complex)
_DATETIMES = {"datetime": datetime.datetime, "date": datetime.date, "time": datetime.time}
_PATHS = {
    c.__name__: c for c in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)
}


class UnstorableValue(ValueError):
    """A value the codec cannot store safely; ``path`` is its key path, ``culprit`` its type, ``hint`` the fix."""

    def __init__(self, path: str, culprit: str, hint: str) -> None:
        super().__init__(culprit)
        self.path, self.culprit, self.hint = path, culprit, hint

    def __str__(self) -> str:
        return f"{self.culprit} at {self.path or 'the top level'}"


class MalformedTag(ValueError):
    """A tag that the codec never writes (a damaged or crafted checkpoint)."""


class DisallowedName(ValueError):
    """A tag naming a class or function outside the allow-list; ``name`` is the dotted name."""

    def __init__(self, name: str, kind: str) -> None:
        super().__init__(f"{kind} {name!r}")
        self.name, self.kind = name, kind


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


def decode(value: Any) -> Any:
    """Objects back from :func:`encode`'s output: every tag checked and rebuilt, everything else unchanged.

    Raises:
        MalformedTag: A tag with a shape, kind or payload the codec never writes.
        DisallowedName: A tag naming a class or function outside the allow-list.
    """
    kind = type(value)
    if kind is dict and len(value) == 1:
        if TAG in value:
            return _decode_object(value[TAG])
        if NUMPY_TAG in value and np is not None:
            return _numpy_value(value[NUMPY_TAG])
    if kind is dict or kind is OrderedDict:
        return kind((k, decode(v)) for k, v in value.items())
    if kind is list:
        return [decode(v) for v in value]
    if kind is tuple:
        return tuple(decode(v) for v in value)
    return value


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


def _fields_of(kind: type) -> tuple[str, ...]:
    time = ("hour", "minute", "second", "microsecond")
    return ("year", "month", "day", *time) if kind is datetime.datetime else time


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


# ---------------------------------------------------------------------------------------------- decoding
def _decode_object(tag: Any) -> Any:
    if not (type(tag) is tuple and len(tag) == 3 and type(tag[0]) is str and type(tag[1]) in (str, type(None))):
        raise MalformedTag(f"a tag is {type(tag).__name__} {str(tag)[:60]!r}, not (kind, name, payload)")
    kind, name, payload = tag
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise MalformedTag(f"a tag of unknown kind {kind[:40]!r}")
    try:
        return decoder(name, payload)
    except (MalformedTag, DisallowedName):
        raise
    except (TypeError, ValueError, OverflowError, KeyError, AttributeError) as err:
        raise MalformedTag(f"a {kind} tag whose payload does not fit ({type(err).__name__}: {err!s:.120})") from None


def _need(payload: Any, kind: type, size: int | None = None) -> Any:
    if type(payload) is not kind or (size is not None and len(payload) != size):
        shape = f"{kind.__name__}" + (f" of {size}" if size is not None else "")
        raise MalformedTag(f"a payload is {type(payload).__name__} {str(payload)[:60]!r}, not a {shape}")
    return payload


def _ints(values: Iterable[Any]) -> list[int]:
    values = list(values)
    if not all(type(v) is int for v in values):
        raise MalformedTag(f"expected integers, got {str(values)[:60]!r}")
    return values


def _class(name: Any, test: Callable[[Any], bool], what: str) -> Any:
    cls = allowlist.lookup(name) if type(name) is str else None
    if cls is None:
        raise DisallowedName(str(name), what)
    if not (isinstance(cls, type) and test(cls)):
        raise MalformedTag(f"{name!r} is not a {what}")
    return cls


def _decode_enum(name: Any, payload: Any) -> Any:
    cls = _class(name, lambda c: issubclass(c, enum.Enum), "enum class")
    return cls[_need(payload, str)]


def _decode_type(name: Any, payload: Any) -> Any:
    obj = allowlist.lookup(name) if type(name) is str else None
    if obj is None or not isinstance(obj, type):
        raise DisallowedName(str(name), "class")
    return obj


def _decode_partial(name: Any, payload: Any) -> Any:
    func = allowlist.lookup(name) if type(name) is str else None
    if func is None:
        raise DisallowedName(str(name), "callable of functools.partial")
    args, keywords, *extras = _need(payload, tuple, 3 if type(payload) is tuple and len(payload) == 3 else 2)
    keywords = decode(_need(keywords, dict))
    if not all(type(k) is str for k in keywords):
        raise MalformedTag("a partial's keyword names are not all strings")
    hydra = _need(extras[0], dict, 1)["hydra"] if extras else None
    if hydra is None:
        return functools.partial(func, *decode(_need(args, tuple)), **keywords)
    cls = omegaconf_hydra.hydra_partial_class(load=True)
    names = omegaconf_hydra.HYDRA_PARTIAL_ATTRIBUTES
    if cls is None:
        raise MalformedTag("a Hydra partial (hydra-core >= 1.3.8), but Hydra is not installed")
    if type(hydra) is not dict or sorted(hydra) != sorted(names) or not all(type(v) is str for v in hydra.values()):
        raise MalformedTag(f"a Hydra partial's attributes are {str(hydra)[:80]!r}")
    partial = cls(func, *decode(_need(args, tuple)), **keywords)
    partial.__dict__.update(hydra)
    return partial


def _decode_namespace(name: Any, payload: Any) -> Any:
    values = decode(_need(payload, dict))
    if not all(type(k) is str for k in values):
        raise MalformedTag("a Namespace's attribute names are not all strings")
    return argparse.Namespace(**values)


def _decode_path(name: Any, payload: Any) -> Any:
    cls = _PATHS.get(name) if type(name) is str else None
    if cls is None:
        raise MalformedTag(f"a path of unknown class {name!r}")
    if cls is not type(pathlib.Path()) and cls in (pathlib.PosixPath, pathlib.WindowsPath):
        cls = pathlib.Path  # a concrete path of the other operating system: the path class of this one
    return cls(_need(payload, str))


def _decode_clock(kind: type) -> Callable[[Any, Any], Any]:
    def decode_clock(name: Any, payload: Any) -> Any:
        count = len(_fields_of(kind)) + 2
        *fields, fold, tz = _need(payload, tuple, count)
        tz = decode(tz)
        if tz is not None and type(tz) is not datetime.timezone:
            raise MalformedTag(f"a time zone is {type(tz).__name__}, not datetime.timezone")
        return kind(*_ints(fields), tzinfo=tz, fold=_ints([fold])[0])

    return decode_clock


def _decode_date(name: Any, payload: Any) -> Any:
    return datetime.date(*_ints(_need(payload, tuple, 3)))


def _decode_timedelta(name: Any, payload: Any) -> Any:
    days, seconds, microseconds = _ints(_need(payload, tuple, 3))
    return datetime.timedelta(days=days, seconds=seconds, microseconds=microseconds)


def _decode_timezone(name: Any, payload: Any) -> Any:
    offset = _decode_timedelta(None, payload)
    return datetime.timezone(offset) if name is None else datetime.timezone(offset, name)


def _decode_frozenset(name: Any, payload: Any) -> Any:
    return frozenset(decode(_need(payload, list)))


def _decode_namedtuple(name: Any, payload: Any) -> Any:
    cls = _class(name, lambda c: issubclass(c, tuple) and hasattr(c, "_fields"), "named tuple class")
    return cls(*decode(_need(payload, list, len(cls._fields))))


def _decode_dataclass(name: Any, payload: Any) -> Any:
    cls = _class(name, dataclasses.is_dataclass, "dataclass")
    values = _need(payload, dict)
    names = [f.name for f in dataclasses.fields(cls)]
    if sorted(values) != sorted(names):
        raise MalformedTag(f"a {name} holds the fields {sorted(values)!r:.80}, not {sorted(names)!r:.80}")
    obj = cls.__new__(cls)
    for field in names:  # as pickle restores an instance: field by field, no __init__
        object.__setattr__(obj, field, decode(values[field]))
    return obj


def _decode_omegaconf(name: Any, payload: Any) -> Any:
    tree, path = _need(payload, tuple, 2)
    try:
        import omegaconf  # noqa: F401 - the one import a tag may cause: the codec's own OmegaConf support
    except ImportError:
        raise MalformedTag("an OmegaConf config, but omegaconf is not installed: `pip install omegaconf`") from None
    try:
        return omegaconf_hydra.omegaconf_build(decode(tree), decode(_need(path, list)))
    except (MalformedTag, DisallowedName):
        raise
    except Exception as err:  # omegaconf raises its own error types for content it refuses
        raise MalformedTag(f"an OmegaConf config that omegaconf refuses ({type(err).__name__}: {err!s:.120})") from None


_DECODERS: dict[str, Callable[[Any, Any], Any]] = {
    "enum": _decode_enum,
    "type": _decode_type,
    "partial": _decode_partial,
    "namespace": _decode_namespace,
    "path": _decode_path,
    "datetime": _decode_clock(datetime.datetime),
    "time": _decode_clock(datetime.time),
    "date": _decode_date,
    "timedelta": _decode_timedelta,
    "timezone": _decode_timezone,
    "frozenset": _decode_frozenset,
    "namedtuple": _decode_namedtuple,
    "dataclass": _decode_dataclass,
    "omegaconf": _decode_omegaconf,
}


def _numpy_value(tag: Any) -> Any:
    """The numpy value :func:`_numpy_tag` encoded as ``(kind, dtype, payload)``."""
    if not (type(tag) is tuple and len(tag) == 3 and tag[0] in ("ndarray", "scalar") and isinstance(tag[1], str)):
        raise MalformedTag(f"a numpy entry is {type(tag).__name__} {str(tag)[:60]!r}, not (kind, dtype, payload)")
    kind, dtype, payload = tag
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc":  # what _numpy_tag writes: no objects, strings or records
        raise MalformedTag(f"a numpy entry has dtype {tag[1]!r}")
    if kind == "ndarray":
        try:
            array = payload.detach().numpy() if isinstance(payload, torch.Tensor) else None
        except (TypeError, RuntimeError):  # bfloat16, sparse, conjugate or negative views: not what we write
            array = None
        if array is None or array.dtype != dtype:
            raise MalformedTag(
                f"a numpy {dtype} array is stored as {type(payload).__name__} {getattr(payload, 'dtype', '')}"
            )
        return array
    if type(payload) not in (bool, int, float, complex):
        raise MalformedTag(f"a numpy {dtype} scalar is stored as {type(payload).__name__}")
    try:
        return dtype.type(payload)
    except (OverflowError, TypeError) as err:
        raise MalformedTag(f"a numpy {dtype} scalar holds {payload!r} ({err})") from None


def _is_omegaconf(value: Any) -> bool:
    module = sys.modules.get("omegaconf")
    return module is not None and isinstance(value, (module.DictConfig, module.ListConfig))
