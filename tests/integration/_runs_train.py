"""A one-process fit into a checkpoint directory that other runs may share; run by test_runs.py.

Run as ``python -m tests.integration._runs_train CONFIG_JSON`` from the repository root. CONFIG_JSON holds ``dirpath``,
``model`` (``"a"``: a TinyModel; ``"b"``: another architecture), ``filename``, ``save_last`` (``"link"`` or false),
``max_steps`` and ``ckpt_path`` (or null). Prints ``START <global step at on_train_start>``.
"""

from __future__ import annotations

import json
import sys

from lightning.pytorch import Callback
from torch import nn

from lightning_dcp import DCPModelCheckpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class OtherArchitecture(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 16))


class Start(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        print("START", trainer.global_step, flush=True)


def main() -> None:
    config = json.loads(sys.argv[1])
    seed()
    model = TinyModel() if config["model"] == "a" else OtherArchitecture()
    callback = DCPModelCheckpoint(
        dirpath=config["dirpath"],
        filename=config["filename"],
        every_n_train_steps=4,
        save_top_k=-1,
        save_last=config["save_last"],
    )
    trainer = make_trainer(
        1, strategy="dcp_single_device", max_epochs=-1, max_steps=config["max_steps"], callbacks=[callback, Start()]
    )
    trainer.fit(model, datamodule=RandomDataModule(n=16), ckpt_path=config["ckpt_path"])


if __name__ == "__main__":
    main()
