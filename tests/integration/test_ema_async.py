"""A BatchNorm model with Lightning's EMAWeightAveraging, saved asynchronously every step: exact resumes.

The default async save copies parameters, AdamW state and the EMA weights in the background while the next step's
forward and backward passes run, and the optimizer step waits for them; BatchNorm's running statistics, which the
next forward pass changes in place, are copied at the call. EMAWeightAveraging's ``current_model_state`` is saved
as DCP entries, not in the rank-0 blob.
"""

from __future__ import annotations

import os
import threading

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.save.step_gate import STEP_GATE
from lightning_dcp.engine.storage.location import Location
from tests._trainer import assert_same, make_trainer, seed


class NormNet(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
        self.pending_at_steps: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_before_optimizer_step(self, optimizer):  # inside the step, after forward and backward
        self.pending_at_steps.append(STEP_GATE.pending())

    def train_dataloader(self):
        g = torch.Generator().manual_seed(3)
        return DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)), batch_size=8)


def _fit(tmp: str, epochs: int, *, ckpt_path: str | None = None) -> tuple[NormNet, EMAWeightAveraging]:
    seed()
    model, ema = NormNet(), EMAWeightAveraging(decay=0.9)
    checkpoint = DCPModelCheckpoint(dirpath=tmp, every_n_epochs=1, save_top_k=-1, save_last=True)
    trainer = make_trainer(
        1,
        strategy="dcp_single_device",
        max_epochs=epochs,
        callbacks=[checkpoint, ema],
        plugins=[DCPCheckpointIO(async_save=True)],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, ema


def test_ema_and_batchnorm_with_deferred_async_saves_resume_exactly(tmp_path):
    reference, reference_ema = _fit(str(tmp_path / "ref"), 3)
    _fit(str(tmp_path / "run"), 2)  # a save at each epoch's end, the next epoch's first step right after it
    epoch1 = str(tmp_path / "run" / "epoch=1-step=16.ckpt")
    keys = read_metadata(Location(epoch1)).state_dict_metadata
    assert any(k.startswith("current_model_state.") for k, m in keys.items() if isinstance(m, TensorStorageMetadata))
    assert "current_model_state.net.1.running_mean" in keys  # BatchNorm statistics, copied at the call
    resumed, resumed_ema = _fit(str(tmp_path / "run"), 3, ckpt_path=epoch1)
    # The step's closure (forward, backward) may overlap the background copies; the step itself never does.
    assert len(resumed.pending_at_steps) == 8 and not any(resumed.pending_at_steps + reference.pending_at_steps)
    assert_same(resumed.state_dict(), reference.state_dict(), "model")  # weights, BatchNorm statistics
    assert_same(resumed_ema._average_model.state_dict(), reference_ema._average_model.state_dict(), "ema")
    assert os.path.isfile(tmp_path / "run" / "last.ckpt" / ".commit")


class _GatedNet(NormNet):
    """Holds the step gate (as an async save's pending copies do) from its batch start; a timer releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []  # (copies pending in training_step, pending in the update)
        self._copied: threading.Event | None = None

    def on_train_batch_start(self, batch, batch_idx):
        self._copied = threading.Event()
        STEP_GATE.hold(self._copied)
        threading.Timer(0.5, self._copied.set).start()

    def training_step(self, batch, batch_idx):
        self._in_closure = not self._copied.is_set()
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.seen.append((self._in_closure, not self._copied.is_set()))
        STEP_GATE.release(self._copied)


def test_the_trainer_runs_forward_and_backward_while_copies_are_pending_and_updates_after_them():
    """``dcp_*`` strategies wait after the step's closure: without that, Lightning's step waits before forward."""
    seed()
    model = _GatedNet()
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=3, enable_checkpointing=False)
    trainer.fit(model)
    assert model.seen == [(True, False)] * 3


class _SnapshotNet(NormNet):
    """Keeps a clone of the model state each checkpoint is saved with, by step."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def on_save_checkpoint(self, checkpoint):
        self.saved[self.trainer.global_step] = {k: v.detach().clone() for k, v in self.state_dict().items()}


def test_the_last_async_save_holds_the_trained_weights_though_ema_copies_its_average_in_at_train_end(tmp_path):
    """``EMAWeightAveraging.on_train_end`` writes the average into the model through ``.data`` (no version counter
    moves) while the last save's background copies may be pending: the strategy waits before that hook."""
    seed()
    model = _SnapshotNet()
    trainer = make_trainer(
        1,
        strategy="dcp_single_device",
        max_steps=4,
        callbacks=[
            DCPModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1, save_top_k=-1),
            EMAWeightAveraging(decay=0.5),
        ],
        plugins=[DCPCheckpointIO(async_save=True)],
    )
    trainer.fit(model)
    for step in (1, 2, 3, 4):
        path = str(tmp_path / f"epoch=0-step={step}.ckpt")
        saved = Checkpointer().load(path).tree["current_model_state"]
        assert_same(saved, model.saved[step], f"step {step}")
