"""S3-only Trainer cases against a real S3 server (SeaweedFS, enforced keys): failures, a server killed mid-save.

The DDP save / resume / consolidate round trip runs on every remote store in ``test_remote_trainer.py``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, StorageUnavailableError
from lightning_dcp.engine.load.dcp_reader import storage_reader
from lightning_dcp.engine.save import planning
from lightning_dcp.engine.save.dcp_io import storage_writer
from lightning_dcp.engine.storage.location import Location
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed, snapshot


def _use_env_credentials(monkeypatch, server) -> None:
    import s3fs

    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # a plain S3FileSystem() made under other variables is cached


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


@pytest.mark.full
def test_server_killed_mid_save_previous_checkpoint_resumes(s3_server_factory, monkeypatch):
    server = s3_server_factory()
    bucket = server.new_bucket()
    dirpath, options = f"s3://{bucket}/run", server.storage_options()
    options["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 2}
    _use_env_credentials(monkeypatch, server)
    # Keep the 64 MB buffer in one record (not split into 32 MB chunks over both files): one file then needs a
    # multipart upload, which is when the server is killed.
    monkeypatch.setattr(planning, "CHUNK_BYTES", 1 << 30)

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
    with pytest.raises(StorageUnavailableError, match=rf"{dirpath}/epoch=1-step=32\.ckpt.*cannot be reached"):
        trainer(2).fit(_BigModel(), datamodule=RandomDataModule(), ckpt_path="last")  # the server is gone mid-upload
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
