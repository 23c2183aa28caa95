"""DDP on 2 real gloo processes: ModelCheckpoint with directory checkpoints, shard sizes, stock strategies.

The checkpoints written here are then resumed on 1 process and consolidated in the pytest process itself.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

import lightning_dcp
from harness.ranks import spawn
from lightning_dcp import DCPCheckpointIO
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot

HIDDEN = 256  # ~0.8 MB of model + AdamW state: enough bytes to see how they spread over ranks


def _worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    model = TinyModel(hidden=HIDDEN)
    top_k = ModelCheckpoint(
        dirpath=os.path.join(tmp, "topk"), monitor="val_loss", mode="min", save_top_k=2, save_last="link"
    )
    by_steps = ModelCheckpoint(dirpath=os.path.join(tmp, "steps"), every_n_train_steps=5, save_top_k=-1)
    early = EarlyStopping(monitor="val_loss", patience=100)
    trainer = make_trainer(world_size, max_epochs=4, callbacks=[top_k, by_steps, early])
    trainer.fit(model, datamodule=RandomDataModule())
    trainer.save_checkpoint(os.path.join(tmp, "manual.ckpt"))
    trainer.save_checkpoint(os.path.join(tmp, "weights.ckpt"), weights_only=True)
    save_result(tmp, "saved", rank, snapshot(trainer))
    save_result(tmp, "best", rank, {"best": top_k.best_model_path, "k": sorted(top_k.best_k_models)})

    # A stock Lightning DDP strategy given DCPCheckpointIO: rank 0 writes the whole state, every rank loads it.
    seed()
    model = TinyModel(hidden=HIDDEN)
    trainer = make_trainer(world_size, strategy="ddp", max_epochs=1, plugins=[DCPCheckpointIO()])
    trainer.fit(model, datamodule=RandomDataModule())
    trainer.save_checkpoint(os.path.join(tmp, "stock.ckpt"))
    stock_saved = snapshot(trainer)
    model = TinyModel(hidden=HIDDEN)
    trainer = make_trainer(world_size, strategy="ddp", max_epochs=1, plugins=[DCPCheckpointIO()])
    trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp, "stock.ckpt"))
    stock_loaded = snapshot(trainer)
    assert_same(stock_saved["params"], stock_loaded["params"], "stock params")
    assert_same(stock_saved["optimizers"], stock_loaded["optimizers"], "stock optimizers")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ddp"))
    spawn(_worker, 2, tmp)
    return tmp


def test_top_k_and_last_link(ddp_run):
    best = load_result(ddp_run, "best")
    names = sorted(os.listdir(os.path.join(ddp_run, "topk")))
    kept = sorted(os.path.basename(p) for p in best["k"])
    assert names == sorted([*kept, "last.ckpt"])  # older top-k directories removed, no staging left behind
    assert len(kept) == 2
    assert os.path.islink(os.path.join(ddp_run, "topk", "last.ckpt"))
    for name in kept:
        assert os.path.isfile(os.path.join(ddp_run, "topk", name, ".metadata"))


def test_every_n_train_steps(ddp_run):
    # 8 steps per epoch x 4 epochs, a checkpoint every 5 steps
    names = sorted(os.listdir(os.path.join(ddp_run, "steps")), key=lambda n: int(n.split("step=")[1][:-5]))
    assert [int(n.split("step=")[1][:-5]) for n in names] == [5, 10, 15, 20, 25, 30]


def test_bytes_spread_over_ranks(ddp_run):
    ckpt = os.path.join(ddp_run, "manual.ckpt")
    assert sorted(os.listdir(ckpt)) == [".commit", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    sizes = [os.path.getsize(os.path.join(ckpt, f"__{r}_0.distcp")) for r in range(2)]
    saved = load_result(ddp_run, "saved")
    tensor_bytes = sum(t.numel() * t.element_size() for t in saved["params"].values())
    tensor_bytes += sum(
        t.numel() * t.element_size() for s in saved["optimizers"][0]["state"].values() for t in s.values()
    )
    assert sum(sizes) >= tensor_bytes  # every byte written once (plus per-tensor headers), not twice
    assert sum(sizes) < 1.2 * tensor_bytes
    for size in sizes:
        assert 0.35 * sum(sizes) < size < 0.65 * sum(sizes)


def test_resume_on_one_process(ddp_run):
    saved = load_result(ddp_run, "saved")
    model = TinyModel(hidden=HIDDEN)
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=4)
    with pytest.warns(UserWarning, match="re-seeded deterministically"):  # saved at world size 2, resumed at 1
        trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=os.path.join(ddp_run, "manual.ckpt"))
    loaded = snapshot(trainer)
    for key in ("params", "optimizers", "lrs", "schedulers", "global_step"):
        assert_same(saved[key], loaded[key], key)
    assert model.extra_saved == {"note": "kept", "values": [1, 2, 3]}


def test_weights_only_checkpoint(ddp_run):
    checkpoint = DCPCheckpointIO().load_checkpoint(os.path.join(ddp_run, "weights.ckpt"))
    assert "optimizer_states" not in checkpoint and "callbacks" not in checkpoint
    assert_same(load_result(ddp_run, "saved")["params"], checkpoint["state_dict"])
    # Resuming training from it fails with Lightning's own message about weights-only checkpoints.
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=5)
    with pytest.raises(KeyError, match="weights_only"):
        trainer.fit(
            TinyModel(hidden=HIDDEN), datamodule=RandomDataModule(), ckpt_path=os.path.join(ddp_run, "weights.ckpt")
        )


def test_consolidate_equals_live_state(ddp_run, tmp_path):
    src = os.path.join(ddp_run, "manual.ckpt")
    dst = lightning_dcp.consolidate(src, dst=str(tmp_path / "model.ckpt"))
    saved = load_result(ddp_run, "saved")
    full = torch.load(dst, weights_only=True)
    assert_same(saved["params"], full["state_dict"])
    assert full["global_step"] == saved["global_step"] == 32
    assert {"loops", "callbacks", "lr_schedulers", "optimizer_states", "hyper_parameters", "epoch"} <= set(full)
    # optimizer.state_dict() layout: integer ids in param_groups order
    assert sorted(full["optimizer_states"][0]["state"]) == list(range(len(saved["params"]) - 1))
    restored = TinyModel.load_from_checkpoint(dst)
    assert_same(saved["params"], {k: v for k, v in restored.state_dict().items()})
    assert restored.hparams.hidden == HIDDEN
    # A stock Trainer resumes from it: same optimizer state and step.
    model = TinyModel(hidden=HIDDEN)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=4, logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=dst)
    loaded = snapshot(trainer)
    for key in ("params", "optimizers", "lrs", "global_step"):
        assert_same(saved[key], loaded[key], key)


def test_stock_ddp_strategy_writes_whole_state_from_rank0(ddp_run):
    # Lightning's DDPStrategy calls the plugin on rank 0 only: one unsharded DCP directory, no collective.
    assert sorted(os.listdir(os.path.join(ddp_run, "stock.ckpt"))) == [".commit", ".metadata", "__0_0.distcp"]


def test_overwrite_at_smaller_world_size_leaves_no_stale_shard(ddp_run, tmp_path):
    import shutil

    path = str(tmp_path / "manual.ckpt")
    shutil.copytree(os.path.join(ddp_run, "manual.ckpt"), path)
    io = DCPCheckpointIO()
    checkpoint = io.load_checkpoint(path)
    checkpoint["global_step"] += 1
    io.save_checkpoint(checkpoint, path)  # world size 1 now
    assert sorted(os.listdir(path)) == [".commit", ".metadata", "__0_0.distcp"]
    assert io.load_checkpoint(path)["global_step"] == checkpoint["global_step"]
