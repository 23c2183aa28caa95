"""``ExportCallback``: a single-file weights export (``.ckpt`` or safetensors) at the end of fit and/or on a new best.

Which ranks do what:

- **New best** (``on_best=True``): only global rank 0 acts. When ``trainer.checkpoint_callback.best_model_path``
  changed since the last export, rank 0 streams that *committed* checkpoint into the export file
  (:func:`lightning_dcp.consolidate`, weights only) -- in a background thread by default, so no rank waits. Other
  ranks do nothing and no collective is involved, so ranks can never disagree. The check runs at the start of the
  hooks that follow a save (train batch start, validation start, train end), i.e. after ModelCheckpoint committed.
- **End of fit** (``on_train_end=True``): from the live model. If its state holds DTensors (FSDP2 / TP), every rank
  joins one gather (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``); otherwise rank 0 reads its
  own full copy. Rank 0 writes the file while the others wait in one broadcast that carries rank 0's outcome, so an
  export error is raised on every rank instead of leaving the others hanging. The pending best export is finished
  first.

Exports are written atomically (temporary name, then rename), so a reader never sees a partial file.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import lightning
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dcp.engine import Location
from lightning_dcp.tools.consolidate import cast_dtype, cast_tensor, consolidate, resolve_dtype, selected
from lightning_dcp.tools.output import atomic_file
from lightning_dcp.tools.writers import CkptWriter, SafetensorsWriter

__all__ = ["ExportCallback"]

log = logging.getLogger(__name__)

_EXTENSIONS = {"ckpt": ".ckpt", "safetensors": ".safetensors"}


class ExportCallback(Callback):
    """Export the model weights to one file at the end of fit and/or whenever the best checkpoint changes.

    Args:
        dirpath: Directory for the exports (local path or fsspec URL). Default: the checkpoint callback's
            ``dirpath``, else ``<default_root_dir>/export``; decided on rank 0 and broadcast in ``setup``.
        filename: File name stem: ``<filename>.<ext>`` at the end of fit, ``<filename>-best.<ext>`` for the best.
        format: ``"safetensors"`` or ``"ckpt"`` (a weights-only Lightning checkpoint that
            ``LightningModule.load_from_checkpoint`` accepts).
        dtype: Cast floating-point weights to ``"bf16"``, ``"fp16"`` or ``"fp32"`` (default: keep).
        on_train_end: Export the final weights when fit ends.
        on_best: Export ``ModelCheckpoint``'s best checkpoint each time it changes (needs a checkpoint callback).
        include: Glob patterns on FQNs of the weights to export (default: all).
        exclude: Glob patterns on FQNs to leave out.
        storage_options: fsspec options for reading checkpoints and writing exports.
        background: Export the best checkpoint in a background thread on rank 0 (``False``: in the hook).

    Attributes:
        exported: Paths written so far (rank 0; empty on other ranks).

    Raises:
        ValueError: An unknown ``format`` or ``dtype``, or nothing to export.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        *,
        filename: str = "model",
        format: str = "safetensors",
        dtype: str | torch.dtype | None = None,
        on_train_end: bool = True,
        on_best: bool = False,
        include: Sequence[str] = (),
        exclude: Sequence[str] = (),
        storage_options: dict[str, Any] | None = None,
        background: bool = True,
    ) -> None:
        if format not in _EXTENSIONS:
            raise ValueError(f"`format` must be one of {sorted(_EXTENSIONS)}, got {format!r}.")
        if not (on_train_end or on_best):
            raise ValueError("Nothing to export: set `on_train_end=True` and/or `on_best=True`.")
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self.format = format
        self.dtype = resolve_dtype(dtype)
        self.export_on_train_end = on_train_end
        self.export_on_best = on_best
        self.include, self.exclude = tuple(include), tuple(exclude)
        self.storage_options = dict(storage_options or {})
        self.background = background
        self.exported: list[str] = []
        self._best_seen = ""
        self._thread: threading.Thread | None = None

    def _path(self, suffix: str) -> str:
        return f"{self.dirpath.rstrip('/')}/{self.filename}{suffix}{_EXTENSIONS[self.format]}"

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Decide the export directory on rank 0. Collective: call on all ranks (Lightning does)."""
        if self.dirpath is None and trainer.is_global_zero:
            ckpt = trainer.checkpoint_callback
            dirpath = getattr(ckpt, "dirpath", None)
            self.dirpath = os.fspath(dirpath) if dirpath else os.path.join(trainer.default_root_dir, "export")
        self.dirpath = trainer.strategy.broadcast(self.dirpath, src=0)

    # ------------------------------------------------------------------------------------------------ best
    @override
    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        self._maybe_export_best(trainer)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._maybe_export_best(trainer)

    def _maybe_export_best(self, trainer: Trainer, *, wait: bool = False) -> None:
        """Rank 0 only: start exporting the best checkpoint if it changed; no collective."""
        if not (self.export_on_best and trainer.is_global_zero):
            return
        best = getattr(trainer.checkpoint_callback, "best_model_path", "") or ""
        if not best or best == self._best_seen:
            return
        if self._thread is not None and self._thread.is_alive():
            if not wait:
                return  # still busy with the previous best; this one is picked up at a later hook
            self._thread.join()
        self._best_seen = best
        if self.background and not wait:
            self._thread = threading.Thread(target=self._export_best, args=(best,), name="lightning_dcp-export")
            self._thread.daemon = True
            self._thread.start()
        else:
            self._export_best(best)

    def _export_best(self, checkpoint: str) -> None:
        dst = self._path("-best")
        try:
            if Location(checkpoint, storage_options=self.storage_options).isdir():
                consolidate(
                    checkpoint,
                    dst=dst,
                    storage_options=self.storage_options,
                    overwrite=True,
                    format=self.format,
                    weights_only=True,
                    dtype=self.dtype,
                    include=self.include,
                    exclude=self.exclude,
                    progress=False,
                )
            else:  # a single-file checkpoint (a stock Lightning strategy): map it instead of loading it
                checkpoint_dict = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
                self._write(checkpoint_dict["state_dict"], dst, extra=_light_extra(checkpoint_dict))
        except Exception as err:  # e.g. ModelCheckpoint removed the checkpoint meanwhile; the next best retries
            log.warning("lightning_dcp: exporting the best checkpoint %s to %s failed: %s", checkpoint, dst, err)
            return
        self.exported.append(dst)

    # ----------------------------------------------------------------------------------------------- end
    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Finish the best export, then export the final weights. Collective: call on all ranks (Lightning does)."""
        self._maybe_export_best(trainer, wait=True)
        self._join()
        if not self.export_on_train_end:
            return
        state = pl_module.state_dict()
        if any(isinstance(t, DTensor) for t in state.values()):  # same answer on every rank: same model
            state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        error = None
        if trainer.is_global_zero:
            extra = {
                "epoch": trainer.current_epoch,
                "global_step": trainer.global_step,
                "pytorch-lightning_version": lightning.__version__,
            }
            if pl_module.hparams:
                extra["hyper_parameters"] = dict(pl_module.hparams)
            try:
                dst = self._path("")
                self._write(state, dst, extra=extra)
                self.exported.append(dst)
            except Exception as err:  # sent to every rank below
                error = f"{type(err).__name__}: {err}"
        error = trainer.strategy.broadcast(error, src=0)
        if error is not None:
            raise RuntimeError(f"lightning_dcp: exporting the final weights failed on rank 0: {error}")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._join()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, state: dict[str, Any], dst: str, *, extra: dict[str, Any]) -> None:
        """Rank 0 only: write ``state`` (full CPU tensors) as one weights-only file at ``dst``, atomically."""
        keep = self.include, self.exclude
        state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and selected(k, *keep)}
        out = Location(dst, storage_options=self.storage_options)
        with atomic_file(out) as f:
            if self.format == "safetensors":
                planned = [(k, cast_dtype(v.dtype, self.dtype), tuple(v.shape)) for k, v in state.items()]
                writer = SafetensorsWriter(f, planned, {"format": "pt", "global_step": str(extra.get("global_step"))})
                for name, tensor in state.items():
                    writer.write(name, cast_tensor(tensor.detach().cpu(), self.dtype))
                writer.finish()
            else:
                writer = CkptWriter(f)
                try:  # each tensor is cast and written on its own, then the small pickle refers to them
                    refs = {}
                    for name, tensor in state.items():
                        refs[name] = writer.reserve(cast_dtype(tensor.dtype, self.dtype), tuple(tensor.shape))
                        writer.write_tensor(refs[name], cast_tensor(tensor.detach().cpu(), self.dtype))
                    writer.finish({**extra, "state_dict": refs})
                except BaseException:
                    writer.abandon()
                    raise


def _light_extra(checkpoint: dict[str, Any]) -> dict[str, Any]:
    keys = ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters")
    return {k: checkpoint[k] for k in keys if k in checkpoint}
