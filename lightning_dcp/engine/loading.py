"""Loading: what a checkpoint path holds, checking a load target against it, Lightning's own sharded layout.

Three kinds of checkpoint load through ``DCPCheckpointIO``:

- ``"dcp"``: a lightning_dcp directory (``.commit``, ``.metadata``, ``__{rank}_{n}.distcp``);
- ``"lightning"``: a directory written by Lightning's ``ModelParallelStrategy`` or ``FSDPStrategy(state_dict_type=
  "sharded")``: DCP files with ``state_dict.*`` (``model.*`` for FSDP) and ``optimizer_{i}.*`` entries, plus
  ``meta.pt`` (a ``torch.save`` of the rest of the Trainer state), so users of those strategies can switch;
- ``"file"``: one ``torch.save`` file (Lightning's ``.ckpt``, or lightning_dcp's consolidated output).
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp._compat import flatten_state_dict
from lightning_dcp.engine import layout
from lightning_dcp.engine.blob import load_stock_file
from lightning_dcp.engine.integrity import check_checkpoint, committed_checkpoints
from lightning_dcp.engine.marker import COMMIT_FILE
from lightning_dcp.engine.metadata import read_metadata
from lightning_dcp.engine.storage import POINTER_HEADER, Location
from lightning_dcp.errors import (
    CheckpointError,
    NotACheckpointError,
    StateDictMismatchError,
    checkpoint_not_found,
    describe_load_error,
)

__all__ = [
    "LIGHTNING_META_FILE",
    "Probe",
    "candidates",
    "designates_last",
    "fit_target",
    "lightning_model_key",
    "load_file",
    "load_torch_file",
    "probe",
    "read_lightning_meta",
    "torch_load_error",
]

LIGHTNING_META_FILE = "meta.pt"
"""The non-tensor Trainer state in Lightning's own sharded checkpoint directories."""

_LAST_NAME = re.compile(r"^last(-v\d+)?(\.ckpt)?$")
"""Names ``ModelCheckpoint`` gives its last checkpoint (``last.ckpt``, ``last-v1.ckpt``)."""


def designates_last(location: Location) -> bool:
    """Whether ``location`` asks for "the newest valid checkpoint of its directory" rather than one checkpoint.

    That is a ``last*`` name (what ``ckpt_path="last"`` resolves to under ``ModelCheckpoint``), or a checkpoint's
    ``.commit`` marker (what ``DCPModelCheckpoint`` hands Lightning when no ``last*`` entry can be stat-ed).
    """
    return bool(_LAST_NAME.match(location.name)) or location.name == COMMIT_FILE


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` found: the resolved URL, the kind of checkpoint and, for directories, DCP metadata."""

    url: str
    kind: Literal["file", "dcp", "lightning"]
    metadata: Metadata | None = None


def candidates(location: Location) -> list[str]:
    """The checkpoints to try, in order, for a load of ``location``.

    For a path that :func:`designates_last`, the committed checkpoint directories of its directory, newest first
    (whatever a ``last`` link or pointer says: a dangling, stale or escaping link is never trusted over what is on
    disk); a single-file ``last.ckpt`` comes first, and a ``last`` directory in Lightning's own sharded layout
    is tried when nothing committed exists. Any other path: itself, through pointers.

    Rank 0 only: the caller broadcasts the result so every rank loads the same checkpoint.

    Raises:
        CheckpointNotFoundError: Nothing exists there (Lightning's ``"Checkpoint file not found"`` case).
        NotACheckpointError: A ``last`` entry exists but no committed checkpoint beside it; a malformed pointer.
    """
    if not designates_last(location):
        resolved = location.resolve()
        if not resolved.exists():
            raise checkpoint_not_found(
                resolved.url, designated_by=None if resolved.url == location.url else location.url
            )
        return [resolved.url]
    directory = location.parent().parent() if location.name == COMMIT_FILE else location.parent()
    found = [candidate.url for _, candidate in committed_checkpoints(directory)]
    entry = location.parent() if location.name == COMMIT_FILE else location
    if entry.local and os.path.isfile(entry.path) and not _is_pointer(entry):  # a single file (TorchCheckpointIO)
        return [entry.url, *found]
    if found:
        return found
    if entry.exists() and entry.isdir() and entry.fs.exists(entry.join(LIGHTNING_META_FILE)):
        return [entry.url]
    if not entry.exists():
        raise checkpoint_not_found(entry.url)
    target = entry.resolve()  # a link or pointer to a checkpoint that is gone: Lightning's "not found" case
    if target.url != entry.url and not target.exists():
        raise checkpoint_not_found(target.url, designated_by=entry.url)
    raise NotACheckpointError(
        f"{entry.url!r} designates the newest checkpoint of {directory.url!r}, but no checkpoint there is committed"
        " (every save into it was interrupted). Start without `ckpt_path`, or remove the directory's uncommitted"
        " entries; `DCPModelCheckpoint` does both on its own."
    )


def _is_pointer(location: Location) -> bool:
    """Whether the local file at ``location`` is a checkpoint pointer (whatever it names)."""
    try:
        with open(location.path, "rb") as f:
            return f.read(len(POINTER_HEADER)) == POINTER_HEADER
    except OSError:
        return False


def probe(location: Location) -> Probe:
    """Check what ``location`` holds: a committed lightning_dcp checkpoint, Lightning's sharded layout or one file.

    Rank 0 only: the caller broadcasts the result so every rank loads the same checkpoint.

    Raises:
        CheckpointNotFoundError: Nothing exists there.
        NotACheckpointError: A directory that is neither kind of checkpoint, or an incomplete save.
        CorruptCheckpointError: A committed checkpoint whose files do not match their checksums.
    """
    given, location = location.url, location.resolve()
    if not location.exists():
        raise checkpoint_not_found(location.url, designated_by=None if location.url == given else given)
    if not location.isdir():
        return Probe(location.url, "file")
    if not location.is_committed() and location.fs.exists(location.join(LIGHTNING_META_FILE)):
        return Probe(location.url, "lightning", read_metadata(location))
    metadata = check_checkpoint(location)
    if layout.EXTRA_KEY not in metadata.state_dict_metadata:
        raise NotACheckpointError(
            f"{location.url!r} is a DCP checkpoint that lightning_dcp did not write (it has no"
            f" {layout.EXTRA_KEY!r} entry with the Trainer state); load it with `torch.distributed.checkpoint.load`."
        )
    return Probe(location.url, "dcp", metadata)


def lightning_model_key(metadata: Metadata) -> str:
    """Top-level key of the model state in a Lightning sharded checkpoint: ``"state_dict"``, or ``"model"`` (FSDP).

    Its optimizers are under ``optimizer_0``, ``optimizer_1``, ... in ``get_optimizer_state_dict``'s FQN layout.
    """
    saved = metadata.state_dict_metadata
    if any(k.startswith("state_dict.") for k in saved) or not any(k.startswith("model.") for k in saved):
        return "state_dict"
    return "model"


def read_lightning_meta(location: Location, *, weights_only: bool) -> dict[str, Any]:
    """Load ``meta.pt`` (the non-tensor Trainer state) of a Lightning sharded checkpoint, ``weights_only`` by default.

    Raises:
        CheckpointError: It holds objects ``weights_only`` refuses, or cannot be read.
    """
    where = f"{location.url}/{LIGHTNING_META_FILE}"
    try:
        with location.open(LIGHTNING_META_FILE) as f:
            state = load_torch_file(io.BytesIO(f.read()), url=where, map_location="cpu", weights_only=weights_only)
    except CheckpointError:
        raise
    except Exception as err:  # torch.load raises many types for bytes that are no checkpoint
        raise torch_load_error(f"{location.url}/{LIGHTNING_META_FILE}", err) from None
    if not isinstance(state, dict):
        raise NotACheckpointError(f"{location.url}/{LIGHTNING_META_FILE} holds a {type(state).__name__}, not a dict.")
    return state


def load_file(location: Location, *, map_location: Any, weights_only: bool) -> dict[str, Any]:
    """Load a single-file Lightning checkpoint (``torch.save`` of the checkpoint dict) with ``torch.load``.

    Raises:
        NotACheckpointError: The file is not a ``torch.load``-able Lightning checkpoint.
        CheckpointError: It holds objects that ``weights_only`` loading refuses.
    """
    try:
        with location.open() as f:
            checkpoint = load_torch_file(f, url=location.url, map_location=map_location, weights_only=weights_only)
    except CheckpointError:
        raise
    except Exception as err:  # torch.load raises many types for bytes that are no checkpoint
        raise torch_load_error(location.url, err) from None
    if not isinstance(checkpoint, dict) or layout.MODEL_KEY not in checkpoint:
        raise NotACheckpointError(
            f"{location.url!r} is not a Lightning checkpoint: it has no {layout.MODEL_KEY!r} entry."
        )
    return checkpoint


def load_torch_file(f: Any, *, url: str, map_location: Any, weights_only: bool) -> Any:
    """``torch.load`` of an open single-file checkpoint.

    With ``weights_only``, what stock Lightning pickles in hyperparameters (Hydra configs, partial optimizers, ...)
    is allowed and rebuilt by the codec (:func:`~lightning_dcp.engine.blob.load_stock_file`).
    """
    if not weights_only:
        return torch.load(f, map_location=map_location, weights_only=False)
    return load_stock_file(lambda: torch.load(f, map_location=map_location, weights_only=True), path=url)


def torch_load_error(where: str, err: Exception) -> CheckpointError:
    """A clear error for a ``torch.load`` of ``where`` that failed with ``err``."""
    if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):
        return CheckpointError(
            f"{where!r} names a class that `weights_only=True` loading refuses ({describe_load_error(err)})."
            " If you trust this file, allow the class with `torch.serialization.add_safe_globals([...])`, or pass"
            " `weights_only=False`."
        )
    return NotACheckpointError(f"{where!r} is not a checkpoint file torch.load can read ({describe_load_error(err)}).")


def fit_target(
    path: str,
    target: dict[str, Any],
    metadata: Metadata,
    *,
    strict: bool,
    model_key: str = layout.MODEL_KEY,
    exclude: Sequence[str] = (),
) -> tuple[dict[str, Any], list[str], list[str]]:
    """Check ``target`` against the checkpoint before anything is loaded; drop what the checkpoint lacks.

    Args:
        path: The checkpoint (for messages).
        target: ``{model_key: model state, optimizer entries...}`` as DCP will flatten it.
        metadata: The checkpoint's DCP metadata.
        strict: Model keys must match exactly; otherwise only the shared keys load.
        model_key: Top-level key of the model state (``"state_dict"``; ``"model"`` in Lightning's FSDP layout).
        exclude: Glob patterns of model FQNs that are neither loaded nor reported.

    Returns:
        The target, trimmed to what the checkpoint has; the missing and the unexpected model FQNs.

    Raises:
        StateDictMismatchError: Model keys differ (``strict``), optimizer keys differ, or shapes/dtypes differ.
    """
    saved = metadata.state_dict_metadata
    for key in [k for k in target if k != model_key]:
        if not any(s.startswith(key + ".") or s == key for s in saved):
            del target[key]  # e.g. a weights-only checkpoint: Lightning reports missing optimizer state itself
    optimizers = target.get(layout.OPTIMIZER_KEY)
    if optimizers is not None and model_key == layout.MODEL_KEY:
        count = layout.saved_optimizer_count(metadata)
        if count != len(optimizers):
            raise StateDictMismatchError(
                path,
                reason=f"It holds the state of {count} optimizer(s), but {len(optimizers)} are configured"
                " (`configure_optimizers`). Resume with the same optimizers, or load only the model weights"
                " (`lightning_dcp.load_model_weights`).",
            )
    flat, _ = flatten_state_dict(target)
    model_prefix = model_key + "."

    def excluded(key: str) -> bool:
        return key.startswith(model_prefix) and any(fnmatch.fnmatchcase(key[len(model_prefix) :], p) for p in exclude)

    missing = {k for k in flat if k not in saved}
    unexpected = {k for k in saved if k.startswith(model_prefix) and k not in flat and not excluded(k)}
    report = (
        sorted(k[len(model_prefix) :] for k in missing if k.startswith(model_prefix)),
        sorted(k[len(model_prefix) :] for k in unexpected),
    )
    mismatched = {}
    for key, value in flat.items():
        meta = saved.get(key)
        if isinstance(value, torch.Tensor) and meta is not None and hasattr(meta, "size"):
            if tuple(meta.size) != tuple(value.shape) or meta.properties.dtype != value.dtype:
                mismatched[key] = (tuple(meta.size), meta.properties.dtype, tuple(value.shape), value.dtype)
    if not strict:
        missing = {k for k in missing if not k.startswith(model_prefix)}
        unexpected = set()
    if missing or unexpected or mismatched:

        def strip(key: str) -> str:
            return key[len(model_prefix) :] if key.startswith(model_prefix) else key

        raise StateDictMismatchError(
            path,
            missing_keys=map(strip, missing),
            unexpected_keys=map(strip, unexpected),
            mismatched={strip(k): v for k, v in mismatched.items()},
        )
    return target, *report
