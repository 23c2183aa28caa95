"""Training run used by test_kill.py: 2-rank DDP on CPU, a checkpoint every epoch, resumes from "last".

Run as ``python -m tests.integration._kill_train DIR EPOCHS ASYNC`` from the repository root; Lightning's launcher
starts rank 1 with the same command. Writes ``DIR/final.pt`` (rank 0) when training completes.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dcp import DCPCheckpointIO
from tests._models import DropoutModel, RandomDataModule
from tests._trainer import make_trainer, seed


def main() -> None:
    directory, epochs, use_async = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    seed()
    ckpt_dir = os.path.join(directory, "ckpts")
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_last=True)
    trainer = make_trainer(2, max_epochs=epochs, callbacks=[callback], plugins=[DCPCheckpointIO(async_save=use_async)])
    resume = "last" if os.path.isdir(ckpt_dir) else None
    trainer.fit(DropoutModel(hidden=512), datamodule=RandomDataModule(n=16, batch_size=4), ckpt_path=resume)
    if trainer.global_rank == 0 and trainer.global_step == 2 * epochs:
        torch.save(
            {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()},
            os.path.join(directory, "final.pt"),
        )


if __name__ == "__main__":
    main()
