"""A lightning-hydra-template-shaped module under ``dcp_ddp`` on 2 gloo processes: DictConfig and partial optimizer and
scheduler hyperparameters save, resume with ``ckpt_path="last"``, and load back with their types (issue 22)."""

from __future__ import annotations

import os

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from tests._hydra import TemplateModule, assert_template_hparams, build
from tests._models import RandomDataModule
from tests._trainer import load_result, make_trainer, save_result, seed

LIMITS = {"limit_train_batches": 2, "limit_val_batches": 1}


class SeenAtLoad(Callback):
    def __init__(self) -> None:
        self.checkpoint = None

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.checkpoint = {k: checkpoint[k] for k in ("hyper_parameters", "global_step", "lr_schedulers")}


def _worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    checkpoint = ModelCheckpoint(dirpath=tmp, save_last=True)
    trainer = make_trainer(world_size, strategy="dcp_ddp", max_epochs=1, callbacks=[checkpoint], **LIMITS)
    trainer.fit(build(), datamodule=RandomDataModule())

    seen = SeenAtLoad()
    checkpoint = ModelCheckpoint(dirpath=tmp, save_last=True)
    resumed = make_trainer(world_size, strategy="dcp_ddp", max_epochs=2, callbacks=[checkpoint, seen], **LIMITS)
    resumed.fit(build(), datamodule=RandomDataModule(), ckpt_path="last")
    assert_template_hparams(seen.checkpoint["hyper_parameters"], scheduler=True)
    save_result(tmp, "resume", rank, {"step": resumed.global_step, "loaded": seen.checkpoint["global_step"]})
    if rank == 0:
        loaded = TemplateModule.load_from_checkpoint(os.path.join(tmp, "last.ckpt"))
        assert_template_hparams(loaded.hparams, scheduler=True)
        save_result(tmp, "loaded", rank, type(loaded.hparams["net"]).__name__)


def test_template_module_under_dcp_ddp_keeps_its_hparams(tmp_path):
    spawn(_worker, 2, str(tmp_path))
    for rank in range(2):  # every rank resumed from step 2 (1 epoch of 2 batches) and trained 2 more steps
        assert load_result(str(tmp_path), "resume", rank) == {"step": 4, "loaded": 2}
    assert os.path.isfile(tmp_path / "last.ckpt" / ".commit")
    assert load_result(str(tmp_path), "loaded", 0) == "DictConfig"  # load_from_checkpoint's hparams, on rank 0
