"""Partial loads for fine-tuning: model weights only from a checkpoint, with key exclusion and a report."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from lightning_dcp.engine import Checkpointer, CheckpointerConfig, Location, foreign_file_at, layout, on_rank0, probe
from lightning_dcp.errors import CheckpointError, StateDictMismatchError

__all__ = ["LoadReport", "load_model_weights"]


@dataclass(frozen=True)
class LoadReport:
    """What [`load_model_weights`][lightning_dcp.load_model_weights] did.

    Attributes:
        loaded_keys: FQNs whose values came from the checkpoint.
        missing_keys: FQNs of the model that the checkpoint lacks (kept as initialised).
        unexpected_keys: FQNs in the checkpoint that the model lacks (ignored).
        excluded_keys: FQNs of the model skipped by ``exclude`` patterns (kept as initialised).
    """

    loaded_keys: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    excluded_keys: list[str] = field(default_factory=list)


def load_model_weights(
    model: torch.nn.Module,
    path: str | os.PathLike,
    *,
    key: str | None = None,
    exclude: Sequence[str] = (),
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> LoadReport:
    """Load only the model weights of a checkpoint into ``model``: no optimizer, scheduler or loop state.

    Works for plain modules and for sharded ones (FSDP2/DTensor parameters load only this rank's shard, resharding from
    whatever world size wrote the checkpoint), from lightning_dcp checkpoints, Lightning's own sharded directories,
    single ``.ckpt`` files and safetensors files (``pip install safetensors``). Typical use: in
    ``LightningModule.configure_model`` (after sharding) or before ``trainer.fit`` without ``ckpt_path``, to fine-tune
    from a pretraining run. Both front ends' checkpoints work both ways: a Fabric checkpoint's module into a
    LightningModule, a Trainer checkpoint's ``state_dict`` into the module of a Fabric run (FQNs must match: the same
    module class, or ``exclude``/``strict=False``).

    Args:
        model: The module to fill (its ``state_dict`` FQNs name the entries; for a LightningModule, the same FQNs
            as the checkpoint's ``state_dict``).
        path: Checkpoint directory or file, or a safetensors file of the weights (local path or fsspec URL).
        key: The top-level key of the weights in a lightning_dcp checkpoint: a Fabric checkpoint's module key (the
            key it had in ``fabric.save(path, state)``). ``None``: the Trainer's ``"state_dict"``, or a Fabric
            checkpoint's only module.
        exclude: Glob patterns of FQNs to leave untouched (e.g. ``["head.*"]`` for a new classification head).
        strict: Every non-excluded key of the model must be in the checkpoint and vice versa; with ``False`` only
            the shared keys load and the report lists the rest.
        storage_options: fsspec options for remote storage.

    Returns:
        A [`LoadReport`][lightning_dcp.LoadReport].

    Collective: call on all ranks when a process group is initialised.

    Raises:
        StateDictMismatchError: ``strict`` and keys differ, or a shared key's shape or dtype differs (always); the
            message names the FQNs, the saved and the expected shapes. Nothing is loaded then.
        CheckpointNotFoundError, NotACheckpointError: As for ``DCPCheckpointIO.load_checkpoint``.
        CheckpointError: ``key`` is ``None`` and a Fabric checkpoint holds several modules (they are named); a
            safetensors file without the ``safetensors`` package installed.
    """
    live = get_model_state_dict(model, options=StateDictOptions())
    excluded = sorted(k for k in live if any(fnmatch.fnmatchcase(k, p) for p in exclude))
    target = {k: v for k, v in live.items() if k not in excluded}
    checkpointer = Checkpointer(CheckpointerConfig(storage_options=storage_options))
    collective = dist.is_available() and dist.is_initialized()
    location = checkpointer.location(path)
    kind = on_rank0(collective, lambda: foreign_file_at(location))
    if kind is not None and kind.weights:  # a safetensors file: full tensors on every rank, as a single file
        saved = _read_safetensors(location)
        weights, missing, unexpected = _fit_full(location.url, target, saved, strict=strict, exclude=exclude)
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        return LoadReport(
            loaded_keys=sorted(set(target) - set(missing)),
            missing_keys=list(missing),
            unexpected_keys=list(unexpected),
            excluded_keys=excluded,
        )
    if key is None:
        key = _weights_key(checkpointer, os.fspath(path), collective=collective)
    loaded = checkpointer.load(
        path,
        target={key: target},
        strict=strict,
        collective=collective,
        only=[key],
        exclude=exclude,
        model_key=key,
    )
    if loaded.kind == "file":  # a single file: full tensors, checked here as the DCP path does
        saved = loaded.objects[layout.MODEL_KEY]
        weights, missing, unexpected = _fit_full(str(path), target, saved, strict=strict, exclude=exclude)
    else:
        weights, missing, unexpected = loaded.tree[key], loaded.missing_keys, loaded.unexpected_keys
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=not loaded.in_place, strict=False))
    return LoadReport(
        loaded_keys=sorted(set(target) - set(missing)),
        missing_keys=list(missing),
        unexpected_keys=list(unexpected),
        excluded_keys=excluded,
    )


def _read_safetensors(location: Location) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at ``location`` (on the CPU; a local file is memory-mapped)."""
    try:
        from safetensors.torch import load, load_file
    except ImportError:
        raise CheckpointError(
            f"{location.url!r} is a safetensors file: install the `safetensors` package to load it"
            " (`pip install safetensors`, or lightning-dcp[safetensors])."
        ) from None
    if location.local:
        return load_file(location.path, device="cpu")
    with location.open() as f:
        return load(f.read())


def _weights_key(checkpointer: Checkpointer, path: str, *, collective: bool) -> str:
    """The top-level key of the weights: ``"state_dict"``, or the only module of a Fabric checkpoint."""
    found = on_rank0(collective, lambda: probe(checkpointer.location(path)))
    if found.kind != "dcp":
        return layout.MODEL_KEY
    head = checkpointer.load(
        found.url, target={}, strict=False, collective=collective, objects_only=True, checked=found
    )
    modules = layout.tree_roles(head.objects.get(layout.INFO_KEY, {})).modules
    if len(modules) != 1:
        raise CheckpointError(
            f"{found.url!r} holds the weights of {len(modules)} modules {list(modules)}: choose one with `key=`."
        )
    return modules[0]


def _fit_full(
    path: str, target: dict[str, Any], saved: dict[str, Any], *, strict: bool, exclude: Sequence[str]
) -> tuple[dict[str, Any], list[str], list[str]]:
    saved = {k: v for k, v in saved.items() if not any(fnmatch.fnmatchcase(k, p) for p in exclude)}
    missing = sorted(set(target) - set(saved))
    unexpected = sorted(set(saved) - set(target))
    mismatched = {
        k: (tuple(saved[k].shape), saved[k].dtype, tuple(v.shape), v.dtype)
        for k, v in target.items()
        if k in saved and (tuple(saved[k].shape) != tuple(v.shape) or saved[k].dtype != v.dtype)
    }
    if mismatched or (strict and (missing or unexpected)):
        raise StateDictMismatchError(
            path,
            missing_keys=missing if strict else (),
            unexpected_keys=unexpected if strict else (),
            mismatched=mismatched,
        )
    return {k: saved[k] for k in target if k in saved}, missing, unexpected
