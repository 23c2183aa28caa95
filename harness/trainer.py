"""The CPU ``Trainer`` the tests and the benchmarks train with: nothing but the fit (no logger, progress bar, model
summary or sanity check), ``max_epochs`` 2 and no checkpointing unless given. The ``dcp_*`` strategy names are
registered by ``import lightning_dcp``, which the caller does."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


def make_trainer(world_size: int, *, strategy: Any = "dcp_ddp", accelerator: str = "cpu", **kwargs: Any) -> Trainer:
    kwargs.setdefault("max_epochs", 2)
    if not any(isinstance(cb, ModelCheckpoint) for cb in kwargs.get("callbacks", [])):
        kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        accelerator=accelerator,
        devices=world_size,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )
