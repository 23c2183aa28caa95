"""The on-disk layout of a lightning_dcp checkpoint, and how a Lightning checkpoint dict maps onto it.

A checkpoint is one DCP directory. Its DCP state dict has three top-level entries:

- ``"state_dict"``: the model state (FQN keys; plain tensors, or DTensors written by their owners);
- ``"optimizer_states"``: a list, one optimizer state dict per optimizer (absent for ``weights_only``);
- ``"lightning"``: one ``bytes`` blob written by rank 0 only, a ``torch.save`` of everything else Lightning puts in
  a checkpoint (epoch, global_step, loops, callbacks, lr schedulers, hparams, datamodule and precision state,
  ``on_save_checkpoint`` additions) plus an ``"lightning_dcp"`` info dict.

Everything is inside DCP's files, so DCP's ``.metadata`` (written last) commits all of it at once, and every read
goes through ``weights_only`` unpickling.

A Fabric checkpoint (:mod:`lightning_dcp.fabric`) uses the same files with the user's own top-level keys: each
module's state (``get_model_state_dict``, FQN keys) and each optimizer's state (``get_optimizer_state_dict``, FQN
keys) under the key it had in ``fabric.save(path, state)``, other tensors under theirs, and the remaining objects in
the ``lightning`` blob. Its info records which keys hold modules and optimizers (``"modules"``, ``"optimizers"``);
a checkpoint whose info lacks them has the Trainer layout above. :func:`tree_roles` tells the two apart.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_dcp._compat import set_element
from lightning_dcp.engine.archive import check_archive
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, describe_load_error

try:  # numpy is optional for lightning_dcp
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with Lightning's dependencies
    np = None

__all__ = [
    "EXTRA_KEY",
    "FORMAT_VERSION",
    "INFO_KEY",
    "MODEL_KEY",
    "OPTIMIZER_KEY",
    "RANK_KEY",
    "SafeLoadPlanner",
    "TreeRoles",
    "align_optimizer_target",
    "build_state",
    "fqns_to_param_ids",
    "param_ids_to_fqns",
    "decode_extra",
    "encode_extra",
    "join_checkpoint",
    "metadata_target",
    "saved_optimizer_count",
    "saved_optimizer_ids",
    "saved_world_size",
    "split_checkpoint",
    "tree_roles",
]

MODEL_KEY = "state_dict"
OPTIMIZER_KEY = "optimizer_states"
EXTRA_KEY = "lightning"
RANK_KEY = "rank_states"
"""``rank_states.{rank}``: one ``bytes`` blob per rank (its RNG states), written by that rank."""
INFO_KEY = "lightning_dcp"
FORMAT_VERSION = 1
MODULES_INFO = "modules"
"""Info entry of a Fabric checkpoint: the top-level keys that hold a module's state (FQN -> tensor)."""
OPTIMIZERS_INFO = "optimizers"
"""Info entry of a Fabric checkpoint: the top-level keys that each hold one optimizer's state (FQN layout)."""

PARAM_ID = "param_id"
"""Optimizer layout of ``torch.optim.Optimizer.state_dict()``: state keyed by integer parameter index."""
FQN = "fqn"
"""Optimizer layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``: keyed by FQN."""


def optimizer_layout(optimizer_states: list[Mapping[str, Any]]) -> str:
    """Tell the two optimizer state layouts apart (``"fqn"`` or ``"param_id"``) from the params lists."""
    for osd in optimizer_states:
        for group in osd.get("param_groups", ()):
            for param in group.get("params", ()):
                return PARAM_ID if isinstance(param, int) else FQN
    return FQN


@dataclasses.dataclass(frozen=True)
class TreeRoles:
    """Which top-level keys of a checkpoint's tree hold model weights and which hold optimizer state."""

    modules: tuple[str, ...]
    """Keys whose value is a module's state dict (FQN -> tensor): ``("state_dict",)`` in the Trainer layout."""
    optimizers: tuple[str, ...]
    """Fabric: keys that each hold one optimizer's state. Trainer: ``("optimizer_states",)``, a list of them."""
    trainer: bool
    """Whether this is the Trainer layout (no ``"modules"`` recorded)."""

    def optimizer_index(self, path: tuple) -> int | None:
        """The optimizer a nested-state path (``("optimizer", "state", ...)``) belongs to; ``None``: no optimizer."""
        if not path or path[0] not in self.optimizers:
            return None
        return int(path[1]) if self.trainer and len(path) > 1 else self.optimizers.index(path[0])


def tree_roles(info: Mapping[str, Any]) -> TreeRoles:
    """The roles of a checkpoint's top-level keys, from the info dict recorded in its blob (``"lightning_dcp"``).

    A Fabric checkpoint lists its module and optimizer keys; any other checkpoint (no ``"modules"`` entry) has the
    Trainer layout: weights under ``"state_dict"``, a list of optimizer states under ``"optimizer_states"``.
    """
    if MODULES_INFO not in info:
        return TreeRoles(modules=(MODEL_KEY,), optimizers=(OPTIMIZER_KEY,), trainer=True)
    return TreeRoles(modules=tuple(info[MODULES_INFO]), optimizers=tuple(info.get(OPTIMIZERS_INFO, ())), trainer=False)


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Split a Lightning checkpoint dict into the engine's tree, objects and info (see this module's docstring).

    Args:
        checkpoint: What ``Trainer.save_checkpoint`` hands to the strategy. Not modified; tensors are not copied.

    Returns:
        ``(tree, objects, info)``: ``{"state_dict", "optimizer_states"}`` for DCP, the rest of the dict for the
        rank-0 blob, and ``{"optimizer_layout": ...}`` to record.

    Raises:
        CheckpointError: The dict has no ``"state_dict"``.
    """
    if MODEL_KEY not in checkpoint:
        raise CheckpointError(f"The checkpoint dict has no {MODEL_KEY!r} entry; got keys {sorted(checkpoint)}.")
    tree: dict[str, Any] = {MODEL_KEY: checkpoint[MODEL_KEY]}
    optimizers = None
    if OPTIMIZER_KEY in checkpoint:
        states = list(checkpoint[OPTIMIZER_KEY])
        optimizers = optimizer_layout(states)
        if optimizers == PARAM_ID:
            # DCP rebuilds integer path components as list indices: store the ids as strings.
            states = [{**osd, "state": {str(k): v for k, v in osd.get("state", {}).items()}} for osd in states]
        tree[OPTIMIZER_KEY] = states
    objects = {k: v for k, v in checkpoint.items() if k not in (MODEL_KEY, OPTIMIZER_KEY)}
    return tree, objects, {"optimizer_layout": optimizers}


def build_state(
    tree: Mapping[str, Any],
    *,
    objects: Mapping[str, Any] | None,
    info: Mapping[str, Any],
    rank: int = 0,
    rank_objects: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DCP state dict of one rank's part of a save.

    Args:
        tree: Top-level keys to nested state dicts; reserved keys (``"lightning"``, ``"rank_states"``) are refused.
        objects: The rank-0 blob's content (``None`` on the other ranks: exactly one copy is written).
        info: Recorded under ``"lightning_dcp"`` in the blob, with the format version.
        rank: This process's rank.
        rank_objects: This rank's own state, stored as ``rank_states.{rank}``.

    Raises:
        CheckpointError: ``tree`` uses a reserved key.
    """
    reserved = {EXTRA_KEY, RANK_KEY} & set(tree)
    if reserved:
        raise CheckpointError(f"The keys {sorted(reserved)} are reserved by lightning_dcp; rename these entries.")
    state: dict[str, Any] = dict(tree)
    if objects is not None:
        extra = dict(objects)
        extra[INFO_KEY] = {**info, "format_version": FORMAT_VERSION}
        state[EXTRA_KEY] = encode_extra(extra)
    if rank_objects is not None:
        state[RANK_KEY] = {str(rank): encode_extra(rank_objects)}
    return state


def saved_world_size(metadata: Metadata) -> int | None:
    """The world size a checkpoint was saved at, from its ``rank_states.*`` entries (``None`` without them)."""
    ranks = [k for k in metadata.state_dict_metadata if k.startswith(RANK_KEY + ".")]
    return len(ranks) or None


def join_checkpoint(dcp_state: Mapping[str, Any], extra: Mapping[str, Any], *, in_place: bool) -> dict[str, Any]:
    """Reassemble a Lightning checkpoint dict from a loaded DCP state dict and its decoded extra state.

    ``in_place`` records (under ``"lightning_dcp"``) that tensors were loaded into a target from
    ``get_state_dict``, i.e. they are this rank's shards rather than full tensors.
    """
    checkpoint = dict(extra)
    checkpoint[INFO_KEY] = {**extra.get(INFO_KEY, {}), "loaded_in_place": in_place}
    checkpoint[MODEL_KEY] = dcp_state.get(MODEL_KEY, {})  # DCP stores no entry for an empty dict
    if OPTIMIZER_KEY in dcp_state:
        # DCP stores no entry for an empty ``state: {}`` (SGD without momentum, a save before the first step).
        states = [{**osd, "state": dict(osd.get("state", {}))} for osd in dcp_state[OPTIMIZER_KEY]]
        if extra.get(INFO_KEY, {}).get("optimizer_layout") == PARAM_ID:
            states = [{**osd, "state": {int(k): v for k, v in osd["state"].items()}} for osd in states]
        elif not in_place:  # full tensors for a stock strategy or a user: ``optimizer.state_dict()``'s layout
            states = [fqns_to_param_ids(osd) for osd in states]
        checkpoint[OPTIMIZER_KEY] = states
    return checkpoint


def saved_optimizer_ids(metadata: Metadata) -> dict[int, bool]:
    """``{optimizer index: keyed by parameter ids}`` of a checkpoint's ``optimizer_states`` entries.

    ``True`` where the saved state is keyed by integer parameter ids (written from ``optimizer.state_dict()`` under a
    stock strategy), ``False`` where keyed by FQN (``get_optimizer_state_dict``) or where the state is empty.
    """
    found: dict[int, bool] = {}
    for key, path in (metadata.planner_data or {}).items():
        if len(path) >= 2 and path[0] == OPTIMIZER_KEY and key in metadata.state_dict_metadata:
            index = int(path[1])
            ids = len(path) >= 4 and path[2] == "state" and str(path[3]).isdigit()
            found[index] = found.get(index, False) or ids
    return found


def align_optimizer_target(target: dict[str, Any], metadata: Metadata) -> dict[str, Any]:
    """Re-key FQN-keyed optimizer targets by parameter id where the checkpoint saved ids (and ids as strings).

    A checkpoint written under a stock strategy keys optimizer state by integer parameter id (``"0"``, ``"1"`` on
    disk); a target from ``get_optimizer_state_dict`` keys it by FQN. The ids follow each optimizer's
    ``param_groups`` order, which the target's ``params`` lists give; the loaded state is turned back into FQNs by
    :func:`param_ids_to_fqns`. The tensors are the target's own, so loading still fills them in place.
    """
    saved = saved_optimizer_ids(metadata)
    states = target.get(OPTIMIZER_KEY)
    if not states or not any(saved.values()):
        return target
    aligned = []
    for i, osd in enumerate(states):
        if not saved.get(i) or optimizer_layout([osd]) == PARAM_ID:
            aligned.append(osd)
            continue
        ids = {fqn: str(n) for n, fqn in enumerate(p for group in osd["param_groups"] for p in group["params"])}
        aligned.append({**osd, "state": {ids[fqn]: value for fqn, value in osd["state"].items()}})
    return {**target, OPTIMIZER_KEY: aligned}


def saved_optimizer_count(metadata: Metadata) -> int:
    """How many optimizers' states a checkpoint holds (0 for a weights-only checkpoint)."""
    indices = {int(path[1]) for path in (metadata.planner_data or {}).values() if path and path[0] == OPTIMIZER_KEY}
    return max(indices) + 1 if indices else 0


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


def decode_extra(blob: bytes, *, path: str, weights_only: bool = True) -> dict[str, Any]:
    """Deserialize state written by :func:`encode_extra`; ``weights_only=True`` never runs code from the file.

    The archive is checked first (:func:`~lightning_dcp.engine.archive.check_archive`): nothing it claims is
    allocated beyond what it holds.

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
            file=EXTRA_KEY,
        ) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} is a {type(state).__name__}, not a dict.",
            file=EXTRA_KEY,
        )
    try:
        return _from_storable(state)
    except ValueError as err:
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} holds a numpy value that is not what lightning_dcp"
            f" writes ({err}).",
            file=EXTRA_KEY,
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


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items are unpickled with ``weights_only``.

    DCP's own planner reads them with ``torch.load(weights_only=False)``, which runs code from the file.

    Args:
        weights_only: Passed to ``torch.load`` for every non-tensor item (default True).
        allow_partial_load: Load only the keys the checkpoint has (see ``DefaultLoadPlanner``).
    """

    def __init__(self, *, weights_only: bool = True, allow_partial_load: bool = False) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.weights_only = weights_only

    def load_bytes(self, read_item, value: io.BytesIO) -> None:  # noqa: D102 (DCP's planner contract)
        check_archive(value.getbuffer())  # nothing the archive claims is allocated beyond what it holds
        obj = torch.load(value, map_location="cpu", weights_only=self.weights_only)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def metadata_target(metadata: Metadata, *, prefixes: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Build an empty nested state dict from DCP metadata: CPU tensors of the saved global shapes and dtypes.

    Args:
        metadata: The checkpoint's DCP metadata.
        prefixes: Only the flat keys starting with one of these (``None``: all).

    Returns:
        A nested dict that ``dcp.load`` fills in place (the whole checkpoint lives in this process's memory).
    """
    target: dict[str, Any] = {}
    mappings = metadata.planner_data or {}
    for key, meta in metadata.state_dict_metadata.items():
        if prefixes is not None and not key.startswith(prefixes):
            continue
        if isinstance(meta, TensorStorageMetadata):
            value: Any = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            value = b""
        else:  # pragma: no cover - DCP has only these two kinds today
            raise CheckpointError(f"Unsupported DCP metadata entry {key!r}: {type(meta).__name__}.")
        if key in mappings:
            set_element(target, mappings[key], value)
        else:
            target[key] = value
    return target


def param_ids_to_fqns(
    state: Mapping[str, Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Re-key an ``optimizer.state_dict()`` (integer ids) by parameter FQN, for ``set_optimizer_state_dict``.

    Ids follow the order of ``optimizer.param_groups`` (as ``torch.optim.Optimizer.load_state_dict`` assumes).
    """
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in state["param_groups"] for i in group["params"]]
    if len(saved) != len(order):
        raise CheckpointError(
            f"The checkpoint's optimizer state covers {len(saved)} parameters but the optimizer has {len(order)}."
        )
    fqn_of = dict(zip(saved, order, strict=True))
    return {
        "state": {fqn_of[i]: v for i, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [fqn_of[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def fqns_to_param_ids(state: Mapping[str, Any]) -> dict[str, Any]:
    """Re-key an FQN-keyed optimizer state by integer ids in param_groups order (``optimizer.state_dict()``)."""
    id_of: dict[str, int] = {}
    for group in state["param_groups"]:
        for fqn in group["params"]:
            id_of.setdefault(fqn, len(id_of))
    return {
        "state": {id_of[fqn]: v for fqn, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [id_of[f] for f in g["params"]]} for g in state["param_groups"]],
    }
