"""Incremental saves on 2 real gloo ranks (``dcp_ddp``): each rank links its own chunks of the frozen tensors."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from lightning_dcp import DCPCheckpointIO, verify_checkpoint
from tests._models import RandomDataModule
from tests._trainer import load_result, make_trainer, save_result, seed
from tests.integration._incremental_train import FrozenBackbone

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    model = FrozenBackbone()
    callback = ModelCheckpoint(
        dirpath=os.path.join(tmp, "ckpts"), filename="{step}", every_n_train_steps=2, save_top_k=-1
    )
    trainer = make_trainer(
        world_size, max_steps=6, max_epochs=100, callbacks=[callback], plugins=[DCPCheckpointIO(incremental=True)]
    )
    trainer.fit(model, datamodule=RandomDataModule(n=64, batch_size=4))
    save_result(tmp, "saved", rank, model.saved)


def test_ddp_incremental_saves_link_every_ranks_frozen_chunks(tmp_path):
    tmp = str(tmp_path)
    spawn(_worker, 2, tmp)
    saved = load_result(tmp, "saved", 0)
    paths = {step: os.path.join(tmp, "ckpts", f"step={step}.ckpt") for step in (2, 4, 6)}
    files = {}
    for step, path in paths.items():
        metadata = dcp.FileSystemReader(path).read_metadata()
        files[step] = {
            (index.fqn, tuple(index.offset)): os.stat(os.path.join(path, info.relative_path))
            for index, info in metadata.storage_data.items()
            if index.fqn.endswith(("embed.weight", "backbone.weight"))
        }
    assert len(files[2]) == 2  # embed and backbone (replicated: each written by one of the ranks)
    for key, info in files[6].items():  # the same file in all three checkpoints
        assert info.st_nlink == 3 and info.st_ino == files[2][key].st_ino, key
    shutil.rmtree(paths[4])
    shutil.rmtree(paths[2])
    verify_checkpoint(paths[6])
    expected = saved[6]
    stock = {"state_dict": {k: torch.empty_like(v) for k, v in expected.items()}}
    dcp.load(stock, checkpoint_id=paths[6], no_dist=True)
    ours = DCPCheckpointIO().load_checkpoint(paths[6])["state_dict"]
    for key, value in expected.items():
        assert torch.equal(stock["state_dict"][key], value) and torch.equal(ours[key], value), key
