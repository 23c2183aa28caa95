"""Lightning names and run internals (fit loop, ModelCheckpoint, SIGTERM handler, data loaders) the front ends use.

Checked against Lightning 2.6.6. Lightning's modules are imported inside the functions that need them; only the
front ends (trainer/, fabric/) import this module (an import-linter contract).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "DeviceFromConnector",
    "MODEL_CHECKPOINT_FIND_LAST",
    "MODEL_CHECKPOINT_LINK",
    "MODEL_CHECKPOINT_RESOLVE_DIR",
    "check_private_api",
    "fit_loop_loader_states",
    "install_flag_only_sigterm_handler",
    "restore_signal_handlers",
    "on_iterator_created",
    "replace_fit_loop_loader_states",
    "restart_train_iterator",
    "restore_modules_and_callbacks",
    "set_sampler_epoch",
    "shift_epoch_batches",
    "train_epoch_in_progress",
    "train_loaders",
    "trainer_run_arguments",
    "unwrap_checkpoint_io",
]


def unwrap_checkpoint_io(checkpoint_io: object) -> object:
    """Return the innermost CheckpointIO of Lightning's wrappers (``AsyncCheckpointIO``)."""
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO  # Trainer-only: not imported by the engine

    while isinstance(checkpoint_io, _WrappingCheckpointIO) and checkpoint_io.checkpoint_io is not None:
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


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


# Lightning 2.6.6 gives the signals back to the handlers they had before ``fit`` in ``Trainer._teardown``
# (``trainer._signal_connector.teardown()``, idempotent), after ``strategy.teardown``, which may wait for a save's
# background thread. A failed run gives them back before that, so that a SIGTERM during that wait ends the process
# as it would have without the run (Python's default: at once). Checked against Lightning 2.6.6.
def restore_signal_handlers(trainer: object) -> bool:
    """Give every signal the handler it had before the Trainer's run; False when the Trainer has no such record."""
    import threading

    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or threading.current_thread() is not threading.main_thread():
        return False
    connector.teardown()
    return True


# Lightning 2.6.6 ``Trainer._run(model, ckpt_path, weights_only)`` restores a checkpoint after the strategy's
# ``setup`` and ``on_fit_start`` when ``strategy.restore_checkpoint_after_setup`` is True, through
# ``trainer._checkpoint_connector._restore_modules_and_callbacks(ckpt_path)``. The DCP strategies restore at the end
# of their own ``setup`` instead (so ``on_fit_start`` sees restored state, as under stock strategies), which needs the
# arguments of the running ``_run``: ``lightning_hooks.install_run_hook`` keeps them on the trainer.
def trainer_run_arguments(trainer: object) -> tuple[Any, bool | None] | None:
    """``(ckpt_path, weights_only)`` of the ``Trainer._run`` call in progress on ``trainer``; ``None`` if unknown."""
    from lightning_dcp._compat.lightning_hooks import RUN_ARGUMENTS

    return getattr(trainer, "__dict__", {}).get(RUN_ARGUMENTS)


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


class DeviceFromConnector:
    """Mixin of a single-device strategy: ``device=None`` takes the device Lightning's connector picks.

    The accelerator connector fills an empty ``parallel_devices`` with the devices of ``accelerator`` and
    ``devices`` (``devices=[k]`` on a GPU gives ``cuda:k``; CPU stays ``cpu``), as it does for ``strategy="auto"``;
    a device given at construction is kept. Put it before the strategy class in the bases (its ``__init__`` takes
    ``device`` and passes the rest on).
    """

    def __init__(self, device: Any = None, **kwargs: Any) -> None:
        self._device_given = device is not None
        super().__init__(device="cpu" if device is None else device, **kwargs)  # type: ignore[call-arg]

    @property
    def parallel_devices(self) -> list[Any]:
        """The device given at construction (none yet when the connector is to choose it)."""
        return [self.root_device] if self._device_given else []  # type: ignore[attr-defined]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[Any]) -> None:
        if devices and not self._device_given:
            import torch

            self._root_device = torch.device(devices[0])
