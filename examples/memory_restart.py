"""The memory tier under torchrun: a worker that dies is restarted with its peers, and they resume from memory.

    torchrun --nproc-per-node 2 --max-restarts 3 examples/memory_restart.py /dev/shm/run1

Two CPU processes train a small model with ``strategy="dcp_ddp"``; every 10 steps ``MemoryCheckpoint`` saves into
the memory area (``/dev/shm/run1``: host memory that outlives the workers) and replicates each rank's part to a peer.
Kill a worker (``kill -9``): torchrun restarts both, ``fit(ckpt_path="last")`` resumes the newest memory checkpoint,
and training ends at step 300. Rank 0 prints the step each attempt starts from. No ``dirpath`` is given: persisted
checkpoints go into Lightning's default folder (``lightning_logs/version_N/checkpoints``, a new ``N`` per attempt),
and the memory tier knows the restarted attempt as the same run by torchrun's job (docs/memory-tier.md).
"""

from __future__ import annotations

import sys

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import MemoryCheckpoint


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StartStep(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            print(f"training starts at step {trainer.global_step}", flush=True)


def main(memory_dir: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=64, shuffle=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,  # torchrun's --nproc-per-node: on CPU Lightning needs it said
        strategy="dcp_ddp",
        max_steps=300,
        callbacks=[MemoryCheckpoint(memory_dir, every_n_train_steps=10), StartStep()],
        enable_progress_bar=False,
    )
    trainer.fit(Regression(), data, ckpt_path="last")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/dev/shm/run1")
