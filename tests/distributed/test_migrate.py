"""Switching from Lightning's own sharded checkpoints: a ModelParallelStrategy checkpoint resumes under ours."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch.strategies import ModelParallelStrategy

from harness.ranks import spawn
from lightning_dcp import DCPModelParallelStrategy
from tests._models import FSDP2Model, RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    stock = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = make_trainer(world_size, strategy=stock, max_epochs=2)
    trainer.fit(FSDP2Model(hidden=50), datamodule=RandomDataModule())
    path = os.path.join(tmp, "lightning-sharded.ckpt")
    trainer.save_checkpoint(path)
    save_result(tmp, "saved", rank, snapshot(trainer))
    assert os.path.isfile(os.path.join(path, "meta.pt"))  # Lightning's own layout, not ours

    ours = DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = make_trainer(world_size, strategy=ours, max_epochs=2)
    trainer.fit(FSDP2Model(hidden=50), datamodule=RandomDataModule(), ckpt_path=path)
    save_result(tmp, "resumed", rank, snapshot(trainer))


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("migrate"))
    spawn(_worker, 2, tmp)
    return tmp


def test_lightning_model_parallel_checkpoint_resumes_under_dcp_strategy(migrated):
    for rank in range(2):
        saved, resumed = load_result(migrated, "saved", rank), load_result(migrated, "resumed", rank)
        for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch"):
            assert_same(saved[key], resumed[key], key)


def test_lightning_checkpoint_resumes_on_one_process(migrated):
    saved = load_result(migrated, "saved")
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=2)
    trainer.fit(
        TinyModel(hidden=50), datamodule=RandomDataModule(), ckpt_path=os.path.join(migrated, "lightning-sharded.ckpt")
    )
    loaded = snapshot(trainer)
    for key in ("params", "optimizers", "lrs", "global_step"):
        assert_same(saved[key], loaded[key], key)
