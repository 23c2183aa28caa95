"""Lightning users' habits with checkpoint directories: the hooks lightning_dcp installs into Lightning.

Importing lightning_dcp installs them (unless the environment variable ``LIGHTNING_DCP_LIGHTNING_HOOKS=0`` is set);
:func:`uninstall_lightning_hooks` puts Lightning's functions back, :func:`install_lightning_hooks` installs them again.
Lightning offers no public hook for any of these, so they go through :mod:`lightning_dcp._compat.lightning_hooks`
(checked against Lightning 2.6.6; a Lightning whose functions differ is left alone, with a warning):

- ``MyModel.load_from_checkpoint(<checkpoint directory>)`` and ``LightningDataModule.load_from_checkpoint``: the
  directory is read by :func:`lightning_dcp.load_checkpoint` (model weights and Trainer state, no optimizer states,
  memory about the weights plus one read batch); files go to Lightning unchanged. ``storage_options={...}`` is
  accepted as fsspec options (directories and files), unless the class's ``__init__`` takes a parameter of that
  name.
- ``lightning.pytorch.utilities.upgrade_checkpoint``'s upgrade, run in a process that imported lightning_dcp:
  checkpoint directories are migrated by :func:`lightning_dcp.trainer.upgrade.upgrade_checkpoints`, files by
  Lightning (``python -m lightning_dcp.upgrade PATH`` does the same from the command line).
- ``Trainer.fit(ckpt_path="last")`` with Lightning's own ``ModelCheckpoint`` in a Trainer that checkpoints through
  lightning_dcp (a ``DCPCheckpointIO`` or a ``dcp_*`` strategy): the newest committed checkpoint of its directory is
  found also when no ``last*.ckpt`` entry exists (where Lightning would start from scratch), as with
  ``DCPModelCheckpoint`` (:func:`lightning_dcp.trainer.model_checkpoint.find_last`).
- ``FSDPStrategy`` / ``ModelParallelStrategy`` given a ``DCPCheckpointIO`` warn at ``setup`` that they do not use it,
  naming ``strategy="dcp_fsdp"`` / ``"dcp_model_parallel"``.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dcp._compat import lightning_hooks, lightning_run
from lightning_dcp.engine import Location, foreign_file_at, guarded_load
from lightning_dcp.errors import checkpoint_not_found
from lightning_dcp.tools.checkpoint_dict import is_checkpoint_directory, load_checkpoint
from lightning_dcp.trainer.checkpoint_io import DCPCheckpointIO
from lightning_dcp.trainer.model_checkpoint import find_last
from lightning_dcp.trainer.strategies import DCPStrategyMixin

__all__ = ["HOOKS_ENV", "install_lightning_hooks", "installed_lightning_hooks", "uninstall_lightning_hooks"]

HOOKS_ENV = lightning_hooks.HOOKS_ENV

_DCP_STRATEGY_NAMES = {"FSDPStrategy": "dcp_fsdp", "ModelParallelStrategy": "dcp_model_parallel"}
_WARNED = "_lightning_dcp_warned_checkpoint_io"


def install_lightning_hooks() -> list[str]:
    """Install the hooks described in this module's docstring (idempotent).

    Called when lightning_dcp is imported, unless ``LIGHTNING_DCP_LIGHTNING_HOOKS=0``; call it to install them
    afterwards anyway.

    Returns:
        The dotted names of the Lightning functions now routed through lightning_dcp.
    """
    lightning_hooks.install_load_from_checkpoint_hook(_read_directory, _load_file)
    lightning_hooks.install_upgrade_hook(_upgrade)
    lightning_hooks.install_strategy_setup_hook(_check_strategy)
    lightning_hooks.install_find_last_hook(_find_last)
    return lightning_hooks.lightning_hooks_installed()


def uninstall_lightning_hooks() -> None:
    """Put back every Lightning function lightning_dcp replaced: Lightning behaves as without lightning_dcp.

    ``load_from_checkpoint(<checkpoint directory>)`` then fails in Lightning (``IsADirectoryError``); load with
    ``lightning_dcp.load_checkpoint(path)``, or consolidate into one file first.
    """
    lightning_hooks.uninstall_lightning_hooks()


def installed_lightning_hooks() -> list[str]:
    """The dotted names of the Lightning functions currently routed through lightning_dcp."""
    return lightning_hooks.lightning_hooks_installed()


def _read_directory(
    path: str | os.PathLike,
    *,
    map_location: Any,
    weights_only: bool | None,
    storage_options: dict[str, Any] | None,
    model_weights: bool,
) -> dict[str, Any] | None:
    if not is_checkpoint_directory(path, storage_options=storage_options):
        if not Location(path, storage_options=storage_options).exists():  # Lightning's own message and type
            raise checkpoint_not_found(os.fspath(path))
        return None
    return load_checkpoint(
        path,
        storage_options=storage_options,
        map_location=map_location,
        weights_only=weights_only,
        model_weights=model_weights,
    )


def _load_file(load: Any, path: str) -> Any:
    """Lightning's own weights-only load of a single file, with the codec's kinds allowed and rebuilt by it.

    Raises:
        NotACheckpointError: The load failed and the file is of another format (a safetensors file: its weights load
            with ``lightning_dcp.load_model_weights``).
    """
    return guarded_load(load, path=path, weights_only=True, identify=lambda: foreign_file_at(path))


def _upgrade(args: Any, lightning_upgrade: Any) -> None:
    from lightning_dcp.trainer.upgrade import upgrade_from_lightning_args

    upgrade_from_lightning_args(args, lightning_upgrade)


def _find_last(callback: Any, trainer: Any, original: Any) -> set[str]:
    """``ckpt_path="last"`` candidates of a Lightning ``ModelCheckpoint``.

    Where the Trainer checkpoints through lightning_dcp, :func:`find_last`'s (a ``last*.ckpt`` entry that resolves,
    else the newest committed checkpoint, also when the link is missing or dangles), or Lightning's own when nothing
    in the directory is committed (a single-file ``last.ckpt`` of an earlier run); elsewhere Lightning's.
    """
    strategy = trainer.strategy
    ours = isinstance(strategy, DCPStrategyMixin) or isinstance(
        lightning_run.unwrap_checkpoint_io(strategy.checkpoint_io), DCPCheckpointIO
    )
    return (find_last(callback, trainer) if ours else set()) or original(trainer)


def _check_strategy(strategy: Any) -> None:
    """Warn (once per strategy) when a stock FSDP/ModelParallel strategy holds a ``DCPCheckpointIO`` it never uses."""
    if isinstance(strategy, DCPStrategyMixin) or getattr(strategy, _WARNED, False):
        return
    if not isinstance(lightning_run.unwrap_checkpoint_io(strategy.checkpoint_io), DCPCheckpointIO):
        return
    setattr(strategy, _WARNED, True)
    stock = next((c.__name__ for c in type(strategy).__mro__ if c.__name__ in _DCP_STRATEGY_NAMES), "")
    name = _DCP_STRATEGY_NAMES.get(stock, "dcp_model_parallel")
    rank_zero_warn(
        f"`{type(strategy).__name__}` saves sharded checkpoints and loads every checkpoint itself, without its"
        " CheckpointIO: the `DCPCheckpointIO` you passed is ignored (and a full-state save through it would write a"
        f" directory this strategy cannot load). Use `Trainer(strategy={name!r})` (or"
        f" `lightning_dcp.DCP{stock}(...)` with the same arguments) to checkpoint through lightning_dcp; checkpoints"
        f" this `{stock}` wrote resume under it."
    )
