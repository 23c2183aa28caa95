"""Every private torch / Lightning API that lightning_dcp touches, and every version gate, in one place.

When torch or Lightning move one of these, this is the only module to change. Each block says what it is for and
which versions it was checked against (torch 2.13, Lightning 2.6.6). Lightning's own modules are imported inside the
functions that need them, so the engine (which imports this module) never loads ``lightning.pytorch``.
"""

from __future__ import annotations

import torch
from lightning_utilities.core.imports import compare_version

# How ``torch.save`` pickles a tensor (``_rebuild_tensor_v2`` over a typed storage named by its legacy storage
# class): the streaming ``.ckpt`` writer emits exactly these references so ``torch.load(weights_only=True)`` reads them.
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor

# DCP's per-entry storage record and tensor-narrowing helper: our storage writer/reader produce and consume exactly
# what DCP's FileSystemWriter/FileSystemReader do, so checkpoints stay readable by any DCP reader.
from torch.distributed._shard._utils import narrow_tensor_by_index

# DCP's fsspec adapter inside FsspecWriter/FsspecReader (``.fs``): ``reset(checkpoint_id)`` calls its ``init_path``
# without the storage options; lightning_dcp.engine.dcp_io subclasses it to keep them.
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as DCPFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

# DCP's own nested-dict helpers: the exact flattening DCP applies when it saves, so that the keys we validate and
# the keys DCP writes cannot drift apart.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

__all__ = [
    "DCPFsspecFileSystem",
    "FsspecReader",
    "FsspecWriter",
    "MODEL_CHECKPOINT_FIND_LAST",
    "MODEL_CHECKPOINT_LINK",
    "MODEL_CHECKPOINT_RESOLVE_DIR",
    "StorageInfo",
    "TORCH_GREATER_EQUAL_2_9",
    "check_private_api",
    "flatten_state_dict",
    "install_flag_only_sigterm_handler",
    "narrow_tensor_by_index",
    "rebuild_tensor",
    "restart_train_iterator",
    "set_element",
    "shift_epoch_batches",
    "storage_type_name",
    "train_epoch_in_progress",
    "unflatten_state_dict",
    "unwrap_checkpoint_io",
]

TORCH_GREATER_EQUAL_2_9 = compare_version("torch", lambda a, b: a >= b, "2.9.0")
"""``DefaultStager`` / ``StagingOptions`` and ``async_stager=`` exist from torch 2.9 on."""


def unwrap_checkpoint_io(checkpoint_io: object) -> object:
    """Return the innermost CheckpointIO of Lightning's wrappers (``AsyncCheckpointIO``)."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO  # Trainer-only: not imported by the engine

    while isinstance(checkpoint_io, _WrappingCheckpointIO) and checkpoint_io.checkpoint_io is not None:
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


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
