"""Per-rank RNG states: a resume at the same world size continues random streams exactly (dropout, shuffling)."""

from __future__ import annotations

import os
import random

import numpy as np
from lightning.pytorch.callbacks import ModelCheckpoint

from tests._models import DropoutModel, RandomDataModule
from tests._trainer import assert_same, make_trainer, seed, snapshot


def test_dropout_and_shuffle_continue_bit_identically(tmp_path):
    seed()
    full = make_trainer(1, strategy="dcp_single_device", max_epochs=4)
    full.fit(DropoutModel(), datamodule=RandomDataModule())
    expected = snapshot(full)
    after_full = (random.random(), np.random.rand())

    seed()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path), every_n_epochs=1, save_top_k=-1)
    first = make_trainer(1, strategy="dcp_single_device", max_epochs=2, callbacks=[ckpt])
    first.fit(DropoutModel(), datamodule=RandomDataModule())

    seed(12345)  # whatever the process did since: the checkpoint's RNG states win
    random.random(), np.random.rand()
    resumed = make_trainer(1, strategy="dcp_single_device", max_epochs=4)
    resumed.fit(DropoutModel(), datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp_path, "epoch=1-step=32.ckpt"))
    got = snapshot(resumed)
    for key in ("params", "optimizers", "global_step"):
        assert_same(expected[key], got[key], key)
    assert got["losses"] == expected["losses"][32:]
    assert (random.random(), np.random.rand()) == after_full  # python and numpy streams restored too
