"""A real Trainer against a real S3 server (SeaweedFS, enforced keys): DDP save, resume, consolidate, failures."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_dcp
from lightning_dcp import BucketNotFoundError, CheckpointError, DCPCheckpointIO, DCPModelCheckpoint, StorageAccessError
from lightning_dcp.engine.dcp_io import storage_reader, storage_writer
from lightning_dcp.engine.storage import Location
from tests._models import RandomDataModule, TinyModel
from tests._s3 import SECRET_KEY
from tests._spawn import spawn
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _use_env_credentials(monkeypatch, server) -> None:
    import s3fs

    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a plain S3FileSystem() made under other variables is cached


def _ddp_worker(rank: int, world_size: int, tmp: str, dirpath: str) -> None:
    seed()
    callback = DCPModelCheckpoint(dirpath, monitor="step", mode="max", save_top_k=2, every_n_epochs=1, save_last="link")
    trainer = make_trainer(world_size, max_epochs=3, callbacks=[callback])
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    save_result(tmp, "ddp", rank, snapshot(trainer))


def test_ddp_saves_to_s3_resumes_on_one_process_and_consolidates(s3_server, s3_bucket, tmp_path, monkeypatch, capfd):
    url, options = s3_bucket
    dirpath = url + "/run"
    # The DDP ranks get their credentials from the environment only (AWS_*), as s3fs users configure them.
    spawn(_ddp_worker, 2, str(tmp_path), dirpath, env=s3_server.env())
    saved = load_result(str(tmp_path), "ddp", 0)
    directory = Location(dirpath, storage_options=options)
    names = sorted(name for name, _ in directory.entries())
    # save_top_k=2 removed the first checkpoint; last.ckpt is a pointer object, not a copy.
    assert names == ["epoch=1-step=16.ckpt", "epoch=2-step=24.ckpt", "last.ckpt"]
    assert directory.child("last.ckpt").read_pointer() == "epoch=2-step=24.ckpt"

    _use_env_credentials(monkeypatch, s3_server)
    callback = DCPModelCheckpoint(dirpath, monitor="step", mode="max", save_top_k=2, save_last="link")
    trainer = make_trainer(1, strategy="dcp_ddp", max_epochs=3, callbacks=[callback])
    model = TinyModel()
    trainer.fit(model, datamodule=RandomDataModule(), ckpt_path="last")
    assert trainer.ckpt_path == dirpath + "/epoch=2-step=24.ckpt/.commit"  # "last": the newest committed one
    resumed = snapshot(trainer)
    for key in ("params", "optimizers", "global_step", "epoch"):
        assert_same(saved[key], resumed[key], key)

    # (consolidate does not follow the last.ckpt pointer yet: reported; it is given the checkpoint's own URL.)
    src = dirpath + "/epoch=2-step=24.ckpt"
    out = lightning_dcp.consolidate(src, dst=url + "/export/model.ckpt", storage_options=options)
    with Location(out, storage_options=options).open() as f:
        consolidated = torch.load(f, weights_only=True)
    assert_same(saved["params"], consolidated["state_dict"], "consolidated")
    assert consolidated["global_step"] == saved["global_step"] == 24

    # No credential anywhere: not in any object written, not in the output.
    fs = directory.fs
    for path in fs.find(url, detail=False):
        assert SECRET_KEY.encode() not in fs.cat_file(path), path
    captured = capfd.readouterr()
    assert SECRET_KEY not in captured.out + captured.err


def test_wrong_secret_and_missing_bucket_fail_clearly(s3_server, s3_bucket):
    url, _ = s3_bucket
    state = {"state_dict": {"w": torch.ones(2)}}
    bad = DCPCheckpointIO(storage_options=s3_server.storage_options(secret="not-the-secret"))
    with pytest.raises(StorageAccessError) as err:
        bad.save_checkpoint(state, url + "/a.ckpt")
    message = str(err.value)
    assert (
        url.removeprefix("s3://") in message and "AWS_SECRET_ACCESS_KEY" in message and "not-the-secret" not in message
    )
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, PermissionError)
    with pytest.raises(StorageAccessError):
        bad.load_checkpoint(url + "/a.ckpt")

    good = DCPCheckpointIO(storage_options=s3_server.storage_options())
    with pytest.raises(BucketNotFoundError, match="'no-such-bucket' .* does not exist. Create it"):
        good.save_checkpoint(state, "s3://no-such-bucket/run/a.ckpt")
    with pytest.raises(BucketNotFoundError):
        good.load_checkpoint("s3://no-such-bucket/run/a.ckpt")


def test_storage_options_survive_dcp_reset_and_no_host_sync(s3_server, s3_bucket, monkeypatch):
    url, options = s3_bucket
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)  # keys only in storage_options; the server enforces them
    monkeypatch.setattr(os, "sync", lambda: pytest.fail("a remote save must never call the host-wide os.sync()"))
    writer = storage_writer(Location(url + "/first", storage_options=options), thread_count=1, sync_files=True)
    writer.reset(url + "/second")  # DCP's reset re-creates its filesystem from the URL alone
    dcp.save({"w": torch.arange(6.0)}, storage_writer=writer, checkpoint_id=url + "/second", no_dist=True)
    reader = storage_reader(Location(url + "/first", storage_options=options))
    target = {"w": torch.zeros(6)}
    dcp.load(target, storage_reader=reader, checkpoint_id=url + "/second", no_dist=True)
    assert torch.equal(target["w"], torch.arange(6.0))


class _KillWhenUploading(threading.Thread):
    """SIGKILL the server as soon as a multipart upload (a large data file being written) is in flight."""

    def __init__(self, server, bucket: str, options) -> None:
        super().__init__(daemon=True)
        self.server, self.bucket, self.options = server, bucket, options
        self.killed = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options)
        while not self.stop.is_set():
            if fs.call_s3("list_multipart_uploads", Bucket=self.bucket).get("Uploads"):
                self.server.kill()
                self.killed.set()
                return
            time.sleep(0.01)


class _BigModel(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("big", torch.zeros(64 * 2**20 // 4))  # 64 MB: s3fs uploads it in 50 MB parts


def test_server_killed_mid_save_previous_checkpoint_resumes(s3_server_factory, monkeypatch):
    server = s3_server_factory()
    bucket = server.new_bucket()
    dirpath, options = f"s3://{bucket}/run", server.storage_options()
    options["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 2}
    _use_env_credentials(monkeypatch, server)

    def trainer(max_epochs):
        callback = DCPModelCheckpoint(dirpath, every_n_epochs=1, save_top_k=-1, save_last="link")
        io = DCPCheckpointIO(storage_options=options, thread_count=2)  # the small file lands, the big one breaks
        return make_trainer(1, strategy="dcp_single_device", max_epochs=max_epochs, callbacks=[callback], plugins=[io])

    seed()
    first = trainer(1)
    first.fit(_BigModel(), datamodule=RandomDataModule())
    saved = snapshot(first)

    killer = _KillWhenUploading(server, bucket, options)
    killer.start()
    with pytest.raises(Exception):  # noqa: B017 (any failure: the server is gone mid-upload)
        trainer(2).fit(_BigModel(), datamodule=RandomDataModule(), ckpt_path="last")
    killer.stop.set()
    assert killer.killed.is_set(), "the save finished before the server could be killed"
    server.restart()

    broken = Location(f"{dirpath}/epoch=1-step=32.ckpt", storage_options=options)
    assert broken.exists() and not broken.is_committed()  # data of the interrupted save, no commit marker
    resumed = trainer(1)
    resumed.fit(_BigModel(), datamodule=RandomDataModule(), ckpt_path="last")
    assert resumed.ckpt_path == dirpath + "/epoch=0-step=16.ckpt/.commit"  # the newest committed one
    assert_same(saved["params"], snapshot(resumed)["params"], "params")
    assert not broken.exists()  # removed by DCPModelCheckpoint when fitting started
