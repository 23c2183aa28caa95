"""The non-tensor state of a checkpoint: one ``torch.save`` blob that ``weights_only=True`` loading accepts.

Rank 0 writes everything of a checkpoint that is not a tensor tree (Lightning's loop, callback and scheduler state,
hparams; Fabric's plain objects) as one ``bytes`` entry of DCP's state dict, and each rank its own RNG states as
another (:mod:`lightning_dcp.engine.layout` places them). :func:`encode_extra` refuses at save time what could not be
loaded back with ``weights_only=True`` (naming the key path), and stores numpy values (which ``weights_only`` refuses)
as tagged tensors and plain values. :func:`decode_extra` checks the archive before unpickling anything
(:mod:`lightning_dcp.engine.archive`) and turns every failure into a ``CheckpointError``.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lightning_dcp.engine.archive import check_archive
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, describe_load_error

try:  # numpy is optional for lightning_dcp
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with Lightning's dependencies
    np = None

__all__ = ["decode_extra", "encode_extra"]


_NUMPY_TAG = "\x00lightning_dcp.numpy"
"""Key of the one-entry dict that stands for a numpy array or scalar in a blob (``weights_only`` refuses numpy)."""


def encode_extra(extra: Mapping[str, Any], *, what: str = "non-tensor state") -> bytes:
    """Serialize non-tensor state with ``torch.save`` into ``bytes`` that ``weights_only=True`` loading accepts.

    numpy arrays and scalars are stored as tensors and plain values and come back as numpy; anything else that
    ``torch.load(weights_only=True)`` would refuse (a dataclass, a custom class) is refused here, at save, so a
    checkpoint is never written that cannot be loaded.

    Args:
        extra: The state (dicts, lists, tuples, str, numbers, tensors, numpy; classes allowed with
            ``torch.serialization.add_safe_globals``).
        what: What this state is, for messages.

    Raises:
        CheckpointError: Something in ``extra`` would not load with ``weights_only=True``; the message names its
            key path, its type, and the fix.
    """
    state = _to_storable(dict(extra))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    blob = buffer.getvalue()
    try:
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as err:
        path, culprit = _unloadable_part(state)
        raise CheckpointError(
            f"The checkpoint's {what} holds {culprit} at {path}, which `torch.load(weights_only=True)` cannot load"
            f" back ({describe_load_error(err)}); the checkpoint would be unusable, so it was not"
            f" written. Store plain types there (dict, list, str, numbers, tensors; e.g. `dataclasses.asdict(...)`),"
            f" or allow the class for saving and loading with `torch.serialization.add_safe_globals([{culprit}])`."
        ) from None
    return blob


def decode_extra(blob: bytes, *, path: str, entry: str, weights_only: bool = True) -> dict[str, Any]:
    """Deserialize state written by :func:`encode_extra`; ``weights_only=True`` never runs code from the file.

    The archive is checked first (:func:`~lightning_dcp.engine.archive.check_archive`): nothing it claims is
    allocated beyond what it holds.

    Args:
        blob: The bytes of one DCP ``BYTE_IO`` entry.
        path: The checkpoint they come from, for messages.
        entry: The DCP entry (FQN) they were read from, named by the errors (``err.file``).
        weights_only: ``torch.load``'s ``weights_only``; ``False`` only for checkpoints the caller trusts.

    Raises:
        CheckpointError: The state holds classes ``weights_only`` loading refuses (written by another writer);
            the message names them and the fix.
        CorruptCheckpointError: The bytes are not a ``torch.save`` archive of a dict as :func:`encode_extra`
            writes it.
    """
    try:
        check_archive(blob)
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only)
    except Exception as err:  # a crafted or damaged archive: zip, pickle or tensor errors of many types
        if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):
            raise CheckpointError(
                f"The non-tensor state of the checkpoint at {path!r} names a class that `weights_only=True` loading"
                f" refuses ({describe_load_error(err)}). If you trust this checkpoint, allow it with"
                " `torch.serialization.add_safe_globals([...])` before loading."
            ) from None
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} is not readable ({describe_load_error(err)}).",
            file=entry,
        ) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} is a {type(state).__name__}, not a dict.",
            file=entry,
        )
    try:
        return _from_storable(state)
    except ValueError as err:
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} holds a numpy value that is not what lightning_dcp"
            f" writes ({err}).",
            file=entry,
        ) from None


def _to_storable(value: Any) -> Any:
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc" and value.dtype != np.uint16:
        return {_NUMPY_TAG: ("ndarray", str(value.dtype), torch.from_numpy(np.ascontiguousarray(value).copy()))}
    if np is not None and isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return {_NUMPY_TAG: ("scalar", str(value.dtype), value.item())}
    if type(value) is dict or type(value) is OrderedDict:
        return type(value)((k, _to_storable(v)) for k, v in value.items())
    if type(value) is list:
        return [_to_storable(v) for v in value]
    if type(value) is tuple:
        return tuple(_to_storable(v) for v in value)
    return value


def _from_storable(value: Any) -> Any:
    if type(value) is dict and len(value) == 1 and _NUMPY_TAG in value and np is not None:
        return _numpy_value(value[_NUMPY_TAG])
    if type(value) is dict or type(value) is OrderedDict:
        return type(value)((k, _from_storable(v)) for k, v in value.items())
    if type(value) is list:
        return [_from_storable(v) for v in value]
    if type(value) is tuple:
        return tuple(_from_storable(v) for v in value)
    return value


def _numpy_value(tag: Any) -> Any:
    """The numpy value :func:`_to_storable` encoded as ``(kind, dtype, payload)``; ``ValueError`` for anything else."""
    if not (type(tag) is tuple and len(tag) == 3 and tag[0] in ("ndarray", "scalar") and isinstance(tag[1], str)):
        raise ValueError(f"a numpy entry is {type(tag).__name__} {str(tag)[:60]!r}, not (kind, dtype, payload)")
    kind, dtype, payload = tag
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc":  # what _to_storable writes: no objects, strings or records
        raise ValueError(f"a numpy entry has dtype {tag[1]!r}")
    if kind == "ndarray":
        try:
            array = payload.detach().numpy() if isinstance(payload, torch.Tensor) else None
        except (TypeError, RuntimeError):  # bfloat16, sparse, conjugate or negative views: not what we write
            array = None
        if array is None or array.dtype != dtype:
            raise ValueError(
                f"a numpy {dtype} array is stored as {type(payload).__name__} {getattr(payload, 'dtype', '')}"
            )
        return array
    if type(payload) not in (bool, int, float, complex):
        raise ValueError(f"a numpy {dtype} scalar is stored as {type(payload).__name__}")
    try:
        return dtype.type(payload)
    except (OverflowError, TypeError) as err:
        raise ValueError(f"a numpy {dtype} scalar holds {payload!r} ({err})") from None


def _unloadable_part(value: Any, path: str = "") -> tuple[str, str]:
    """The deepest key path (``['callbacks']['x']``) that does not load with ``weights_only=True``, and its type."""
    children: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    for child_path, child in children:
        if not _loads(child):
            return _unloadable_part(child, child_path)
    return path or "the top level", f"{type(value).__module__}.{type(value).__qualname__}"


def _loads(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception:
        return False
    return True
