"""Tiered checkpoints against a real S3 server (SeaweedFS): a DDP Trainer saving through a local tier, resumes from
either tier, and a remote store that goes down and comes back. Kills: ``test_tier_kill.py``."""

from __future__ import annotations

import os

import pytest
import torch

from harness.ranks import spawn
from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, verify_checkpoint
from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.uploader import Retry
from lightning_dcp.errors import StorageUnavailableError
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _trainer(world_size: int, dirpath: str, options: dict, local_dir: str, **kwargs):
    callback = DCPModelCheckpoint(dirpath, monitor="step", mode="max", save_top_k=2, save_last="link")
    io = DCPCheckpointIO(storage_options=options, local_dir=local_dir, local_keep=1, async_save=True)
    return make_trainer(world_size, callbacks=[callback], plugins=[io], **kwargs)


def _ddp_worker(rank: int, world_size: int, tmp: str, dirpath: str, options: dict) -> None:
    seed()
    trainer = _trainer(world_size, dirpath, options, os.path.join(tmp, "local"), max_epochs=3)
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    save_result(tmp, "ddp", rank, snapshot(trainer))


def test_ddp_saves_through_the_local_tier_and_resumes_from_either_tier(s3_bucket, tmp_path):
    url, options = s3_bucket
    dirpath, local_dir = url + "/run", str(tmp_path / "local")
    spawn(_ddp_worker, 2, str(tmp_path), dirpath, options)
    saved = load_result(str(tmp_path), "ddp", 0)
    remote = Location(dirpath, storage_options=options)
    # Top-k pruning applied to both tiers; the local tier keeps local_keep=1; teardown waited for the uploads.
    assert sorted(name for name, _ in remote.entries()) == ["epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt", "last.ckpt"]
    assert sorted(n for n in os.listdir(local_dir) if not n.startswith(".")) == ["epoch=2-step=24.ckpt"]
    newest = remote.child("epoch=2-step=24.ckpt")
    assert remote.child("last.ckpt").read_pointer() == newest.name  # written by the uploader, behind that upload
    with newest.open(COMMIT_FILE) as f:
        assert f.read() == open(os.path.join(local_dir, "epoch=2-step=24.ckpt", COMMIT_FILE), "rb").read()
    verify_checkpoint(newest.url, storage_options=options)

    for where, expected in (
        (local_dir, os.path.join(local_dir, "epoch=2-step=24.ckpt")),
        (str(tmp_path / "fresh"), newest.url),
    ):
        trainer = _trainer(1, dirpath, options, where, strategy="dcp_ddp", max_epochs=3)
        trainer.fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path="last")
        assert trainer.ckpt_path == f"{expected}/{COMMIT_FILE}"  # the local copy first; else the remote one
        resumed = snapshot(trainer)
        for key in ("params", "optimizers", "global_step", "epoch"):
            assert_same(saved[key], resumed[key], key)


def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((256, 256), value)}, "epoch": int(value)}


@pytest.mark.full
def test_a_remote_outage_keeps_every_copy_and_the_uploads_resume(s3_server_factory, tmp_path):
    server = s3_server_factory()
    dirpath = f"s3://{server.new_bucket()}/run"
    options = {**server.storage_options(), "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    local_dir = tmp_path / "local"
    io = DCPCheckpointIO(storage_options=options, local_dir=local_dir, local_keep=1)
    io.tiers.retry = Retry(first_delay=0.2, max_delay=1.0, at_teardown=2.0)
    io.save_checkpoint(_state(0.0), dirpath + "/e0.ckpt")
    io.tiers.wait()

    server.kill()
    io.save_checkpoint(_state(1.0), dirpath + "/e1.ckpt")  # committed locally: training goes on
    io.remove_checkpoint(dirpath + "/e0.ckpt")  # top-k pruning asks for e0 to go: its local copy goes at once
    with pytest.raises(StorageUnavailableError, match=r"unreachable for .* Not uploaded yet: \['e1\.ckpt'\]"):
        io.tiers.wait()
    assert not (local_dir / "e0.ckpt").exists() and (local_dir / "e1.ckpt" / COMMIT_FILE).is_file()
    for path in (dirpath + "/e1.ckpt", dirpath + "/last.ckpt"):  # loads go on from the local tier meanwhile
        with pytest.warns(UserWarning, match="cannot be read .* loading from the local tier only"):
            assert io.load_checkpoint(path)["epoch"] == 1

    server.restart()
    remote = Location(dirpath, storage_options=options)
    assert remote.child("e0.ckpt").is_committed()  # nothing left the remote while its successor was not there
    io.save_checkpoint(_state(2.0), dirpath + "/e2.ckpt")
    io.teardown()
    assert sorted(name for name, _ in remote.entries()) == ["e1.ckpt", "e2.ckpt"]
    assert sorted(n for n in os.listdir(local_dir) if not n.startswith(".")) == ["e2.ckpt"]
    for i in (1, 2):
        verify_checkpoint(f"{dirpath}/e{i}.ckpt", storage_options=options)
