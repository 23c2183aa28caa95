"""Lightning's checkpoint upgrade for checkpoint directories: its migrations applied to the Trainer state they hold.

Lightning's ``python -m lightning.pytorch.utilities.upgrade_checkpoint PATH`` knows files only: given a checkpoint
directory it finds "no checkpoint files", and in a folder of them its glob matches the directories (named ``*.ckpt``)
and fails with ``IsADirectoryError``. :func:`upgrade_checkpoints` walks the same paths and

- migrates a lightning_dcp checkpoint directory with Lightning's own ``migrate_checkpoint``: nothing is written when
  no migration applies (every checkpoint lightning_dcp writes is current); otherwise it is rewritten with the
  migrated Trainer state, tensors and per-rank state unchanged, after a backup to the hidden ``.{name}.bak``;
- migrates the ``meta.pt`` of a Lightning sharded checkpoint directory (``ModelParallelStrategy`` /
  ``FSDPStrategy(state_dict_type="sharded")``) the same way (backup ``meta.pt.bak``);
- hands every other file with the extension to Lightning's own upgrade, unchanged (local files only, as Lightning).

The command line is ``python -m lightning_dcp.upgrade``; in a process that imported lightning_dcp, Lightning's own
``upgrade_checkpoint`` function is routed here too (:mod:`lightning_dcp.trainer.hooks`).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.migration import migrate_checkpoint, pl_legacy_patch

from lightning_dcp._compat import lightning_hooks
from lightning_dcp.engine import Location
from lightning_dcp.errors import CheckpointError, checkpoint_not_found, describe_load_error
from lightning_dcp.tools.output import atomic_file
from lightning_dcp.tools.rewrite import BACKUP_SUFFIX, rewrite_trainer_state

__all__ = ["Upgraded", "upgrade_checkpoints", "upgrade_from_lightning_args"]

_VERSION_KEY = "pytorch-lightning_version"


@dataclasses.dataclass(frozen=True)
class Upgraded:
    """What :func:`upgrade_checkpoints` did with one checkpoint."""

    path: str
    """The checkpoint (directory or file), as found under the given path."""
    action: str
    """``"migrated"``, ``"current"`` (no migration applies: unchanged), ``"lightning"`` (a file, upgraded by
    Lightning's own function), ``"skipped"`` or ``"failed"`` (see ``detail``; the checkpoint is unchanged)."""
    detail: str = ""
    """The migrations applied, or why the checkpoint was skipped."""


def upgrade_checkpoints(
    path: str | os.PathLike,
    *,
    extension: str = ".ckpt",
    map_to_cpu: bool = False,
    storage_options: dict[str, Any] | None = None,
    lightning_upgrade: Callable[[argparse.Namespace], None] | None = None,
) -> list[Upgraded]:
    """Upgrade the checkpoint(s) at ``path`` to the installed Lightning version's format.

    Args:
        path: A checkpoint directory, a checkpoint file, or a folder searched recursively for both (local path or
            fsspec URL; hidden entries, links and ``last`` pointers are skipped: they name checkpoints found anyway).
        extension: Files with this extension are handed to Lightning (``--extension`` of Lightning's tool).
        map_to_cpu: Passed to Lightning for files (``--map-to-cpu``).
        storage_options: fsspec options for remote storage.
        lightning_upgrade: Lightning's ``upgrade_checkpoint._upgrade`` (default: the original function).

    Returns:
        One :class:`Upgraded` per checkpoint found, in path order.

    Rank 0 only (or any single process).

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        CheckpointError: A directory could not be read or rewritten (it is unchanged then).
    """
    extension = extension if extension.startswith(".") else f".{extension}"
    root = Location(path, storage_options=storage_options)
    if not root.exists():
        raise checkpoint_not_found(root.url)
    upgrade_file = lightning_upgrade or lightning_hooks.lightning_upgrade()
    results = []
    for kind, location in _walk(root, extension):
        try:
            if kind == "dcp":
                results.append(_upgrade_directory(location, storage_options))
            elif kind == "lightning":
                results.append(_upgrade_meta(location))
            elif not location.local:
                results.append(Upgraded(location.url, "skipped", "Lightning's upgrade reads local files only"))
            else:
                upgrade_file(argparse.Namespace(path=location.path, extension=extension, map_to_cpu=map_to_cpu))
                results.append(Upgraded(location.url, "lightning"))
        except CheckpointError as err:  # one unreadable checkpoint does not stop the others
            results.append(Upgraded(location.url, "failed", str(err)))
        except Exception as err:  # noqa: BLE001 - Lightning's upgrade of a file raises whatever torch.load raised
            results.append(
                Upgraded(location.url, "failed", f"not a checkpoint Lightning can read ({describe_load_error(err)})")
            )
    return results


def upgrade_from_lightning_args(args: argparse.Namespace, lightning_upgrade: Callable[[argparse.Namespace], None]):
    """Lightning's ``upgrade_checkpoint._upgrade(args)`` with checkpoint directories handled (the installed hook).

    A path that does not exist or is a file goes to Lightning unchanged (its messages and exit codes).
    """
    location = Location(args.path)
    if not location.exists() or not location.isdir():
        lightning_upgrade(args)
        return
    for result in upgrade_checkpoints(
        args.path, extension=args.extension, map_to_cpu=args.map_to_cpu, lightning_upgrade=lightning_upgrade
    ):
        print(f"{result.action}: {result.path}{f' ({result.detail})' if result.detail else ''}")


def _walk(location: Location, extension: str) -> Iterator[tuple[str, Location]]:
    """``(kind, location)`` of every checkpoint at or under ``location``: ``"dcp"``, ``"lightning"`` or ``"file"``."""
    kind = _kind(location)
    if kind is not None:
        yield kind, location
        return
    if not location.isdir():
        if location.name.endswith(extension) and location.read_pointer() is None:
            yield "file", location
        return
    for name, _ in sorted(location.entries()):
        child = location.child(name)
        if name.startswith(".") or (child.local and os.path.islink(child.path)):
            continue
        yield from _walk(child, extension)


def _kind(location: Location) -> str | None:
    return location.checkpoint_kind() if location.isdir() else None


def _migrate(state: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Lightning's migrations applied to ``state`` in place: ``(state or None when none applied, description)``."""
    if _VERSION_KEY not in state:
        return None, "no Lightning version recorded: not a Trainer checkpoint"
    old = state[_VERSION_KEY]
    state, applied = migrate_checkpoint(state)
    if not applied:
        return None, f"written by Lightning {old}"
    names = ", ".join(fn for fns in applied.values() for fn in fns)
    return state, f"{old} -> {state[_VERSION_KEY]}: {names}"


def _upgrade_directory(location: Location, storage_options: dict[str, Any] | None) -> Upgraded:
    detail = ""

    def transform(state: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal detail
        migrated, detail = _migrate(state)
        return migrated

    rewritten = rewrite_trainer_state(location.url, transform, storage_options=storage_options)
    return Upgraded(location.url, "migrated" if rewritten else "current", detail)


def _upgrade_meta(location: Location) -> Upgraded:
    meta = location.lightning_meta()
    try:
        with meta.open() as f, pl_legacy_patch():
            state = torch.load(io.BytesIO(f.read()), map_location="cpu")
    except Exception as err:  # torch.load raises many types for unreadable bytes
        raise CheckpointError(f"Cannot read {meta.url}: {type(err).__name__}: {err}") from err
    migrated, detail = _migrate(state)
    if migrated is None:
        return Upgraded(location.url, "current", detail)
    backup = meta.sibling(meta.name + BACKUP_SUFFIX)
    if not backup.exists():
        location.fs.copy(meta.path, backup.path)
    with atomic_file(meta) as f:
        torch.save(migrated, f)
    return Upgraded(location.url, "migrated", detail)
