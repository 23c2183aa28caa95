"""Every private torch / Lightning API that lightning_dcp touches, and every version gate, in one place.

When torch or Lightning move one of these, this is the only module to change. Each block says what it is for and
which versions it was checked against (torch 2.13, Lightning 2.6.6). Lightning's own modules are imported inside the
functions that need them, so the engine (which imports this module) never loads ``lightning.pytorch``.
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

import torch
from lightning_utilities.core.imports import compare_version

# How ``torch.save`` pickles a tensor (``_rebuild_tensor_v2`` over a typed storage named by its legacy storage
# class): the streaming ``.ckpt`` writer emits exactly these references so ``torch.load(weights_only=True)`` reads them.
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor

# ... and dtypes without a legacy storage class (float8, uint16, ...): ``_rebuild_tensor_v3`` over an untyped storage.
from torch._utils import _rebuild_tensor_v3 as rebuild_tensor_v3

# DCP's per-entry storage record and tensor-narrowing helper: our storage writer/reader produce and consume exactly
# what DCP's FileSystemWriter/FileSystemReader do, so checkpoints stay readable by any DCP reader.
from torch.distributed._shard._utils import narrow_tensor_by_index

# FSDP1's sharded state dict holds ShardedTensors: async staging rebuilds them around CPU buffers.
from torch.distributed._shard.sharded_tensor import ShardedTensor

# DCP's fsspec adapter inside FsspecWriter/FsspecReader (``.fs``): ``reset(checkpoint_id)`` calls its ``init_path``
# without the storage options; lightning_dcp.engine.save.dcp_io subclasses it to keep them.
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as DCPFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

# DCP's own nested-dict helpers: the exact flattening DCP applies when it saves, so that the keys we validate and
# the keys DCP writes cannot drift apart.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# The format version FileSystemWriter.finish stamps into ``.metadata``; our writer writes ``.metadata`` itself.
try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as DCP_METADATA_VERSION
except ImportError:  # older DCP stamps none
    DCP_METADATA_VERSION = None

__all__ = [
    "DCP_METADATA_VERSION",
    "optimizer_load_hooked",
    "HOOKS_CHECKED_AGAINST",
    "HOOKS_ENV",
    "HYDRA_PARTIAL_ATTRIBUTES",
    "DCPFsspecFileSystem",
    "FsspecReader",
    "FsspecWriter",
    "MODEL_CHECKPOINT_FIND_LAST",
    "MODEL_CHECKPOINT_LINK",
    "MODEL_CHECKPOINT_RESOLVE_DIR",
    "OMEGACONF_CHECKED_AGAINST",
    "ShardedTensor",
    "StorageInfo",
    "TORCH_GREATER_EQUAL_2_9",
    "check_private_api",
    "dtensor_over",
    "fit_loop_loader_states",
    "flatten_state_dict",
    "hydra_partial_class",
    "hooks_enabled_by_env",
    "install_flag_only_sigterm_handler",
    "install_load_from_checkpoint_hook",
    "install_strategy_setup_hook",
    "install_upgrade_hook",
    "lightning_hooks_installed",
    "lightning_upgrade",
    "narrow_tensor_by_index",
    "on_iterator_created",
    "omegaconf_build",
    "omegaconf_tree",
    "rebuild_tensor",
    "rebuild_tensor_v3",
    "replace_fit_loop_loader_states",
    "restart_train_iterator",
    "restore_modules_and_callbacks",
    "set_element",
    "set_sampler_epoch",
    "sharded_tensor_over",
    "shift_epoch_batches",
    "storage_type_name",
    "tensor_version",
    "foreach_copy",
    "train_loaders",
    "train_epoch_in_progress",
    "trainer_run_arguments",
    "unflatten_state_dict",
    "uninstall_lightning_hooks",
    "unwrap_checkpoint_io",
]

TORCH_GREATER_EQUAL_2_9 = compare_version("torch", lambda a, b: a >= b, "2.9.0")
"""``DefaultStager`` / ``StagingOptions`` and ``async_stager=`` exist from torch 2.9 on."""


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place version counter of ``tensor`` (shared by its views; bumped by every in-place change)."""
    return tensor._version


def foreach_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for every ``i``, in one call (``torch._foreach_copy_``)."""
    torch._foreach_copy_(destinations, sources)


def dtensor_over(dtensor: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``dtensor``'s mesh, placements and global shape whose local tensor is ``local`` as it is.

    ``DTensor.from_local`` moves a local tensor to the mesh's device (a CPU staging buffer would go back to the
    GPU); the constructor keeps it where it is. ``local`` must have the local tensor's shape and dtype.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, dtensor._spec, requires_grad=False)


def sharded_tensor_over(sharded: Any, tensors: list[torch.Tensor]) -> Any:
    """A ShardedTensor with ``sharded``'s global metadata whose local shards are ``tensors`` (CPU, in order).

    The shards' placements say ``cpu`` (DCP reads only offsets and sizes from them); no communication.
    """
    import copy as _copy

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard

    metadata = _copy.deepcopy(sharded.metadata())
    metadata.shards_metadata = [
        ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), f"rank:{m.placement.rank()}/cpu")
        for m in metadata.shards_metadata
    ]
    pinned = bool(tensors) and tensors[0].is_pinned()
    metadata.tensor_properties.pin_memory = pinned
    metadata.tensor_properties.requires_grad = False
    local = []
    for tensor, shard in zip(tensors, sharded.local_shards(), strict=True):
        meta = shard.metadata
        placement = f"rank:{meta.placement.rank()}/cpu"
        local.append(Shard(tensor, ShardMetadata(list(meta.shard_offsets), list(meta.shard_sizes), placement)))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=sharded._process_group
    )


def unwrap_checkpoint_io(checkpoint_io: object) -> object:
    """Return the innermost CheckpointIO of Lightning's wrappers (``AsyncCheckpointIO``)."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO  # Trainer-only: not imported by the engine

    while isinstance(checkpoint_io, _WrappingCheckpointIO) and checkpoint_io.checkpoint_io is not None:
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


_PLAIN_STATE_LOADERS = (
    torch.nn.Module._load_from_state_dict,
    torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
    torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict,
)


def loads_only_own_keys(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` does nothing but copy its own keys (no load hooks, a stock loader).

    Reads ``torch.nn.Module``'s private loader and hook registries (torch 2.x names).
    """
    if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
        return False
    return type(module)._load_from_state_dict in _PLAIN_STATE_LOADERS


def own_state_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]] | None:
    """The ``(key, tensor)`` pairs of ``module.state_dict()`` in its order, the tensors themselves (not detached).

    One walk over the modules' parameter and buffer registries instead of ``state_dict()``, which detaches every
    tensor and calls per-module hooks (~10 ms for 800 modules). ``None`` when some module could make
    ``state_dict()`` or ``load_state_dict()`` give or take anything else: state dict or load hooks, its own
    ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state``, a loader :func:`loads_only_own_keys` refuses.

    Reads ``torch.nn.Module``'s private registries (``_modules``, ``_parameters``, ``_buffers``,
    ``_non_persistent_buffers_set`` and the hook dicts; torch 2.x names).
    """
    out: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    base = torch.nn.Module
    while stack:
        prefix, current = stack.pop()
        kind = type(current)
        if (
            current._state_dict_hooks
            or current._state_dict_pre_hooks
            or kind.state_dict is not base.state_dict
            or kind._save_to_state_dict is not base._save_to_state_dict
            or kind.get_extra_state is not base.get_extra_state
            or not loads_only_own_keys(current)
        ):
            return None
        for name, param in current._parameters.items():
            if param is not None:
                out.append((prefix + name, param))
        skipped = current._non_persistent_buffers_set
        for name, buffer in current._buffers.items():
            if buffer is not None and name not in skipped:
                out.append((prefix + name, buffer))
        children = [(prefix + name + ".", child) for name, child in current._modules.items() if child is not None]
        stack.extend(reversed(children))  # depth first, in registration order, as state_dict() recurses
    return out


def storage_type_name(dtype: torch.dtype) -> str:
    """The legacy storage class name ``torch.save`` records for ``dtype`` (``torch.float32`` -> ``"FloatStorage"``)."""
    return torch.storage._dtype_to_storage_type_map()[dtype]


# ModelCheckpoint's private methods that lightning_dcp.DCPModelCheckpoint overrides or calls, by name. Checked
# against Lightning 2.6.6 (``lightning.pytorch.callbacks.model_checkpoint``); ``check_private_api`` fails at import
# when a Lightning release renames one, instead of silently no longer overriding it.
MODEL_CHECKPOINT_FIND_LAST = "_find_last_checkpoints"
"""``(self, trainer) -> set[str]``: the "last" candidates ``Trainer.fit(ckpt_path="last")`` chooses from."""
MODEL_CHECKPOINT_LINK = "_link_checkpoint"
"""``staticmethod (trainer, filepath, linkpath)``: ``save_last="link"``; Lightning uses ``os.symlink``."""
MODEL_CHECKPOINT_RESOLVE_DIR = "_ModelCheckpoint__resolve_ckpt_dir"
"""``(self, trainer) -> path``: the name-mangled ``__resolve_ckpt_dir`` (dirpath, or the logger's directory)."""


def check_private_api(cls: type, names: tuple[str, ...]) -> None:
    """Raise ``ImportError`` naming the Lightning version when ``cls`` lacks one of the private ``names``."""
    import lightning

    missing = [name for name in names if not hasattr(cls, name)]
    if missing:
        raise ImportError(
            f"lightning_dcp needs {cls.__name__}.{', '.join(missing)}, which Lightning {lightning.__version__} does"
            " not have (checked against 2.6.6). Install a supported Lightning version."
        )


# Lightning 2.6.6 fit-loop internals that lightning_dcp.ElasticResume (callbacks.py) touches. ``FitLoop.setup_data``
# creates the train iterator (``_data_fetcher``) before ``on_train_start``; the epoch loop's ``batch_progress``
# counts the epoch's batches (``current``) and all batches (``total``) per rank.
def restart_train_iterator(trainer: object) -> None:
    """Re-create the train iterator so a sampler replaced in ``on_train_start`` draws the first epoch's indices.

    ``FitLoop.setup_data`` iterated the loader already (with ``num_workers > 0`` the workers prefetch indices then).
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def train_epoch_in_progress(trainer: object) -> bool:
    """Whether the epoch's data iterator exists and is used again by the next training step (a mid-epoch save).

    That is: the fit loop's data fetcher exists and the epoch's last batch has not been reached.

    A resumed fit creates the epoch's iterator once, in ``FitLoop.setup_data`` before ``on_train_start`` (the epoch
    loop does not call ``iter()`` again while resuming); a ``DataLoader`` without its own generator draws a base seed
    from the global torch generator there. So random states saved mid-epoch must be restored after that draw, and
    states saved at an epoch's end before it. Checked against Lightning 2.6.6 (``fit_loop._data_fetcher``,
    ``epoch_loop.batch_progress.is_last_batch``).
    """
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer.state.fn != TrainerFn.FITTING:
        return False
    fit_loop = trainer.fit_loop
    return fit_loop._data_fetcher is not None and not fit_loop.epoch_loop.batch_progress.is_last_batch


def shift_epoch_batches(trainer: object, delta: int) -> None:
    """Add ``delta`` batches to every counter of the epoch loop's ``batch_progress`` (current and total).

    Lightning tells where a run stopped (restart stage) from the differences between these counters, which an equal
    shift keeps; the position in the epoch (``batch_idx``, accumulation windows, the last batch) follows ``current``.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.current, progress.total):
        tracker.ready += delta
        tracker.started += delta
        tracker.processed += delta
        tracker.completed += delta


# Lightning 2.6's SIGTERM handler (``trainer._signal_connector._sigterm_notifier_fn``) runs ``dist.broadcast`` inside
# the signal handler, i.e. at whatever point the main thread was interrupted: paired with any other collective in
# flight (a DDP all-reduce, a checkpoint's collectives) it deadlocks the ranks. Lightning's training loop already
# broadcasts the flag at every batch boundary (``_broadcast_sigterm_tensor``) and then raises ``SIGTERMException``
# on all ranks together, so a handler that only sets the flag (and forwards the signal to launched children, as
# Lightning's does) keeps the behaviour without the deadlock. Checked against Lightning 2.6.6.
def install_flag_only_sigterm_handler(trainer: object) -> bool:
    """Replace the Trainer's SIGTERM handler by one without collectives; False when it cannot be installed."""
    import signal
    import threading

    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or threading.current_thread() is not threading.main_thread():
        return False

    def on_sigterm(signum: int, frame: object) -> None:
        if not connector.received_sigterm:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True

    signal.signal(signal.SIGTERM, on_sigterm)
    return True


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


# Lightning 2.6.6 ``Trainer._run(model, ckpt_path, weights_only)`` restores a checkpoint after the strategy's
# ``setup`` and ``on_fit_start`` when ``strategy.restore_checkpoint_after_setup`` is True, through
# ``trainer._checkpoint_connector._restore_modules_and_callbacks(ckpt_path)``. The DCP strategies restore at the end
# of their own ``setup`` instead (so ``on_fit_start`` sees restored state, as under stock strategies), which needs the
# arguments of the running ``_run``: they are read from its frame.
def trainer_run_arguments(trainer: object) -> tuple[Any, bool | None] | None:
    """``(ckpt_path, weights_only)`` of the ``Trainer._run`` call in progress on ``trainer``; ``None`` if not found."""
    from lightning.pytorch import Trainer

    code = Trainer._run.__code__
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path"), frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


def restore_modules_and_callbacks(trainer: object, ckpt_path: Any, weights_only: bool | None) -> None:
    """Lightning's restore of model, datamodule and callback state (it loads the checkpoint through the strategy)."""
    trainer._checkpoint_connector._restore_modules_and_callbacks(ckpt_path, weights_only)


# Lightning 2.6.6 keeps the ``state_dict()`` of every train loader that has one (torchdata's StatefulDataLoader,
# LitData's StreamingDataLoader) in the fit loop's state, ``checkpoint["loops"]["fit_loop"]["state_dict"]
# ["combined_loader"]``: a list in the order of the stateful loaders of ``CombinedLoader.flattened``
# (``FitLoop.on_save_checkpoint``). ``FitLoop.setup_data`` hands it back (``_load_combined_loader_states``) after
# ``strategy.process_dataloader`` and before it creates the epoch's iterator; the sampler's epoch is set only later
# (``FitLoop.on_advance_start``). Every rank builds the dict, the checkpoint keeps rank 0's.
def fit_loop_loader_states(checkpoint: dict[str, Any]) -> list[Any] | None:
    """The train loaders' states in a Trainer checkpoint dict (``None``: none recorded)."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    return loop.get("combined_loader") if isinstance(loop, dict) else None


def replace_fit_loop_loader_states(checkpoint: dict[str, Any], states: list[Any] | None) -> None:
    """Put ``states`` in place of the recorded loader states (``None``: remove them, the loaders start afresh)."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    if not isinstance(loop, dict):
        return
    loop.pop("combined_loader", None)
    if states:
        loop["combined_loader"] = states


def train_loaders(trainer: object) -> list[Any]:
    """The fit loop's train loaders (``CombinedLoader.flattened``); empty before ``FitLoop.setup_data``."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """Lightning's own ``_set_sampler_epoch``: ``set_epoch`` on the loader's sampler and batch sampler's sampler."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(dataloader, epoch)


# torch 2.13 ``DataLoader.__iter__`` creates an iterator through ``DataLoader._get_iterator`` (StatefulDataLoader
# overrides it); ``_BaseDataLoaderIter.__init__`` draws the iterator's base seed from the global generator there. A
# loader that starts its DataLoader lazily (LitData's ``StreamingDataLoader.__iter__`` is a generator) draws it at
# its first batch, not when Lightning calls ``iter()``.
def on_iterator_created(loader: Any, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback()`` after ``loader`` next creates an iterator (once); returns a function that undoes it."""
    original = loader._get_iterator

    def get_iterator() -> Any:
        iterator = original()
        undo()
        callback()
        return iterator

    def undo() -> None:
        if loader.__dict__.get("_get_iterator") is get_iterator:
            del loader.__dict__["_get_iterator"]

    loader._get_iterator = get_iterator
    return undo


# ------------------------------------------------------------------------------------------ OmegaConf
# The codec (lightning_dcp.engine.format.codec) stores a DictConfig / ListConfig as the node tree of its root plus the
# path to the node (interpolations resolve against the same root after a load, as with pickle). OmegaConf has no public
# API for a node's own flags or its place in the tree: these read ``node._metadata.flags`` (the flags set on that
# node, not inherited), ``_get_parent()``, ``_key()`` and ``_get_node(key)``, and set flags with ``_set_flag``
# (what ``OmegaConf.set_struct`` / ``set_readonly`` call). Checked against omegaconf 2.3.
OMEGACONF_CHECKED_AGAINST = "2.3"
_OMEGACONF_MAX_DEPTH = 1000


def omegaconf_tree(node: Any) -> tuple[tuple[Any, ...], list[Any]]:
    """``(tree, path)``: the tree of ``node``'s root and the keys from the root down to ``node``.

    A tree node is ``(kind, flags, content)``: kind ``"dict"`` (content: ``[[key, child], ...]``), ``"list"``
    (``[child, ...]``) or ``"value"`` (the raw value: interpolations as their ``${...}`` string, ``"???"`` for a
    missing value); a container that is missing, an interpolation or ``None`` has that raw value as its content.
    ``flags`` holds only the flags set on that node (``struct``, ``readonly``, ...).
    """
    from omegaconf import Container

    path: list[Any] = []
    root = node
    while root._get_parent() is not None:
        if len(path) >= _OMEGACONF_MAX_DEPTH:
            raise ValueError("an OmegaConf node nested deeper than 1000 levels (or in a cycle)")
        path.append(root._key())
        root = root._get_parent()
    if not isinstance(root, Container):
        raise ValueError(f"an OmegaConf node whose root is a {type(root).__name__}")
    return _omegaconf_node(root), path[::-1]


def _omegaconf_node(node: Any) -> tuple[Any, ...]:
    from omegaconf import DictConfig, ListConfig

    flags = dict(node._metadata.flags)
    if isinstance(node, (DictConfig, ListConfig)):
        kind = "dict" if isinstance(node, DictConfig) else "list"
        if node._is_missing() or node._is_interpolation() or node._is_none():
            return kind, flags, node._value()
        if kind == "dict":
            return kind, flags, [[key, _omegaconf_node(node._get_node(key))] for key in node.keys()]
        return kind, flags, [_omegaconf_node(node._get_node(i)) for i in range(len(node))]
    return "value", flags, node._value()


def omegaconf_build(tree: tuple[Any, ...], path: list[Any]) -> Any:
    """The node at ``path`` of a config rebuilt from :func:`omegaconf_tree`'s ``tree`` (flags set as recorded).

    Raises:
        ValueError: ``tree`` is not such a tree, or ``path`` does not lead to a container in it.
    """
    from omegaconf import Container, OmegaConf

    kind, flags, content = _omegaconf_check(tree)
    if kind == "value" or not isinstance(content, list):
        raise ValueError("an OmegaConf root must be a dict or list config with content")
    root = OmegaConf.create(_omegaconf_plain(tree), flags={"allow_objects": True})
    if (kind == "dict") != OmegaConf.is_dict(root):
        raise ValueError(f"an OmegaConf {kind} config came back as {type(root).__name__}")
    root._set_flag("allow_objects", None)
    _omegaconf_flags(root, tree)
    node = root
    for key in path:
        node = node._get_node(key) if isinstance(node, Container) else None
        if not isinstance(node, Container):
            raise ValueError(f"an OmegaConf path {path!r} that leads to no container")
    return node


def _omegaconf_check(tree: Any) -> tuple[str, dict[str, bool], Any]:
    if not (type(tree) is tuple and len(tree) == 3 and tree[0] in ("dict", "list", "value")):
        raise ValueError(f"an OmegaConf node is {type(tree).__name__} {str(tree)[:60]!r}, not (kind, flags, content)")
    kind, flags, content = tree
    if type(flags) is not dict or not all(type(k) is str and type(v) is bool for k, v in flags.items()):
        raise ValueError(f"OmegaConf flags are {str(flags)[:60]!r}, not names and booleans")
    if kind == "dict" and type(content) is list:
        if not all(type(item) is list and len(item) == 2 for item in content):
            raise ValueError("OmegaConf dict items are not [key, node] pairs")
    return kind, flags, content


def _omegaconf_plain(tree: Any) -> Any:
    kind, _, content = _omegaconf_check(tree)
    if kind == "value" or type(content) is not list:
        return content
    if kind == "dict":
        return {key: _omegaconf_plain(child) for key, child in content}
    return [_omegaconf_plain(child) for child in content]


def _omegaconf_flags(node: Any, tree: tuple[Any, ...]) -> None:
    kind, flags, content = tree
    if kind != "value" and type(content) is list:
        children = content if kind == "dict" else enumerate(content)
        for key, child in children:
            _omegaconf_flags(node._get_node(key), child)
    for name, value in flags.items():
        node._set_flag(name, value)


# ------------------------------------------------------------------------------------------ Hydra
# Hydra 1.3.8 returns ``_partial_: true`` targets as ``hydra._internal.target_policy._DeferredTarget``, a private
# ``functools.partial`` subclass that authorizes its target again when called; it carries the attributes
# ``_hydra_resolved_from`` (the target's dotted name) and ``_hydra_full_key`` (its key in the config). The codec keeps
# the type, so a loaded optimizer factory is called under Hydra's policy as before. Checked against hydra-core 1.3.8.
HYDRA_PARTIAL_ATTRIBUTES = ("_hydra_resolved_from", "_hydra_full_key")
_HYDRA_PARTIAL = ("hydra._internal.target_policy", "_DeferredTarget")


def hydra_partial_class(*, load: bool = False) -> type | None:
    """Hydra's deferred-target partial class, or ``None`` (Hydra older than 1.3.8, or not imported and not ``load``)."""
    import sys

    module = sys.modules.get(_HYDRA_PARTIAL[0])
    if module is None and load:
        try:
            module = importlib.import_module(_HYDRA_PARTIAL[0])
        except ImportError:
            return None
    cls = getattr(module, _HYDRA_PARTIAL[1], None)
    return cls if isinstance(cls, type) and issubclass(cls, functools.partial) else None


def optimizer_load_hooked(optimizer: Any) -> bool:
    """Whether ``optimizer.load_state_dict`` runs hooks (``register_load_state_dict_pre_hook`` / ``post_hook``).

    torch keeps them in private dicts (``_optimizer_load_state_dict_pre_hooks`` / ``_post_hooks``, torch >= 2.2);
    where those are missing this answers True, so that callers take ``load_state_dict`` itself.
    """
    pre = getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None)
    if not isinstance(pre, dict) or not isinstance(post, dict):
        return True
    return bool(pre) or bool(post)
