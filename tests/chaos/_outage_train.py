"""One training process of the remote-fault pass (``tests/chaos/remote.py``): a Trainer saving to S3 via a local tier.

Run as ``python -m tests.chaos._outage_train CONFIG_JSON`` from the repository root. CONFIG_JSON holds ``dir``,
``remote`` (the checkpoint directory URL), ``options`` (s3fs options, reaching the store through the fault proxy),
``every`` (``every_n_train_steps``), ``hidden`` (model width), ``async_save`` and ``at_teardown`` (seconds).

It trains until the file ``dir/stop`` appears (checked at every step that saves: the last save is the final state),
with ``save_top_k=2`` by step and ``save_last="link"``, then writes ``dir/result.json``: the final global step, the
names top-k keeps, the newest checkpoint, the number of saves and of "unreachable" warnings, and ``dir/final.pt``: the
final weights. The process exits with a non-zero status if the fit raised (a crash the pass counts).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint
from lightning_dcp.engine.uploader import Retry
from tests._models import DropoutModel, RandomDataModule
from tests._trainer import make_trainer, seed


class _StopFile(Callback):
    """Ends the fit (``trainer.should_stop``) at the first saving step after ``path`` appears; counts the saves."""

    def __init__(self, path: str, every: int) -> None:
        self.path, self.every, self.saves = path, every, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saves += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0 and os.path.exists(self.path):
            trainer.should_stop = True  # the checkpoint callback (after this one) saves this step


def main() -> None:
    config = json.loads(sys.argv[1])
    directory = config["dir"]
    seed()
    checkpoint = DCPModelCheckpoint(
        config["remote"],
        every_n_train_steps=config["every"],
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last="link",
    )
    io = DCPCheckpointIO(
        storage_options=config["options"],
        local_dir=os.path.join(directory, "local"),
        local_keep=2,
        async_save=config["async_save"],
    )
    io.tiers.retry = Retry(at_teardown=config["at_teardown"])
    stop = _StopFile(os.path.join(directory, "stop"), config["every"])
    trainer = make_trainer(1, max_epochs=-1, max_steps=-1, callbacks=[checkpoint, stop], plugins=[io])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(DropoutModel(hidden=config["hidden"]), datamodule=RandomDataModule(n=256, batch_size=8))
    torch.save(
        {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}, os.path.join(directory, "final.pt")
    )
    result = {
        "global_step": trainer.global_step,
        "top_k": sorted(os.path.basename(p) for p in checkpoint.best_k_models),
        "newest": os.path.basename(checkpoint.best_model_path),
        "saves": stop.saves,
        "unreachable_warnings": sum("has been unreachable for" in str(w.message) for w in seen),
    }
    with open(os.path.join(directory, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
