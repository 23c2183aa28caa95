"""A real Trainer on every remote store (S3, GCS and Azure Blob servers on loopback), reached with `storage_options`
only: 2-rank DDP saves, a resume on 1 process from ``ckpt_path="last"``, consolidation from the URL."""

from __future__ import annotations

import copy

import fsspec.config
import torch

import lightning_dcp
from harness.ranks import spawn
from harness.s3 import SECRET_KEY
from harness.stores import AZURITE_KEY
from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint
from lightning_dcp.engine.storage.location import Location
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot

_ENV_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST")


def _callback(dirpath: str, **kwargs) -> DCPModelCheckpoint:
    return DCPModelCheckpoint(dirpath, monitor="step", mode="max", save_top_k=2, save_last="link", **kwargs)


def _ddp_worker(rank: int, world_size: int, tmp: str, dirpath: str, options: dict) -> None:
    seed()
    trainer = make_trainer(
        world_size,
        max_epochs=3,
        callbacks=[_callback(dirpath, every_n_epochs=1)],
        plugins=[DCPCheckpointIO(storage_options=options)],
    )
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    save_result(tmp, "ddp", rank, snapshot(trainer))


def test_ddp_saves_resume_from_last_and_consolidate(remote_store, tmp_path, monkeypatch, capfd):
    url, options, _ = remote_store
    for key in _ENV_CREDENTIALS:  # nothing in the environment: `storage_options` must be enough, "last" included
        monkeypatch.delenv(key, raising=False)
    dirpath = url + "/run"
    spawn(_ddp_worker, 2, str(tmp_path), dirpath, options)
    saved = load_result(str(tmp_path), "ddp", 0)
    directory = Location(dirpath, storage_options=options)
    names = sorted(name for name, _ in directory.entries())
    # save_top_k=2 removed the first checkpoint; last.ckpt is a pointer object, not a copy.
    assert names == ["epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt", "last.ckpt"]
    assert directory.child("last.ckpt").read_pointer() == "epoch=2-step=24.ckpt"

    user_config = copy.deepcopy(fsspec.config.conf)
    trainer = make_trainer(
        1,
        strategy="dcp_ddp",
        max_epochs=3,
        callbacks=[_callback(dirpath)],
        plugins=[DCPCheckpointIO(storage_options=options)],
    )
    trainer.fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path="last")
    assert trainer.ckpt_path == dirpath + "/epoch=2-step=24.ckpt/.commit"  # "last": the newest committed one
    assert fsspec.config.conf == user_config  # the scoped defaults for Lightning's bare stat are gone again
    resumed = snapshot(trainer)
    for key in ("params", "optimizers", "global_step", "epoch"):
        assert_same(saved[key], resumed[key], key)

    out = lightning_dcp.consolidate(dirpath + "/last.ckpt", dst=url + "/export/model.ckpt", storage_options=options)
    with Location(out, storage_options=options).open() as f:
        consolidated = torch.load(f, weights_only=True)
    assert_same(saved["params"], consolidated["state_dict"], "consolidated")
    assert consolidated["global_step"] == saved["global_step"] == 24

    # No credential anywhere: not in any object written, not in the output.
    fs = directory.fs
    for path in fs.find(url.split("://", 1)[1], detail=False):
        data = fs.cat_file(path)
        assert SECRET_KEY.encode() not in data and AZURITE_KEY.encode() not in data, path
    captured = capfd.readouterr()
    assert SECRET_KEY not in captured.out + captured.err and AZURITE_KEY not in captured.out + captured.err
