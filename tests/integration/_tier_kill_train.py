"""Training run of the tiered kill campaign (``benchmarks/kill_tiered.py``): 2-rank DDP on CPU, an async save every
epoch through a local tier to S3, resuming from "last".

Top-k pruning (``save_top_k=2`` by step) and ``save_last="link"``: after any kill the remote directory must end with
exactly the two newest checkpoints and a ``last.ckpt`` pointer to the newest.

Run as ``python -m tests.integration._tier_kill_train DIR EPOCHS REMOTE OPTIONS_JSON`` from the repository root;
Lightning's launcher starts rank 1 with the same command. Writes ``DIR/final.pt`` (rank 0) when training completes
(after every upload finished: the plugin's teardown waits for them), and ``DIR/expected.json``: the names top-k keeps
(``top_k``) and the one ``last.ckpt`` designates (``last``).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint
from tests._models import DropoutModel, RandomDataModule
from tests._trainer import make_trainer, seed

HIDDEN = 1024  # ~12.6 MB per checkpoint (weights + AdamW state): uploads take long enough to be killed


def main() -> None:
    directory, epochs, remote, options = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    seed()
    callback = DCPModelCheckpoint(remote, every_n_epochs=1, save_top_k=2, monitor="step", mode="max", save_last="link")
    io = DCPCheckpointIO(
        storage_options=options, local_dir=os.path.join(directory, "local"), local_keep=1, async_save=True
    )
    trainer = make_trainer(2, max_epochs=epochs, callbacks=[callback], plugins=[io])
    trainer.fit(DropoutModel(hidden=HIDDEN), datamodule=RandomDataModule(n=16, batch_size=4), ckpt_path="last")
    if trainer.global_rank == 0 and trainer.global_step == 2 * epochs:
        torch.save(
            {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()},
            os.path.join(directory, "final.pt"),
        )
        names = sorted(os.path.basename(path) for path in callback.best_k_models)
        with open(os.path.join(directory, "expected.json"), "w") as f:
            json.dump({"top_k": names, "last": os.path.basename(callback.best_model_path)}, f)


if __name__ == "__main__":
    main()
