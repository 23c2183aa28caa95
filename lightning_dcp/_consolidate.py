"""Consolidation: turn a sharded lightning_dcp checkpoint into one Lightning ``.ckpt`` file."""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_dcp import _format
from lightning_dcp._storage import Location, new_token
from lightning_dcp.checkpoint_io import DCPCheckpointIO
from lightning_dcp.errors import CheckpointError

__all__ = ["consolidate", "main"]

SUFFIX = ".consolidated"
"""Default output name: ``<checkpoint>.consolidated`` beside the input, as Lightning's own tool names it."""


def consolidate(
    src: str | os.PathLike,
    *,
    dst: str | os.PathLike | None = None,
    storage_options: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> str:
    """Write the checkpoint at ``src`` as one file in Lightning's checkpoint layout.

    The output holds ``state_dict`` (full tensors), ``optimizer_states`` (``optimizer.state_dict()`` layout,
    integer parameter ids), ``lr_schedulers``, ``loops``, ``callbacks``, hyperparameters and the rest, so
    ``torch.load(dst, weights_only=True)``, ``LightningModule.load_from_checkpoint(dst)`` and
    ``trainer.fit(model, ckpt_path=dst)`` accept it. The file is written under a temporary name and renamed into
    place, so a reader never sees a partial file.

    Args:
        src: A lightning_dcp checkpoint directory (local path or fsspec URL).
        dst: Output file; default ``<src>.consolidated``.
        storage_options: fsspec options for reading ``src`` and writing ``dst``.
        overwrite: Replace an existing ``dst`` (refused by default).

    Returns:
        The output path (``str``).

    Rank 0 only (or any single process): reads the whole checkpoint into CPU memory.

    Raises:
        FileExistsError: ``dst`` exists and ``overwrite`` is False.
        CheckpointNotFoundError, NotACheckpointError: ``src`` is missing or not a checkpoint.
    """
    src = os.fspath(src)
    dst = os.fspath(dst) if dst is not None else src.rstrip("/") + SUFFIX
    out = Location(dst, storage_options=storage_options)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{dst!r} already exists. Pass `overwrite=True` (CLI: --overwrite) to replace it.")
    checkpoint = DCPCheckpointIO(storage_options=storage_options).load_checkpoint(src)
    info = checkpoint.get(_format.INFO_KEY)
    if info is None:
        raise CheckpointError(f"{src!r} is a single-file checkpoint already; nothing to consolidate.")
    info = {k: v for k, v in info.items() if k != "loaded_in_place"}
    checkpoint[_format.INFO_KEY] = {**info, "consolidated_from": src, "optimizer_layout": _format.PARAM_ID}
    if info.get("optimizer_layout") == _format.FQN and _format.OPTIMIZER_KEY in checkpoint:
        checkpoint[_format.OPTIMIZER_KEY] = [_format.fqns_to_param_ids(s) for s in checkpoint[_format.OPTIMIZER_KEY]]
    _write_file(checkpoint, out)
    return dst


def _write_file(obj: Any, out: Location) -> None:
    """``torch.save`` to ``out`` atomically: temporary sibling + rename locally; object stores commit on close."""
    if not out.local:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with out.open(mode="wb") as f:
            f.write(buffer.getbuffer())
        return
    os.makedirs(os.path.dirname(os.path.abspath(out.path)), exist_ok=True)
    tmp = out.sibling(f".{out.name}.tmp-{new_token()}").path
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out.path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.consolidate",
        description="Turn a sharded lightning_dcp checkpoint directory into one Lightning .ckpt file.",
        epilog=(
            "examples:\n"
            "  python -m lightning_dcp.consolidate checkpoints/last.ckpt\n"
            "      writes checkpoints/last.ckpt.consolidated\n"
            "  python -m lightning_dcp.consolidate checkpoints/step=40.ckpt --output model.ckpt --overwrite\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument("--output", "-o", default=None, help=f"output file (default: CHECKPOINT{SUFFIX})")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns the process exit code (0 on success, 1 on a checkpoint error)."""
    args = _parser().parse_args(argv)
    try:
        dst = consolidate(args.checkpoint, dst=args.output, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(dst)
    return 0
