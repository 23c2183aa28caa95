"""One training process of the kill campaign: 2-rank DDP on CPU that checkpoints every few steps and resumes "last".

Run as ``python -m tests.chaos._train CONFIG_JSON`` from the repository root (Lightning's subprocess launcher starts
rank 1 with the same command). CONFIG_JSON holds ``dir``, ``run`` (this launch's id), ``strategy`` (``"ddp"`` with
``DCPCheckpointIO`` as a plugin, or ``"dcp_ddp"``), ``callback`` (``"lightning"``: ``ModelCheckpoint``, or
``"dcp"``: ``DCPModelCheckpoint``), ``save_last`` (``"link"`` or ``"copy"``), ``async_save``, ``width``, ``layers``,
``every`` (``every_n_train_steps``) and ``resume``.

What it records, under ``dir/records`` (written whole, then renamed, so a reader never sees half a file):

- ``save-{run}-{step}.json`` (rank 0, in ``on_save_checkpoint``, before the save starts): the hash of the model and
  optimizer state being saved. The same identity (``run``, ``step``, hash) goes into the checkpoint itself.
- ``resume-{run}-{rank}.json`` (every rank, in ``on_train_start``, after the restore): the identity found in the
  loaded checkpoint (``None`` when training started fresh), the global step, and the hash of the restored state.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import xxhash
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint


def state_hash(module: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """xxh3-128 over every model tensor and every optimizer state value, in parameter-name order, with dtypes, shapes
    and the optimizer's hyperparameters: equal hashes mean bit-identical model and optimizer state."""
    digest = xxhash.xxh3_128()

    def feed(name: str, value: Any) -> None:
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy())
        else:
            digest.update(repr(value).encode())

    for name, tensor in sorted(module.state_dict().items()):
        feed(f"model.{name}", tensor)
    names = {id(p): n for n, p in module.named_parameters()}
    for param in sorted((p for g in optimizer.param_groups for p in g["params"]), key=lambda p: names[id(p)]):
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            feed(f"optim.{names[id(param)]}.{key}", value)
    for i, group in enumerate(optimizer.param_groups):
        for key, value in sorted(group.items()):
            if key != "params":
                feed(f"group.{i}.{key}", value)
    return digest.hexdigest()


def write_record(directory: str, name: str, record: dict[str, Any]) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(directory, name))


class ChaosModel(LightningModule):
    """A stack of large Linear layers trained with AdamW: checkpoints of 12 * layers * width**2 bytes."""

    def __init__(self, width: int, layers: int, run: str, records: str) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
        self.run, self.records = run, records
        self.loaded: dict[str, Any] | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def _hash(self) -> str:
        return state_hash(self, self.trainer.optimizers[0])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        identity = {"run": self.run, "step": self.trainer.global_step, "hash": self._hash()}
        checkpoint["chaos"] = identity
        if self.trainer.global_rank == 0:
            name = f"save-{self.run}-{identity['step']}.json"
            write_record(self.records, name, {**identity, "time": time.time()})

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint.get("chaos")

    def on_train_start(self) -> None:
        rank = self.trainer.global_rank
        write_record(
            self.records,
            f"resume-{self.run}-{rank}.json",
            {
                "run": self.run,
                "rank": rank,
                "loaded": self.loaded,
                "global_step": self.trainer.global_step,
                "hash": self._hash(),
                "time": time.time(),
            },
        )


def main() -> None:
    config = json.loads(sys.argv[1])
    seed_everything(1234, verbose=False)
    width, directory = config["width"], config["dir"]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, width, generator=g), torch.randn(256, width, generator=g))
    callback_cls = DCPModelCheckpoint if config["callback"] == "dcp" else ModelCheckpoint
    callback = callback_cls(
        dirpath=os.path.join(directory, "ckpts"),
        filename="{step}",
        every_n_train_steps=config["every"],
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last="link" if config["save_last"] == "link" else True,
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=config["strategy"],
        plugins=[DCPCheckpointIO(async_save=config["async_save"])],
        callbacks=[callback],
        max_steps=10**6,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = ChaosModel(width, config["layers"], config["run"], os.path.join(directory, "records"))
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path="last" if config["resume"] else None)


if __name__ == "__main__":
    main()
