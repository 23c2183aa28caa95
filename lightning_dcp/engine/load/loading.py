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
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp.engine.catalog.integrity import check_checkpoint, check_indexed
from lightning_dcp.engine.catalog.lookup import designated
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.format.blob import load_stock_file
from lightning_dcp.engine.format.file_kinds import HEAD_BYTES, FileKind, describe, identify
from lightning_dcp.engine.format.keys import flatten
from lightning_dcp.engine.format.record_index import IndexEntry
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import (
    CheckpointError,
    NotACheckpointError,
    StateDictMismatchError,
    checkpoint_not_found,
    describe_load_error,
)

__all__ = [
    "Probe",
    "check_trainer_state",
    "fit_target",
    "lightning_model_key",
    "foreign_file",
    "foreign_file_at",
    "guarded_load",
    "load_file",
    "not_a_checkpoint_file",
    "probe",
    "read_lightning_meta",
    "read_torch_file",
    "torch_load_error",
]


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` found: the resolved URL, the kind of checkpoint and, for directories, DCP metadata."""

    url: str
    kind: Literal["file", "dcp", "lightning"]
    metadata: Metadata | None = None
    records: dict[str, IndexEntry] | None = None
    """The record index, where ``probe(..., indexed=True)`` found one (``metadata`` is then not read)."""
    indexed: bool = False
    """Whether the probe checked the checkpoint through its record index (``records``) rather than ``metadata``."""


def probe(location: Location, *, indexed: bool = False, resolve: bool = True) -> Probe:
    """Check what ``location`` holds: a committed lightning_dcp checkpoint, Lightning's sharded layout or one file.

    With ``indexed``, a checkpoint whose ``.commit`` holds a record index is checked without parsing its
    ``.metadata`` (:func:`~lightning_dcp.engine.catalog.integrity.check_indexed`): the probe then has ``records`` and no
    ``metadata``. With ``resolve`` (for a path a user gave), the checkpoint ``location`` designates is probed
    (:func:`~lightning_dcp.engine.catalog.lookup.designated`: a ``last`` name's newest valid one, pointers followed);
    ``False`` for a candidate the catalog already chose (:func:`~lightning_dcp.engine.catalog.lookup.candidates`),
    which is probed as it is.

    Rank 0 only: the caller broadcasts the result so every rank loads the same checkpoint.

    Raises:
        CheckpointNotFoundError: Nothing exists there.
        NotACheckpointError: A directory that is neither kind of checkpoint, or an incomplete save.
        CorruptCheckpointError: A committed checkpoint whose files do not match their checksums.
    """
    given = location.url
    if resolve:
        location = designated(location)
    if not location.exists():
        raise checkpoint_not_found(location.url, designated_by=None if location.url == given else given)
    if not location.isdir():
        return Probe(location.url, "file")
    if not location.is_committed() and location.is_lightning_sharded():
        return Probe(location.url, "lightning", read_metadata(location))
    checked = check_indexed(location) if indexed else None
    if checked is not None:
        _require_trainer_state(location, checked[1])
        return Probe(location.url, "dcp", records=checked[1], indexed=True)
    metadata = check_checkpoint(location)
    _require_trainer_state(location, metadata.state_dict_metadata)
    return Probe(location.url, "dcp", metadata)


def _require_trainer_state(location: Location, saved: Any) -> None:
    """A lightning_dcp checkpoint has the Trainer state entry (``saved``: its entries by FQN)."""
    if layout.EXTRA_KEY not in saved:
        raise NotACheckpointError(
            f"{location.url!r} is a DCP checkpoint that lightning_dcp did not write (it has no"
            f" {layout.EXTRA_KEY!r} entry with the Trainer state); load it with `torch.distributed.checkpoint.load`."
        )


def check_trainer_state(location: Location, metadata: Metadata) -> None:
    """What :func:`probe` checks beyond :func:`~lightning_dcp.engine.catalog.integrity.check_checkpoint`.

    For a caller that read the metadata after an indexed probe.

    Raises:
        NotACheckpointError: It has no Trainer state entry.
    """
    _require_trainer_state(location, metadata.state_dict_metadata)


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
    meta = location.lightning_meta()
    state = read_torch_file(meta, map_location="cpu", weights_only=weights_only, whole=True)
    if not isinstance(state, dict):
        raise NotACheckpointError(f"{meta.url} holds a {type(state).__name__}, not a dict.")
    return state


def load_file(location: Location, *, map_location: Any, weights_only: bool) -> dict[str, Any]:
    """Load a single-file Lightning checkpoint (``torch.save`` of the checkpoint dict) with ``torch.load``.

    Raises:
        NotACheckpointError: The file is not a ``torch.load``-able Lightning checkpoint.
        CheckpointError: It holds objects that ``weights_only`` loading refuses.
    """
    checkpoint = read_torch_file(location, map_location=map_location, weights_only=weights_only)
    if not isinstance(checkpoint, dict) or layout.MODEL_KEY not in checkpoint:
        raise NotACheckpointError(
            f"{location.url!r} is not a Lightning checkpoint: it has no {layout.MODEL_KEY!r} entry."
        )
    return checkpoint


def read_torch_file(location: Location, *, map_location: Any, weights_only: bool, whole: bool = False) -> Any:
    """``torch.load`` of the single file at ``location``, whatever it holds: the one read of a ``torch.save`` file.

    ``whole``: read the file's bytes in one call and load them from memory (a small file, such as ``meta.pt``, on a
    store whose files may not seek); otherwise ``torch.load`` reads the open file (a checkpoint of any size).

    With ``weights_only``, what stock Lightning pickles in hyperparameters (Hydra configs, partial optimizers, ...)
    is allowed and rebuilt by the codec (:func:`~lightning_dcp.engine.format.blob.load_stock_file`). Rank 0 or every
    rank alike (as Fabric reads a file); no collective.

    Raises:
        NotACheckpointError: ``torch.load`` failed: the message says what the file is and what to use when it is of
            another format (safetensors, GGUF, ...; :func:`not_a_checkpoint_file`), else what ``torch.load`` said.
        CheckpointError: The file names a class that ``weights_only`` loading refuses (the message says how to allow
            it).
    """
    try:
        with location.open() as f:
            if whole:
                f = io.BytesIO(f.read())
            return guarded_load(
                lambda: torch.load(f, map_location=map_location, weights_only=weights_only),
                path=location.url,
                weights_only=weights_only,
                identify=lambda: foreign_file(f),
            )
    except CheckpointError:
        raise
    except Exception as err:  # torch.load raises many types for bytes that are no checkpoint
        raise torch_load_error(location.url, err) from None


def guarded_load(
    load: Callable[[], Any], *, path: str, weights_only: bool, identify: Callable[[], FileKind | None]
) -> Any:
    """Run ``load`` (a ``torch.load`` of the file ``path``; Lightning's own, from its hooks), naming a foreign format.

    With ``weights_only``, through :func:`~lightning_dcp.engine.format.blob.load_stock_file` (what stock Lightning
    pickles is allowed and rebuilt). When ``load`` fails, ``identify()`` (:func:`foreign_file`,
    :func:`foreign_file_at`) says whether the file is of another format; only then is a file judged by its first
    bytes.

    Raises:
        NotACheckpointError: ``load`` failed and the file is of another format (the message says what to use).
        CheckpointError: With ``weights_only``, the file names a class that loading refuses (``load_stock_file``).
        Exception: ``load``'s own error otherwise.
    """
    try:
        return load_stock_file(load, path=path) if weights_only else load()
    except Exception:
        found = identify()
        if found is None:
            raise
        raise not_a_checkpoint_file(path, found) from None


def foreign_file(f: Any) -> FileKind | None:
    """The format of the open (seekable) file ``f`` when it is no checkpoint (safetensors, ...), read from its head.

    ``None`` when it may be a checkpoint, or when ``f`` cannot be read again. Ask after ``torch.load`` failed: a
    checkpoint is never judged by its first bytes.
    """
    try:
        f.seek(0, io.SEEK_END)
        size = f.tell()
        f.seek(0)
        return identify(f.read(HEAD_BYTES), size=size)
    except Exception:  # a stream that cannot seek: torch.load's own error stands
        return None


def foreign_file_at(location: Location | str) -> FileKind | None:
    """:func:`foreign_file` of the file at ``location`` (a path or URL without storage options: a ``Location``).

    ``None`` for a directory, a checkpoint, or a file that cannot be opened. Rank 0 only (or any single process).
    """
    try:
        location = location if isinstance(location, Location) else Location(location)
        if location.isdir():
            return None
        with location.open() as f:
            return foreign_file(f)
    except Exception:  # the caller's own error stands
        return None


def not_a_checkpoint_file(url: str, kind: FileKind) -> NotACheckpointError:
    """The error for the file ``url``, found to be ``kind``: what it is, and what to use.

    A safetensors file's weights load with ``lightning_dcp.load_model_weights``.
    """
    return NotACheckpointError(describe(url, kind))


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
    flat, _ = flatten(target)  # DCP's flat keys, in one pass
    model_prefix = model_key + "."

    def excluded(key: str) -> bool:
        return key.startswith(model_prefix) and any(fnmatch.fnmatchcase(key[len(model_prefix) :], p) for p in exclude)

    if model_key == layout.MODEL_KEY and any(k.startswith(model_prefix) for k in flat):
        if not any(k.startswith(model_prefix) for k in saved) and layout.EXTRA_KEY in saved:
            top = sorted({k.split(".", 1)[0] for k in saved} - {layout.EXTRA_KEY, layout.RANK_KEY})
            raise NotACheckpointError(
                f"{path!r} holds no Trainer model state ({model_key!r}; its top-level keys are {top}): a Fabric"
                " checkpoint (written by `fabric.save`) is loaded with `fabric.load`, or its weights with"
                " `lightning_dcp.load_model_weights(model, path, key=...)`."
            )
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
