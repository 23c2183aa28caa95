"""Running the zoo: each setup trained, saved at an epoch's end, resumed in new objects, stock Lightning and ours.

For one world size, every setup runs four fits on every rank, in one process group:

1. stock Lightning (``SingleDeviceStrategy`` / ``DDPStrategy``, ``torch.save`` files) trains ``epochs + more``
   epochs, ``ModelCheckpoint`` saving at every epoch's end;
2. stock Lightning resumes a new model, optimizer and Trainer from its checkpoint after ``epochs`` epochs;
3. and 4. the same through lightning_dcp (``dcp_single_device`` / ``dcp_ddp``, DCP directories).

Recorded per rank: what each resume restored (at ``on_train_start``: model state and every buffer, which parameters
require grad, the optimizers' ``state_dict()``, lr schedulers, callbacks, loops, step, epoch, datamodule, the
checkpoint dict ``on_load_checkpoint`` saw) and where each run ended. ``reshard`` resumes the 2-rank checkpoints of
both at one rank. The test compares ours with stock's restore, and our resumed run's end with our uninterrupted one.
"""

from __future__ import annotations

import copy
import os
import traceback
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

import lightning_dcp  # noqa: F401  (registers the dcp_* strategy names)
from tests.setups import zoo
from tests.setups._base import SETUPS, Setup

__all__ = ["capture", "run_zoo"]

SEED, RESUME_SEED = 7, 99


class Probe(Callback):
    """Records the restored state at ``on_train_start``, the final state at ``on_train_end``, the loaded dict."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.restored: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None
        self.loaded: dict[str, Any] | None = None

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        skip = ("state_dict", "optimizer_states", "lightning_dcp", "callbacks")
        self.loaded = _plain(copy.deepcopy({k: v for k, v in checkpoint.items() if k not in skip}))

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.restored = capture(trainer, self.setup)

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        self.final = capture(trainer, self.setup)


def capture(trainer: Trainer, setup: Setup) -> dict[str, Any]:
    """Everything a resume restores, as CPU values (each DTensor as this rank's shard)."""
    model = trainer.lightning_module
    callbacks = {}
    for callback in trainer.callbacks:  # the user's and Lightning's (not lightning_dcp's own) by kind, in order
        if not isinstance(callback, Probe) and type(callback).__module__.startswith(("lightning.", "tests.")):
            key = f"{type(callback).__name__}#{sum(k.startswith(type(callback).__name__) for k in callbacks)}"
            callbacks[key] = _plain(copy.deepcopy(callback.state_dict()))
    datamodule = trainer.datamodule
    return {
        "model": _plain(model.state_dict()),
        "buffers": _plain(dict(model.named_buffers())),
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "optimizers": [_plain(opt.state_dict()) for opt in trainer.optimizers],
        "schedulers": [_plain(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
        "callbacks": callbacks,
        "loops": _plain(trainer.fit_loop.state_dict()),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "datamodule": None if datamodule is None else _plain(datamodule.state_dict()),
        "extra": _plain(setup.extra(model)),
    }


def _plain(value: Any) -> Any:
    """A deep CPU copy (DTensors as their local shard; callables and other objects by type name)."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return value
    return f"<{type(value).__name__}>"


def _trainer(setup: Setup, world_size: int, strategy: str, dirpath: str, probe: Probe, resumed: bool) -> Trainer:
    checkpoint = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    args = {
        "accelerator": "cpu",
        "devices": world_size,
        "strategy": strategy,
        "max_epochs": setup.epochs + setup.more,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": [checkpoint, *setup.callbacks(resumed), probe],
        **setup.trainer_args(),
    }
    return Trainer(**args)


def _strategies(setup: Setup, world_size: int) -> tuple[str, str]:
    if world_size == 1:
        return "auto", "dcp_single_device"
    unused = "_find_unused_parameters_true" if setup.find_unused else ""
    return f"ddp{unused}", f"dcp_ddp{unused}"


def _fit(setup: Setup, world_size: int, strategy: str, dirpath: str, *, ckpt_path: str | None) -> Probe:
    resumed = ckpt_path is not None
    seed_everything(RESUME_SEED if resumed else SEED, verbose=False)  # a resume's state comes from the checkpoint
    probe = Probe(setup)
    model, data = setup.model(resumed), setup.data()
    seed_everything(SEED, verbose=False)  # the run's seed, as a user's script sets it (DDP's sampler seed is it)
    trainer = _trainer(setup, world_size, strategy, dirpath + ("-resumed" if resumed else ""), probe, resumed)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return probe


def run_zoo(rank: int, world_size: int, root: str, names: dict[str, list[str]]) -> None:
    """Run the named setups of each mode (see the module docstring); record the results of this rank under ``root``.

    ``names``: per mode, the setups: ``"train"`` (train, save and resume at ``world_size``) or ``"reshard"`` (resume
    at ``world_size`` the checkpoints a 2-rank ``"train"`` wrote). Every mode runs in this one process group.
    """
    assert zoo.__name__  # the setups are registered by importing the zoo
    for mode, chosen in names.items():
        results = {name: _run_setup(SETUPS[name](), world_size, root, mode) for name in chosen}
        torch.save(results, os.path.join(root, f"{mode}-ws{world_size}-rank{rank}.pt"))


def _run_setup(setup: Setup, world_size: int, root: str, mode: str) -> dict[str, Any]:
    saved_at = 2 if mode == "reshard" else world_size
    run = os.path.join(root, setup.name, f"ws{saved_at}")
    stock, ours = _strategies(setup, world_size)
    last = setup.resume_from or f"epoch={setup.epochs - 1}.ckpt"
    out: dict[str, Any] = {}
    try:
        if mode == "train":
            out["stock_full"] = _fit(setup, world_size, stock, f"{run}/stock", ckpt_path=None).final
        probe = _fit(setup, world_size, stock, f"{run}/stock", ckpt_path=f"{run}/stock/{last}")
        out["stock"], out["stock_loaded"], out["stock_final"] = probe.restored, probe.loaded, probe.final
        if mode == "train":
            out["ours_full"] = _fit(setup, world_size, ours, f"{run}/ours", ckpt_path=None).final
        probe = _fit(setup, world_size, ours, f"{run}/ours", ckpt_path=f"{run}/ours/{last}")
        out["ours"], out["ours_loaded"], out["ours_final"] = probe.restored, probe.loaded, probe.final
        out = _replace(out, run)
    except BaseException:  # noqa: BLE001 - recorded and reported by the test, per setup
        out["error"] = traceback.format_exc()
    return out


def _replace(value: Any, run: str) -> Any:
    """``value`` with the run directories in its strings replaced by one placeholder (stock's and ours differ)."""
    if isinstance(value, str):
        for kind in ("stock", "ours"):
            value = value.replace(f"{run}/{kind}", "<RUN>")
        return value
    if isinstance(value, dict):
        return {_replace(k, run): _replace(v, run) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace(v, run) for v in value)
    return value


def load_results(root: str, mode: str, world_size: int, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(root, f"{mode}-ws{world_size}-rank{rank}.pt"), weights_only=False)
