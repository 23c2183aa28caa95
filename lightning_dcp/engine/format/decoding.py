"""Decoding the codec's tags: every tag checked against the allow-list and rebuilt, nothing else imported or run."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import functools
import pathlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_dcp._compat import omegaconf_hydra
from lightning_dcp.engine.format import allowlist
from lightning_dcp.engine.format.codec_tags import _PATHS, NUMPY_TAG, TAG, DisallowedName, MalformedTag, _fields_of

try:  # numpy is optional for lightning_dcp
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with Lightning's dependencies
    np = None


def decode(value: Any) -> Any:
    """Objects back from the output of :func:`~lightning_dcp.engine.format.codec.encode`: every tag checked and rebuilt.

    Everything else is returned unchanged.

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
    """The numpy value :func:`~lightning_dcp.engine.format.codec._numpy_tag` encoded as ``(kind, dtype, payload)``."""
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
