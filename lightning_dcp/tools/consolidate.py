"""Consolidation: stream a sharded checkpoint into one Lightning ``.ckpt`` or safetensors, in bounded memory.

The input is read entry by entry (:mod:`lightning_dcp.engine.load.source`) and written as it arrives
(:mod:`lightning_dcp.tools.writers`), so peak memory is about one read batch plus the largest tensor, whatever the
checkpoint size. The command line lives in :mod:`lightning_dcp.consolidate`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from lightning_dcp._compat.torch_dcp import set_element
from lightning_dcp.engine import Location, Source, TensorEntry, designated, layout
from lightning_dcp.errors import CheckpointError
from lightning_dcp.tools.output import atomic_directory, atomic_file, refuse_existing
from lightning_dcp.tools.progress import progress_bar
from lightning_dcp.tools.writers import CkptWriter, SafetensorsWriter

__all__ = [
    "DTYPES",
    "FORMATS",
    "cast_dtype",
    "cast_tensor",
    "consolidate",
    "parse_size",
    "refuse_overlap",
    "resolve_dtype",
    "selected",
]

SUFFIX = ".consolidated"
"""Suffix of the default ``.ckpt`` output (see :func:`default_output`), as Lightning's own tool names its output."""
FORMATS = ("ckpt", "safetensors")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Accepted ``dtype`` names (``torch.dtype`` objects of these three are accepted too)."""
DEFAULT_BATCH_BYTES = 64 << 20
"""Bytes read per ``dcp.load`` call; a larger tensor is read alone."""
_TRAINING_KEYS = (layout.OPTIMIZER_KEY, "lr_schedulers", "callbacks")
"""What Lightning leaves out of a ``weights_only`` checkpoint."""
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*", re.IGNORECASE)


def consolidate(
    src: str | os.PathLike,
    *,
    dst: str | os.PathLike | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
    format: str | None = None,
    weights_only: bool | None = None,
    dtype: str | torch.dtype | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    max_shard_size: int | str | None = None,
    progress: bool | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
) -> str:
    """Stream the checkpoint directory ``src`` into one Lightning ``.ckpt`` file or safetensors file(s).

    ``src`` is a lightning_dcp checkpoint, a Lightning sharded checkpoint (``FSDPStrategy(state_dict_type=
    "sharded")`` / ``ModelParallelStrategy``: a DCP directory with ``meta.pt``), or any DCP directory. Tensors are
    read a bounded batch at a time and written as they arrive: peak memory is about ``batch_bytes`` plus twice the
    largest tensor, not the checkpoint size.

    ``.ckpt`` output holds ``state_dict`` (full tensors), ``optimizer_states`` (``optimizer.state_dict()`` layout,
    integer parameter ids) and the rest of the Trainer state, so ``torch.load(dst, weights_only=True)`` (also with
    ``mmap=True``), ``LightningModule.load_from_checkpoint(dst)`` and ``trainer.fit(model, ckpt_path=dst)`` accept it.
    A Fabric checkpoint becomes the dict ``fabric.save`` was given (module states under their keys, optimizer
    states in ``optimizer.state_dict()`` layout, the other values as saved), which ``fabric.load`` accepts under any
    strategy. A plain DCP directory becomes its nested state dict, as ``dcp_to_torch`` writes it. safetensors output
    holds tensors only: model weights under their FQNs (prefixed by the module's key when a Fabric checkpoint holds
    several modules; plus optimizer tensors under their flat DCP keys when not ``weights_only``), with ``format``,
    ``epoch`` and ``global_step`` in its metadata.

    Args:
        src: Checkpoint directory, local path or fsspec URL.
        dst: Output path. Default: beside the directory holding the checkpoint (a run's ``dirpath``), never among
            its checkpoints: ``run1/last.ckpt`` gives ``run1-<the checkpoint it designates>.consolidated`` (ckpt),
            ``....safetensors`` (safetensors) or the directory ``...-safetensors`` (sharded safetensors); see
            ``default_output``.
        storage_options: fsspec options for reading ``src`` and writing ``dst``.
        overwrite: Replace an existing ``dst`` (refused by default).
        format: ``"ckpt"`` or ``"safetensors"``. Default: ``"safetensors"`` when ``dst`` ends in ``.safetensors``
            or ``max_shard_size`` is given, else ``"ckpt"``.
        weights_only: Only model weights (and, for ``.ckpt``, the non-training state such as epoch, step and
            hyperparameters). Default: False for ``.ckpt``, True for safetensors.
        dtype: Cast floating-point tensors to ``"bf16"``, ``"fp16"`` or ``"fp32"``; other tensors keep their dtype.
        include: Glob patterns (``fnmatch``) on weight FQNs; only matching weights are written (default: all).
        exclude: Glob patterns on weight FQNs to leave out (applied after ``include``).
        max_shard_size: safetensors only: split into ``model-0000i-of-0000N.safetensors`` files of at most this
            many bytes (an int, or ``"500MB"``, ``"2GiB"``) plus ``model.safetensors.index.json`` in ``dst``.
        progress: Show a progress bar (tqdm, on stderr). Default: only when stderr is a terminal.
        batch_bytes: Bytes of tensors read per ``dcp.load`` call.

    Returns:
        The output path (``str``).

    Rank 0 only (or any single process): reads without collectives.

    Raises:
        OutputExistsError: ``dst`` exists and ``overwrite`` is False, or ``dst`` is something an output never
            replaces (a directory, a checkpoint, a special file; for sharded output, a directory holding anything but
            an earlier sharded output). A ``FileExistsError``.
        ValueError: ``dst`` is the checkpoint itself, lies inside it or contains it (refused even with
            ``overwrite``: the source is never touched); invalid options (unknown format or dtype, patterns without
            ``weights_only``, shards for ckpt).
        CheckpointNotFoundError: Nothing exists at ``src``.
        NotACheckpointError: ``src`` is no DCP checkpoint, or a data file is truncated or corrupt (the file is
            named); no output is left behind.
        CheckpointError: The non-tensor state cannot be read with ``weights_only`` unpickling.
    """
    src = os.fspath(src)
    shard_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    fmt = _resolve_format(format, None if dst is None else os.fspath(dst), sharded=shard_bytes is not None)
    weights_only = fmt == "safetensors" if weights_only is None else weights_only
    cast = resolve_dtype(dtype)
    if shard_bytes is not None and fmt != "safetensors":
        raise ValueError("`max_shard_size` applies to safetensors output only; pass `format='safetensors'`.")
    if (include or exclude) and not weights_only:
        raise ValueError("`include`/`exclude` select model weights: pass `weights_only=True` (CLI: --weights-only).")
    given = Location(src, storage_options=storage_options)
    resolved = designated(given)
    if dst is None:
        dst = default_output(resolved, fmt=fmt, sharded=shard_bytes is not None)
    dst = os.fspath(dst)
    out = Location(dst, storage_options=storage_options)
    refuse_overlap((given, resolved), out)
    refuse_existing(out, overwrite=overwrite, kind="sharded" if shard_bytes is not None else "file")
    source = Source(resolved)
    entries = [
        e
        for e in source.entries
        if (e.weight or not weights_only) and (not e.weight or selected(e.name, include, exclude))
    ]
    if not any(e.weight for e in entries):
        raise CheckpointError(f"No model weights of {src!r} are selected (include={include}, exclude={exclude}).")
    bar = progress_bar(sum(e.nbytes for e in entries), progress, desc=os.path.basename(dst.rstrip("/")))
    try:
        if fmt == "ckpt":
            _write_ckpt(source, entries, out, weights_only=weights_only, cast=cast, batch_bytes=batch_bytes, bar=bar)
        else:
            metadata = _safetensors_metadata(source)
            planned = [(e.name, cast_dtype(e.dtype, cast), e.shape) for e in entries]
            stream = source.iter_tensors(entries, batch_bytes=batch_bytes)
            if shard_bytes is None:
                with atomic_file(out) as f:
                    _write_safetensors(f, planned, stream, metadata, cast, bar)
            else:
                _write_sharded(out, planned, stream, metadata, shard_bytes, cast, bar)
    finally:
        bar.close()
    return dst


def default_output(checkpoint: Location, *, fmt: str, sharded: bool) -> str:
    """Where an output goes by default: beside the directory holding ``checkpoint``, never among its checkpoints.

    ``run1/last.ckpt`` (designating ``run1/epoch=1-step=20.ckpt``) gives ``run1-epoch=1-step=20.ckpt.consolidated``
    beside ``run1`` (``.safetensors`` for safetensors, ``-safetensors`` for a sharded export); a checkpoint at the
    top of a relative path gives ``<checkpoint>.consolidated`` beside it.
    """
    suffix = "-safetensors" if sharded else {"ckpt": SUFFIX, "safetensors": ".safetensors"}[fmt]
    url = checkpoint.url.rstrip("/")
    directory, _, name = url.rpartition("/")
    if not directory:
        return url + suffix
    parent, slash, run = directory.rpartition("/")
    if not slash:  # a relative "run1/<checkpoint>"
        return f"{run}-{name}{suffix}"
    if parent.endswith(":/"):  # "s3://bucket/<checkpoint>": beside it, in the same bucket
        return url + suffix
    return f"{parent}/{run}-{name}{suffix}"


def refuse_overlap(sources: Sequence[Location], out: Location) -> None:
    """Raise ``ValueError`` when ``out`` is one of ``sources``, lies inside one, or contains one.

    Writing there (even with ``overwrite``) would replace or corrupt the checkpoint being read. Local paths are
    compared after resolving symlinks (``last.ckpt``); remote ones by filesystem type and path.
    """
    target = _canonical(out)
    for source in sources:
        path = _canonical(source)
        if type(source.fs) is not type(out.fs):
            continue
        if target == path or target.startswith(path + "/") or path.startswith(target + "/"):
            where = "is" if target == path else "lies inside" if target.startswith(path + "/") else "contains"
            raise ValueError(
                f"The output {out.url!r} {where} the checkpoint being consolidated ({source.url!r}): choose an output"
                " outside it (e.g. the default, `<checkpoint>.consolidated` beside it); the checkpoint is untouched."
            )


def _canonical(location: Location) -> str:
    return os.path.realpath(location.path) if location.local else location.path.rstrip("/")


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string: ``"500MB"`` (10**6), ``"2GiB"`` (2**30), ``"4096"``.

    Raises:
        ValueError: Not a positive size.
    """
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(str(value))
        if match is None:
            raise ValueError(f"Cannot read {value!r} as a size; use e.g. 5GB, 500MiB or 1000000.")
        unit = match.group(2).lower().rstrip("b")
        base = 1024 if unit.endswith("i") else 1000
        size = int(float(match.group(1)) * base ** " kmgt".index((unit.rstrip("i") or " ")[0]))
    if size <= 0:
        raise ValueError(f"A size must be positive, got {value!r}.")
    return size


# ------------------------------------------------------------------------------------------------------- ckpt
def _write_ckpt(
    source: Source, entries: list[TensorEntry], out: Location, *, weights_only: bool, cast: Any, batch_bytes: int, bar
) -> None:
    with atomic_file(out) as f:
        writer = CkptWriter(f)
        try:
            refs = {e.key: writer.reserve(cast_dtype(e.dtype, cast), e.shape) for e in entries}
            skeleton = _ckpt_skeleton(source, entries, refs, weights_only=weights_only)
            for entry, tensor in source.iter_tensors(entries, batch_bytes=batch_bytes):
                writer.write_tensor(refs[entry.key], cast_tensor(tensor, cast))
                bar.update(entry.nbytes)
                del tensor
            writer.finish(skeleton)
        except BaseException:
            writer.abandon()
            raise


def _ckpt_skeleton(source: Source, entries: list[TensorEntry], refs: dict, *, weights_only: bool) -> dict[str, Any]:
    """The object the ``.ckpt`` pickles: the Trainer's (or Fabric's) checkpoint dict, tensors as ``TensorRef``."""
    nested: dict[str, Any] = {}
    for entry in entries:
        set_element(nested, entry.path, refs[entry.key])
    small = [k for k in source.byte_keys if not (weights_only and source.optimizer_index(source._path(k)) is not None)]
    for key, value in source.read_values(small).items():
        set_element(nested, source._path(key), value)
    if source.kind == "dcp":
        return nested
    extra = source.read_extra()
    if source.roles is not None and not source.roles.trainer:
        return _fabric_checkpoint(nested, extra, source.roles, source=source, weights_only=weights_only)
    if source.kind == "lightning_dcp":
        nested.setdefault(layout.MODEL_KEY, {})
        checkpoint = layout.join_checkpoint(nested, extra, in_place=False, where=source.location.url)
        info = {k: v for k, v in checkpoint[layout.INFO_KEY].items() if k != "loaded_in_place"}
    else:  # Lightning's sharded layout: ``optimizer_{i}`` entries in get_optimizer_state_dict's (FQN) layout
        checkpoint = {**extra, layout.MODEL_KEY: nested.get(source.model_key, {})}
        optimizers = sorted((i, k) for k in nested if (i := source.optimizer_index((k,))) is not None)
        if optimizers:
            checkpoint[layout.OPTIMIZER_KEY] = [layout.fqns_to_param_ids(nested[k]) for _, k in optimizers]
        info = {"strategy": "lightning_sharded"}
    checkpoint[layout.INFO_KEY] = {**info, "consolidated_from": source.location.url, "optimizer_layout": "param_id"}
    if weights_only:
        for key in _TRAINING_KEYS:
            checkpoint.pop(key, None)
    return checkpoint


def _fabric_checkpoint(
    nested: dict[str, Any], extra: dict[str, Any], roles: layout.TreeRoles, *, source: Source, weights_only: bool
) -> dict[str, Any]:
    """Fabric's own single-file format: the dict ``fabric.save`` was given, as ``torch.save`` would have written it.

    Module states under their keys (full tensors, FQN keys), optimizer states in ``optimizer.state_dict()`` layout
    (integer parameter ids), every other value as saved, and each stateful data loader's state under its key as rank 0
    saved it (the one state a stock Fabric checkpoint holds: Fabric's strategies write rank 0's dict), so
    ``fabric.load(dst, state)`` under any Fabric strategy, with the loader in ``state``, restores its position, and
    ``model.load_state_dict(torch.load(dst)["model"])`` works. ``weights_only`` keeps the modules and the non-tensor
    values (loader states among them) and drops optimizers and other tensors.
    """
    checkpoint = {k: v for k, v in extra.items() if k != layout.INFO_KEY}
    for key, value in nested.items():
        if key == layout.RANK_KEY or (weights_only and key not in roles.modules):
            continue
        if key in roles.optimizers:  # an optimizer that never stepped has no "state" entry in DCP
            value = layout.fqns_to_param_ids({"state": {}, **value})
        checkpoint[key] = value
    loaders = extra.get(layout.INFO_KEY, {}).get(layout.LOADERS_INFO, ())
    if loaders:  # each rank saved its own position; other ranks' are dropped, as a stock checkpoint never has them
        saved = source.read_rank_objects(0).get(layout.LOADERS_INFO, {})
        checkpoint.update({key: saved[key] for key in loaders if key in saved})
    return checkpoint


# ------------------------------------------------------------------------------------------------ safetensors
def _write_safetensors(f, planned, stream, metadata: dict[str, str], cast, bar) -> None:
    writer = SafetensorsWriter(f, planned, metadata)
    for name, _, _ in planned:
        entry, tensor = next(stream)  # no other reference may outlive this iteration: the next read reuses memory
        writer.write(name, cast_tensor(tensor, cast))
        bar.update(entry.nbytes)
        del tensor
    writer.finish()


def _write_sharded(out: Location, planned, stream, metadata: dict[str, str], shard_bytes: int, cast, bar) -> None:
    shards: list[list] = [[]]
    size = 0
    for item in planned:
        nbytes = item[1].itemsize * _numel(item[2])
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {item[0]: name for name, shard in zip(names, shards, strict=True) for item in shard}
    total = sum(item[1].itemsize * _numel(item[2]) for item in planned)
    with atomic_directory(out) as staging:
        for name, shard in zip(names, shards, strict=True):
            with staging.open(name, "wb") as f:
                _write_safetensors(f, shard, stream, metadata, cast, bar)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with staging.open("model.safetensors.index.json", "wb") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True).encode())


def _safetensors_metadata(source: Source) -> dict[str, str]:
    metadata = {"format": "pt"}
    extra = source.read_extra() if source.kind != "dcp" else {}
    for key in ("epoch", "global_step"):
        if isinstance(extra.get(key), int):
            metadata[key] = str(extra[key])
    return metadata


# ---------------------------------------------------------------------------------------------------- helpers
def _resolve_format(format: str | None, dst: str | None, *, sharded: bool) -> str:
    if format is None:
        return "safetensors" if sharded or (dst or "").endswith(".safetensors") else "ckpt"
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    return format


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or those torch dtypes) as a ``torch.dtype``; ``None`` stays ``None``.

    Raises:
        ValueError: Any other value.
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"`dtype` must be one of {sorted(DTYPES)} (or the torch dtypes), got {dtype!r}.")


def cast_dtype(dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is written with: ``cast`` for floating point, else unchanged."""
    return cast if cast is not None and dtype.is_floating_point else dtype


def cast_tensor(tensor: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    """``tensor`` in :func:`cast_dtype`'s dtype (no copy when unchanged)."""
    return tensor.to(cast_dtype(tensor.dtype, cast))


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Whether the FQN ``name`` matches an ``include`` glob (or there is none) and no ``exclude`` glob."""
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel
