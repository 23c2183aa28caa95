"""A fine-tuning run for the incremental tests: a large frozen embedding and backbone, a small trainable head.

Run as ``python -m tests.integration._incremental_train DIR STEPS`` from the repository root: one process, a
``DCPCheckpointIO(incremental=True)`` checkpoint every step (all kept, plus ``last``), resuming from ``last`` when
``DIR/ckpts`` exists. Writes ``DIR/final.pt`` (the model's state dict) when training completes.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_dcp import DCPCheckpointIO
from tests._models import RandomDataModule
from tests._trainer import make_trainer, seed


class FrozenBackbone(LightningModule):
    """``embed`` (frozen), ``backbone`` (frozen) and ``head`` (trained): fine-tuning of a pre-trained model.

    Every tensor is at least 1 MiB of float32 (so each has a data file of its own under incremental saves).
    ``saved`` maps a global step to the state dict the checkpoint of that step holds (cloned at save).
    """

    def __init__(self, vocab: int = 4096, dim: int = 128, width: int = 2048) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)  # 2 MiB
        self.backbone = nn.Linear(dim, width)  # 1 MiB
        self.head = nn.Linear(width, dim)  # 1 MiB, trained (AdamW: two more 1 MiB tensors of state)
        for module in (self.embed, self.backbone):
            module.requires_grad_(False)
        self.saved: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch, batch_idx):
        x, _ = batch
        tokens = (x.abs() * 1000).long() % self.embed.num_embeddings
        out = self.head(torch.tanh(self.backbone(self.embed(tokens).mean(1))))
        return out.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.saved[checkpoint["global_step"]] = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}


def trainer_for(ckpt_dir: str, *, max_steps: int, every: int):
    callback = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{step}", every_n_train_steps=every, save_top_k=-1, save_last=True
    )
    trainer = make_trainer(
        1,
        strategy="auto",
        max_steps=max_steps,
        max_epochs=100,
        callbacks=[callback],
        plugins=[DCPCheckpointIO(incremental=True)],
    )
    return trainer


def main() -> None:
    directory, steps = sys.argv[1], int(sys.argv[2])
    seed()
    ckpt_dir = os.path.join(directory, "ckpts")
    resume = "last" if os.path.isdir(ckpt_dir) else None
    trainer = trainer_for(ckpt_dir, max_steps=steps, every=1)
    model = FrozenBackbone()
    trainer.fit(model, datamodule=RandomDataModule(n=64, batch_size=4), ckpt_path=resume)
    if trainer.global_step == steps:
        torch.save(model.state_dict(), os.path.join(directory, "final.pt"))


if __name__ == "__main__":
    main()
