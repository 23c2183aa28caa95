"""ModelParallelStrategy + FSDP2 ``fully_shard`` on 2 real gloo processes: sharded save and resume."""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

from harness.ranks import spawn
from lightning_dcp import DCPModelParallelStrategy
from tests._models import FSDP2Model, RandomDataModule
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _fsdp2(world_size: int) -> DCPModelParallelStrategy:
    return DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)


def _worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    model = FSDP2Model(hidden=50)
    trainer = make_trainer(world_size, strategy=_fsdp2(world_size), max_epochs=4)
    trainer.fit(model, datamodule=RandomDataModule())
    save_result(tmp, "full", rank, snapshot(trainer))

    seed()
    model = FSDP2Model(hidden=50)
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_epochs=1, save_top_k=1, save_last=True)
    trainer = make_trainer(world_size, strategy=_fsdp2(world_size), max_epochs=2, callbacks=[ckpt])
    trainer.fit(model, datamodule=RandomDataModule())
    assert isinstance(model.body[0].weight, DTensor)
    save_result(tmp, "first", rank, snapshot(trainer))

    seed()
    model = FSDP2Model(hidden=50)
    trainer = make_trainer(world_size, strategy=_fsdp2(world_size), max_epochs=4)
    trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp, "ckpts", "last.ckpt"))
    save_result(tmp, "resumed", rank, snapshot(trainer))


def test_fsdp2_sharded_save_and_resume(tmp_path):
    tmp = str(tmp_path)
    spawn(_worker, 2, tmp)
    for rank in range(2):
        full, first, resumed = (load_result(tmp, n, rank) for n in ("full", "first", "resumed"))
        assert first["global_step"] == 16 and resumed["global_step"] == 32
        for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch"):
            assert_same(full[key], resumed[key], key)
        assert resumed["losses"] == full["losses"][16:]
    # Each rank wrote its own shard: two data files of similar size.
    files = sorted(os.listdir(tmp_path / "ckpts" / "last.ckpt"))
    assert files == [".commit", ".metadata", "__0_0.distcp", "__1_0.distcp"]
