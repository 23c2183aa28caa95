"""A checkpoint name as long as stock Lightning writes works through the Trainer (issue 51).

``DCPModelCheckpoint(filename="f" * 230 + "-{step}")`` names checkpoints of 242 bytes, which stock Lightning writes;
the hidden staging name beside each (``.{name}.tmp-{token}``) had 260 bytes and every save failed with "File name too
long". A name longer than the filesystem takes (more than 255 bytes) fails with ``InvalidPathError`` naming the fix.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, InvalidPathError
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class _StartStep(Callback):
    step: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


def _trainer(dirpath, filename, *, steps, async_save=False):
    callback = DCPModelCheckpoint(
        dirpath, filename=filename, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last="link"
    )
    io = DCPCheckpointIO(async_save=async_save)
    return make_trainer(1, strategy="dcp_single_device", max_steps=steps, callbacks=[callback], plugins=[io])


def test_names_of_242_bytes_save_prune_and_resume(tmp_path):
    filename = "f" * 230 + "-{step}"
    seed()
    trainer = _trainer(str(tmp_path), filename, steps=6, async_save=True)
    trainer.fit(TinyModel(), datamodule=RandomDataModule(n=32))
    names = {f"{'f' * 230}-step={s}.ckpt" for s in (4, 6)}
    assert set(os.listdir(tmp_path)) == names | {"last.ckpt"}  # top-2 kept, step 2 pruned, no staging left
    assert max(len(n.encode()) for n in os.listdir(tmp_path)) == 242
    weights = {k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}

    resumed, start = _trainer(str(tmp_path), filename, steps=8), _StartStep()
    resumed.callbacks.append(start)
    resumed.fit(TinyModel(), datamodule=RandomDataModule(n=32), ckpt_path="last")
    assert start.step == 6 and resumed.global_step == 8  # resumed from the newest, through `last.ckpt`
    assert set(os.listdir(tmp_path)) == {f"{'f' * 230}-step={s}.ckpt" for s in (6, 8)} | {"last.ckpt"}
    restored = make_trainer(1, strategy="dcp_single_device", max_steps=6, plugins=[DCPCheckpointIO()])
    again = TinyModel()
    restored.fit(again, datamodule=RandomDataModule(n=32), ckpt_path=str(tmp_path / f"{'f' * 230}-step=6.ckpt"))
    assert restored.global_step == 6
    for key, value in weights.items():
        assert torch.equal(again.state_dict()[key], value), key


def test_a_name_longer_than_the_filesystem_takes_stops_the_fit_naming_the_fix(tmp_path):
    seed()
    trainer = _trainer(str(tmp_path), "f" * 250 + "-{step}", steps=2)
    with pytest.raises(InvalidPathError, match=r"has a name of 262 bytes .* at most 255 bytes per name") as err:
        trainer.fit(TinyModel(), datamodule=RandomDataModule(n=32))
    assert "`filename` of the ModelCheckpoint" in str(err.value) and str(tmp_path) in str(err.value)
    assert os.listdir(tmp_path) == []
