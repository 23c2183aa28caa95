"""Fabric checkpoints beside the Trainer's and on S3: weights across the front ends, saves to a real S3 server."""

from __future__ import annotations

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_dcp import consolidate, load_model_weights
from lightning_dcp.fabric import DCPSingleDeviceStrategy, latest_checkpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed


def _fabric(**strategy_options) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DCPSingleDeviceStrategy(**strategy_options))
    fabric.launch()
    return fabric


def _fit(fabric: Fabric, model: nn.Module, optimizer, steps: int) -> None:
    data = torch.Generator().manual_seed(3)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=data)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_trainer_weights_into_a_fabric_run_and_back(tmp_path):
    seed()
    trained = TinyModel()
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=3)
    trainer.fit(trained, datamodule=RandomDataModule())
    trainer_ckpt = str(tmp_path / "trainer.ckpt")
    trainer.save_checkpoint(trainer_ckpt)
    expected = {k: v.clone() for k, v in trained.state_dict().items()}

    # Trainer checkpoint -> a Fabric run's module: load_model_weights, fabric.load under the "state_dict" key,
    # fabric.load_raw (the checkpoint's only module)
    fabric = _fabric()
    module = fabric.setup_module(TinyModel(hidden=16))
    report = load_model_weights(module, trainer_ckpt)
    assert_same(module.module.state_dict(), expected, "load_model_weights")
    assert report.missing_keys == [] and report.unexpected_keys == []
    other = TinyModel()
    remainder = fabric.load(trainer_ckpt, {"state_dict": other})
    assert_same(other.state_dict(), expected, "fabric.load")
    assert remainder["global_step"] == 3 and "optimizer_states" not in remainder
    raw = TinyModel()
    fabric.load_raw(trainer_ckpt, raw)
    assert_same(raw.state_dict(), expected, "load_raw")
    whole = fabric.load(trainer_ckpt)  # the Trainer's checkpoint dict, full tensors
    assert_same(whole["state_dict"], expected, "fabric.load(path)")
    assert whole["global_step"] == 3 and len(whole["optimizer_states"]) == 1 and "lightning_dcp" not in whole

    # Fabric checkpoint -> a LightningModule (the Trainer's side)
    model = fabric.setup_module(TinyModel())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    _fit(fabric, model, optimizer, 2)
    fabric_ckpt = str(tmp_path / "fabric")
    fabric.save(fabric_ckpt, {"model": model, "optimizer": optimizer, "step": 2})
    lightning_module = TinyModel()
    load_model_weights(lightning_module, fabric_ckpt)
    assert_same(lightning_module.state_dict(), model.module.state_dict(), "fabric -> LightningModule")
    # ... and it trains on from there under the Trainer
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=1)
    trainer.fit(lightning_module, datamodule=RandomDataModule())
    assert trainer.global_step == 1


def test_fabric_saves_to_s3_and_resumes(s3_bucket, tmp_path):
    url, options = s3_bucket
    run = url + "/run"
    torch.manual_seed(0)
    fabric = _fabric(storage_options=options, async_save=True, sync_files=False)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    _fit(fabric, model, optimizer, 2)
    fabric.save(run + "/step-2", {"model": model, "optimizer": optimizer, "step": 2})
    _fit(fabric, model, optimizer, 2)
    state = {"model": model, "optimizer": optimizer, "step": 4}
    fabric.save(run + "/step-4", state)
    fabric.save(run + "/step-4", state)  # overwriting a committed checkpoint: staged, then copied server-side
    fabric.strategy.wait_for_save()
    draw = torch.rand(3)
    assert latest_checkpoint(run, storage_options=options) == run + "/step-4"

    fresh = _fabric(storage_options=options)
    torch.manual_seed(1)
    other = fresh.setup_module(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2)))
    other_optimizer = fresh.setup_optimizers(torch.optim.AdamW(other.parameters(), lr=0.05))
    restored = {"model": other, "optimizer": other_optimizer, "step": 0}
    fresh.load(run + "/step-4", restored)
    assert restored["step"] == 4 and torch.equal(torch.rand(3), draw)
    assert_same(other.module.state_dict(), model.module.state_dict(), "model")
    assert_same(other_optimizer.state_dict(), optimizer.state_dict(), "optimizer")
    pt = consolidate(run + "/step-2", dst=str(tmp_path / "step-2.pt"), storage_options=options)
    assert torch.load(pt, weights_only=True)["step"] == 2
