"""The Lightning entry points lightning_dcp routes (``load_from_checkpoint``, checkpoint upgrades, strategy setup).

:mod:`lightning_dcp.trainer.hooks` installs them; only the front ends import this module (an import-linter contract).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import os
import warnings
from collections.abc import Callable
from typing import Any

__all__ = [
    "HOOKS_CHECKED_AGAINST",
    "HOOKS_ENV",
    "hooks_enabled_by_env",
    "install_find_last_hook",
    "install_run_hook",
    "install_load_from_checkpoint_hook",
    "install_strategy_setup_hook",
    "install_upgrade_hook",
    "lightning_hooks_installed",
    "lightning_upgrade",
    "uninstall_lightning_hooks",
]

# ------------------------------------------------------------------------------------------ Lightning hooks
# lightning_dcp routes a few of Lightning's own entry points so that users' habits work with checkpoint directories
# (lightning_dcp.trainer.hooks installs them when lightning_dcp is imported). Each target below was checked against
# Lightning 2.6.6: a target whose signature differs is left alone (with one warning), never half-patched.
#
# - ``LightningModule.load_from_checkpoint`` and ``LightningDataModule.load_from_checkpoint`` call
#   ``lightning.pytorch.core.saving._load_from_checkpoint`` (imported by name into ``core.module`` and
#   ``core.datamodule``), which reads the checkpoint with ``saving.pl_load`` (``lightning.fabric.utilities.cloud_io.
#   _load``: ``torch.load`` of one file) and accepts no ``storage_options``.
# - ``python -m lightning.pytorch.utilities.upgrade_checkpoint`` runs ``upgrade_checkpoint._upgrade(args)`` (a
#   Namespace with ``path``, ``extension``, ``map_to_cpu``), which only knows files.
# - ``FSDPStrategy`` / ``ModelParallelStrategy`` never call their CheckpointIO: ``setup`` is where a given
#   ``DCPCheckpointIO`` can be noticed.
# - ``Trainer.fit(ckpt_path="last")`` asks each ``ModelCheckpoint`` for its candidates
#   (``ModelCheckpoint._find_last_checkpoints(self, trainer)``: the ``last*.ckpt`` names in its directory) and loads
#   nothing when there are none, also beside committed checkpoints (a kill between the removal of ``last.ckpt`` and
#   its re-creation in ``_link_checkpoint`` leaves exactly that).
HOOKS_ENV = "LIGHTNING_DCP_LIGHTNING_HOOKS"
"""Set to ``0`` (or ``false``/``no``/``off``) before importing lightning_dcp to leave Lightning's functions alone."""


HOOKS_CHECKED_AGAINST = "2.6.6"


_LOAD_FROM_CHECKPOINT = (
    ("lightning.pytorch.core.saving", "_load_from_checkpoint"),
    ("lightning.pytorch.core.module", "_load_from_checkpoint"),
    ("lightning.pytorch.core.datamodule", "_load_from_checkpoint"),
)


_LOAD_FROM_CHECKPOINT_PARAMS = ("cls", "checkpoint_path", "map_location", "hparams_file", "strict", "weights_only")


_PL_LOAD = ("lightning.pytorch.core.saving", "pl_load")


_PL_LOAD_PARAMS = ("path_or_url", "map_location", "weights_only")


_UPGRADE = ("lightning.pytorch.utilities.upgrade_checkpoint", "_upgrade")


_STRATEGY_SETUP = (
    ("lightning.pytorch.strategies", "FSDPStrategy"),
    ("lightning.pytorch.strategies", "ModelParallelStrategy"),
)


_FIND_LAST = ("lightning.pytorch.callbacks.model_checkpoint", "ModelCheckpoint", "_find_last_checkpoints")


_RUN = ("lightning.pytorch.trainer.trainer", "Trainer", "_run")
_RUN_PARAMS = ("self", "model", "ckpt_path", "weights_only")
RUN_ARGUMENTS = "_lightning_dcp_run_arguments"
"""The attribute a ``Trainer`` holds during its ``_run``: ``(ckpt_path, weights_only)`` as ``_run`` received them."""


_installed: dict[tuple[Any, str], Any] = {}
"""``(owner, attribute) -> original`` of every hook in place."""


_load_request: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "lightning_dcp_load", default=None
)


def hooks_enabled_by_env() -> bool:
    """Whether :data:`HOOKS_ENV` allows lightning_dcp to install its Lightning hooks (default: yes)."""
    return os.environ.get(HOOKS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _signature_is(fn: Any, names: tuple[str, ...]) -> bool:
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return params[: len(names)] == names


def _unchecked(target: str) -> None:
    import lightning

    warnings.warn(
        f"lightning_dcp: {target} of Lightning {lightning.__version__} differs from the one lightning_dcp was checked"
        f" against ({HOOKS_CHECKED_AGAINST}); it is left alone. Load checkpoint directories with"
        " `lightning_dcp.load_checkpoint(path)`, or consolidate them into one file first.",
        stacklevel=3,
    )


def _replace(owner: Any, name: str, new: Any) -> None:
    _installed.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, new)


def install_load_from_checkpoint_hook(
    read_directory: Callable[..., dict[str, Any] | None], load_file: Callable[..., Any] | None = None
) -> bool:
    """Route ``LightningModule/LightningDataModule.load_from_checkpoint`` through ``read_directory`` first.

    ``read_directory(path, *, map_location, weights_only, storage_options, model_weights)`` returns the checkpoint
    dict for a checkpoint directory, or ``None`` for anything else, which Lightning then loads, through
    ``load_file(load, path)`` when given and the load is ``weights_only`` (``load()`` is Lightning's own).
    ``load_from_checkpoint(..., storage_options={...})`` is taken as fsspec options (for directories and files) unless
    the class's ``__init__`` has a parameter of that name (then it stays a hyperparameter, as in Lightning).
    Returns whether the hook is in place.
    """
    targets = [(importlib.import_module(m), a) for m, a in _LOAD_FROM_CHECKPOINT]
    saving = importlib.import_module(_PL_LOAD[0])
    originals = [_original(owner, name) for owner, name in targets]
    pl_load = _original(saving, _PL_LOAD[1])
    checked = all(_signature_is(fn, _LOAD_FROM_CHECKPOINT_PARAMS) for fn in originals)
    if not checked or not _signature_is(pl_load, _PL_LOAD_PARAMS):
        _unchecked("`lightning.pytorch.core.saving._load_from_checkpoint` / `pl_load`")
        return False
    for (owner, name), original in zip(targets, originals, strict=True):
        _replace(owner, name, _request_scope(original))
    _replace(saving, _PL_LOAD[1], _directory_aware_load(pl_load, read_directory, load_file))
    return True


def _original(owner: Any, name: str) -> Any:
    """``owner.name`` as Lightning defines it (the original while a hook is installed)."""
    return _installed.get((owner, name), getattr(owner, name, None))


def _request_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_from_checkpoint(cls: type, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        from lightning.pytorch import LightningModule

        options = None
        if "storage_options" in kwargs and "storage_options" not in inspect.signature(cls.__init__).parameters:
            options = kwargs.pop("storage_options")
        request = {"storage_options": options, "model_weights": issubclass(cls, LightningModule)}
        token = _load_request.set(request)
        try:
            return original(cls, checkpoint_path, *args, **kwargs)
        finally:
            _load_request.reset(token)

    return load_from_checkpoint


def _directory_aware_load(
    original: Callable[..., Any], read_directory: Callable[..., Any], load_file: Callable[..., Any] | None
) -> Callable[..., Any]:
    def weights_only_load(path: Any, weights_only: bool | None, load: Callable[[], Any]) -> Any:
        # Lightning 2.6.6 ``cloud_io._load``: ``weights_only=None`` is torch's default (True) for paths, False for
        # http(s) URLs (``torch.hub``); only weights-only loads go through ``load_file``
        remote = str(path).startswith("http")
        forced_off = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true")
        if load_file is None or weights_only is False or (weights_only is None and (remote or forced_off)):
            return load()  # torch.load's default is not weights-only for this call: Lightning's load as it is
        return load_file(load, str(path))

    @functools.wraps(original)
    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        request = _load_request.get() or {}
        options = request.get("storage_options")
        if isinstance(path_or_url, (str, os.PathLike)):
            loaded = read_directory(
                path_or_url,
                map_location=map_location,
                weights_only=weights_only,
                storage_options=options,
                model_weights=request.get("model_weights", True),
            )
            if loaded is not None:
                return loaded
            if options:  # a file on storage that needs options Lightning's loader cannot pass
                import fsspec

                with fsspec.open(os.fspath(path_or_url), "rb", **options) as f:
                    load = functools.partial(original, f, map_location=map_location, weights_only=weights_only)
                    return weights_only_load(path_or_url, weights_only, load)
        load = functools.partial(original, path_or_url, map_location=map_location, weights_only=weights_only)
        return weights_only_load(path_or_url, weights_only, load)

    return pl_load


def install_upgrade_hook(upgrade: Callable[[Any, Callable[[Any], None]], None]) -> bool:
    """Route Lightning's checkpoint upgrade (``upgrade_checkpoint._upgrade(args)``) through ``upgrade``.

    ``upgrade(args, lightning_upgrade)`` receives Lightning's arguments and Lightning's own function, to which it
    hands the files. Returns whether the hook is in place.
    """
    module = importlib.import_module(_UPGRADE[0])
    original = _original(module, _UPGRADE[1])
    if not _signature_is(original, ("args",)):
        _unchecked("`lightning.pytorch.utilities.upgrade_checkpoint._upgrade`")
        return False

    @functools.wraps(original)
    def _upgrade(args: Any) -> None:
        upgrade(args, original)

    _replace(module, _UPGRADE[1], _upgrade)
    return True


def lightning_upgrade() -> Callable[[Any], None]:
    """Lightning's own ``upgrade_checkpoint._upgrade`` (the original, also while the hook is installed)."""
    return _original(importlib.import_module(_UPGRADE[0]), _UPGRADE[1])


def install_strategy_setup_hook(check: Callable[[Any], None]) -> bool:
    """Call ``check(strategy)`` at the start of ``FSDPStrategy.setup`` and ``ModelParallelStrategy.setup``.

    Subclasses inherit the hook (lightning_dcp's own strategies included: ``check`` tells them apart).
    Returns whether the hook is in place.
    """
    classes = [getattr(importlib.import_module(m), name) for m, name in _STRATEGY_SETUP]
    originals = [_original(cls, "setup") for cls in classes]
    if not all(_signature_is(fn, ("self", "trainer")) for fn in originals):
        _unchecked("`FSDPStrategy.setup` / `ModelParallelStrategy.setup`")
        return False
    for cls, original in zip(classes, originals, strict=True):
        _replace(cls, "setup", _checked_setup(original, check))
    return True


def _checked_setup(original: Callable[..., Any], check: Callable[[Any], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setup(self: Any, trainer: Any) -> None:
        check(self)
        original(self, trainer)

    return setup


def install_find_last_hook(find_last: Callable[[Any, Any, Callable[[Any], set[str]]], set[str]]) -> bool:
    """Route ``ModelCheckpoint._find_last_checkpoints`` (what ``ckpt_path="last"`` chooses from) through ``find_last``.

    ``find_last(callback, trainer, original)`` returns the candidates; ``original(trainer)`` is Lightning's own answer
    for that callback. Subclasses that define their own method (``DCPModelCheckpoint``) are not affected. Returns
    whether the hook is in place.
    """
    cls = getattr(importlib.import_module(_FIND_LAST[0]), _FIND_LAST[1])
    original = _original(cls, _FIND_LAST[2])
    if not _signature_is(original, ("self", "trainer")):
        _unchecked("`ModelCheckpoint._find_last_checkpoints`")
        return False

    @functools.wraps(original)
    def _find_last_checkpoints(self: Any, trainer: Any) -> set[str]:
        return find_last(self, trainer, functools.partial(original, self))

    _replace(cls, _FIND_LAST[2], _find_last_checkpoints)
    return True


def install_run_hook() -> bool:
    """Keep ``Trainer._run``'s ``(ckpt_path, weights_only)`` on the trainer (:data:`RUN_ARGUMENTS`) while it runs.

    Lightning resolves ``ckpt_path`` (``"last"``, ``"best"``, a path) in ``fit``/``validate``/``test``/``predict``
    and hands it to ``_run``, which keeps it in a local variable until its late restore; the ``dcp_*`` strategies
    restore at the end of their ``setup`` instead, and read it here. Idempotent; not undone by
    :func:`uninstall_lightning_hooks` (the strategies depend on it). Returns whether the hook is in place.
    """
    cls = getattr(importlib.import_module(_RUN[0]), _RUN[1])
    current = getattr(cls, _RUN[2])
    if getattr(current, "_lightning_dcp_run_hook", False):
        return True
    if not _signature_is(current, _RUN_PARAMS):
        _unchecked("`Trainer._run`")
        return False

    @functools.wraps(current)
    def _run(self: Any, model: Any, ckpt_path: Any = None, weights_only: Any = None) -> Any:
        previous = self.__dict__.get(RUN_ARGUMENTS)
        setattr(self, RUN_ARGUMENTS, (ckpt_path, weights_only))
        try:
            return current(self, model, ckpt_path=ckpt_path, weights_only=weights_only)
        finally:
            setattr(self, RUN_ARGUMENTS, previous)

    _run._lightning_dcp_run_hook = True  # type: ignore[attr-defined]
    setattr(cls, _RUN[2], _run)
    return True


def uninstall_lightning_hooks() -> None:
    """Put back every Lightning function lightning_dcp replaced (idempotent)."""
    while _installed:
        (owner, name), original = _installed.popitem()
        setattr(owner, name, original)


def lightning_hooks_installed() -> list[str]:
    """The dotted names of the Lightning functions currently replaced by a lightning_dcp hook."""
    names = []
    for owner, name in _installed:
        prefix = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
        names.append(f"{prefix}.{name}")
    return sorted(names)
