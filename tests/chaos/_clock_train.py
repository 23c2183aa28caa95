"""One rank of the clock pass: 2 "nodes" x 1 process of DDP on CPU, each with its own wall clock (libfaketime).

Run as ``python -m tests.chaos._clock_train CONFIG_JSON`` once per rank, started by the campaign with ``RANK``,
``LOCAL_RANK=0``, ``NODE_RANK``, ``WORLD_SIZE=2``, ``MASTER_ADDR``, ``MASTER_PORT`` set (Lightning then launches
nothing itself, as under a cluster launcher) and with ``LD_PRELOAD`` of libfaketime reading this node's clock file,
which the campaign rewrites while the run trains (a clock stepped back or forward mid-run). CONFIG_JSON holds ``dir``,
``run``, ``max_steps``, ``callback`` (``"dcp"`` or ``"lightning"``) and ``resume``.

Records (``dir/records``) are those of :mod:`tests.chaos._train`: ``save-{run}-{step}.json`` (rank 0, the hash of
the state being saved) and ``resume-{run}-{rank}.json`` (every rank: the identity and hash of what it restored).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import DCPModelCheckpoint
from tests.chaos._train import ChaosModel

WIDTH = 256


def main() -> None:
    config = json.loads(sys.argv[1])
    seed_everything(1234, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, WIDTH, generator=g), torch.randn(256, WIDTH, generator=g))
    callback_cls = DCPModelCheckpoint if config["callback"] == "dcp" else ModelCheckpoint
    callback = callback_cls(
        dirpath=os.path.join(config["dir"], "ckpts"),
        filename="{step}",
        every_n_train_steps=2,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last="link",
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy="dcp_ddp",
        callbacks=[callback],
        max_steps=config["max_steps"],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = ChaosModel(WIDTH, 2, config["run"], os.path.join(config["dir"], "records"))
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), ckpt_path="last" if config["resume"] else None)


if __name__ == "__main__":
    main()
