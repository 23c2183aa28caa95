"""A checkpoint directory read back as the dict ``torch.load`` gives for a single-file Lightning checkpoint.

This is what ``LightningModule.load_from_checkpoint(<directory>)`` needs (lightning_dcp routes Lightning's loader
here, see :mod:`lightning_dcp.trainer.hooks`): the model's full weights under ``"state_dict"`` and the non-tensor
Trainer state (hyperparameters, epoch, global step, callbacks' and datamodule state, ``on_save_checkpoint``
additions). Optimizer states are not read: they are most of a training checkpoint's bytes and no inference or
evaluation load needs them (``lightning_dcp.consolidate`` writes a file with everything).

Weights are streamed from the checkpoint a bounded batch at a time (:class:`~lightning_dcp.engine.load.source.Source`),
so peak memory is about the weights plus one batch, whatever world size or strategy wrote them (DDP, FSDP2 / DTensor
shards are read as full tensors).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from lightning_dcp.engine import (
    Location,
    Source,
    committed_checkpoints,
    designates_last,
    foreign_file_at,
    layout,
    not_a_checkpoint_file,
    probe,
)
from lightning_dcp.errors import NotACheckpointError
from lightning_dcp.tools.progress import progress_bar

__all__ = ["DEFAULT_BATCH_BYTES", "is_checkpoint_directory", "load_checkpoint"]

DEFAULT_BATCH_BYTES = 64 << 20
"""Bytes of weights read per ``dcp.load`` call (a larger tensor is read alone)."""


def is_checkpoint_directory(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` designates a checkpoint directory (directly, by a symlink or by a ``last`` pointer object).

    A ``last*`` name beside committed checkpoints designates the newest of them, also when its link or pointer
    dangles (see :func:`~lightning_dcp.engine.catalog.lookup.designated`).

    Anything else (a single file, a path that does not exist) answers ``False``: that is Lightning's to load.

    Rank 0 only (or any single process).

    Raises:
        BucketNotFoundError, StorageAccessError: The bucket does not exist, or the server refused the credentials.
    """
    location = Location(path, storage_options=storage_options)
    if location.local and not os.path.lexists(location.path):
        return False
    if _is_http(location):  # a static file server may neither list directories nor answer a HEAD of one
        return location.is_committed()
    if designates_last(location) and committed_checkpoints(location.parent(), whole=False):
        return True  # read as the newest committed checkpoint beside it, whatever the link or pointer says
    resolved = location.resolve()
    return resolved.exists() and resolved.isdir()


def load_checkpoint(
    path: str | os.PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    map_location: Any = None,
    weights_only: bool | None = True,
    model_weights: bool = True,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Read a checkpoint directory into the dict a single-file Lightning checkpoint holds, without optimizer states.

    Args:
        path: A lightning_dcp checkpoint directory (any world size, any of its strategies, or the plugin under a
            stock strategy), or one written by Lightning's ``ModelParallelStrategy`` / ``FSDPStrategy(state_dict_type=
            "sharded")`` (with ``meta.pt``); local path or fsspec URL. Links and ``last`` pointers are followed; a
            broken ``last`` falls back to the newest valid checkpoint beside it, with a warning.
        storage_options: fsspec options (credentials, endpoint) for remote storage.
        map_location: Where the weights go, as for ``torch.load``: ``None`` (CPU), a device or device string, a dict
            (its ``"cpu"`` entry is used: weights are read into CPU memory first) or a callable ``(storage,
            location) -> storage | None`` called with each tensor's CPU storage and ``"cpu"``.
        weights_only: Unpickle the non-tensor state with ``torch.load(weights_only=True)`` (``None`` means ``True``).
        model_weights: Read the model weights (``False`` for a ``LightningDataModule``: ``"state_dict"`` is ``{}``).
        batch_bytes: Bytes of weights read per ``dcp.load`` call.
        progress: Show a progress bar over the weights' bytes (tqdm, on stderr), as ``consolidate`` does. Default:
            only when stderr is a terminal.

    Returns:
        ``{"state_dict": {fqn: tensor}, **trainer_state}``: full (unsharded) tensors of the saved dtypes, plus every
        non-tensor entry Lightning saved (``"hyper_parameters"``, ``"epoch"``, ``"global_step"``, ``"callbacks"``,
        ``"loops"``, ``"lr_schedulers"``, ...). No ``"optimizer_states"``.

    Rank 0 only (or any single process): no process group is needed; reads run without collectives.

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path`` (``"Checkpoint file not found: ..."``, as Lightning).
        NotACheckpointError: ``path`` is a single file (load it with ``torch.load``), an incomplete save, or no
            checkpoint; a data file is truncated or corrupt (the file is named).
        CheckpointError: The non-tensor state holds objects that ``weights_only`` unpickling refuses.
    """
    location = Location(path, storage_options=storage_options)  # refuses options that are not a dict
    if _is_http(location):
        with _downloaded(location) as local:
            return load_checkpoint(
                local, map_location=map_location, weights_only=weights_only, model_weights=model_weights,
                batch_bytes=batch_bytes, progress=progress,
            )  # fmt: skip
    found = probe(location)
    if found.kind == "file" and (kind := foreign_file_at(Location(found.url, storage_options=storage_options))):
        raise not_a_checkpoint_file(found.url, kind)
    if found.kind == "file":
        raise NotACheckpointError(
            f"{found.url!r} is a single-file checkpoint, not a checkpoint directory: load it with `torch.load` or"
            " Lightning's own `load_from_checkpoint`."
        )
    source = Source(Location(found.url, storage_options=storage_options))
    if source.roles is not None and not source.roles.trainer:
        layout.require_trainer_layout(found.url, source.read_extra().get(layout.INFO_KEY, {}))
    weights_only = True if weights_only is None else weights_only
    checkpoint = dict(source.read_extra(weights_only=weights_only))
    state_dict: dict[str, Any] = {}
    if model_weights:
        entries = [e for e in source.entries if e.weight]
        bar = progress_bar(sum(e.nbytes for e in entries), progress, desc=location.name)
        try:
            for entry, tensor in source.iter_tensors(entries, batch_bytes=batch_bytes):
                state_dict[entry.name] = _mapped(tensor, map_location)
                bar.update(entry.nbytes)
        finally:
            bar.close()
        small = [k for k in source.byte_keys if _model_path(source, k) is not None]
        for key, value in source.read_values(small, weights_only=weights_only).items():
            state_dict[_model_path(source, key)] = value  # non-tensor model state (e.g. ``_extra_state``)
    checkpoint[layout.MODEL_KEY] = state_dict
    checkpoint.pop(layout.OPTIMIZER_KEY, None)
    return checkpoint


def _is_http(location: Location) -> bool:
    return location.url.startswith(("http://", "https://"))


@contextlib.contextmanager
def _downloaded(location: Location) -> Iterator[str]:
    """A committed checkpoint served over HTTP(S), downloaded into a temporary directory (removed afterwards).

    Its ``.commit`` marker names every file, so the server need not list directories or answer range requests
    (Python's ``http.server`` does neither); as Lightning downloads a single-file URL with ``torch.hub`` before
    loading it. The files are checked against their checksums when they are loaded.
    """
    with tempfile.TemporaryDirectory(prefix="lightning_dcp-http-") as tmp:
        local = os.path.join(tmp, location.name or "checkpoint")
        location.download(local)
        yield local


def _model_path(source: Source, key: str) -> str | None:
    path = source._path(key)
    return str(path[1]) if len(path) == 2 and path[0] == source.model_key else None


def _mapped(tensor: torch.Tensor, map_location: Any) -> torch.Tensor:
    """``tensor`` (in CPU memory) moved where ``torch.load(map_location=...)`` would have put it."""
    if map_location is None:
        return tensor
    if isinstance(map_location, dict):
        target = map_location.get("cpu")
        return tensor if target is None else tensor.to(target)
    if callable(map_location):
        moved = map_location(tensor.untyped_storage(), "cpu")
        return tensor if moved is None else tensor.to(moved.device)
    return tensor.to(map_location)
