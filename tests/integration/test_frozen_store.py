"""A store that hangs fails a resume in bounded time (issue 40, item 6).

A SeaweedFS server stopped with SIGSTOP still accepts connections (the kernel completes the handshake) but never
answers: with botocore's defaults (60 s per read, retried) under s3fs' own retries, ``fit(ckpt_path="last")`` waited
in the listing of ``dirpath`` for minutes. Every ``s3://`` location now carries a timeout for each request
(``S3_TIMEOUTS``, overridable in ``storage_options['config_kwargs']``) and the failure is a
``StorageUnavailableError`` that names the store and the setting.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, StorageUnavailableError
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.stores import S3_TIMEOUTS
from lightning_dcp.engine.tiers.uploader import Retry
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed

pytest.importorskip("s3fs")


def test_s3_locations_get_request_timeouts_unless_set():
    options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    config = Location("s3://bucket/run", storage_options=options).storage_options["config_kwargs"]
    assert config == S3_TIMEOUTS and config["read_timeout"] <= 10 and config["connect_timeout"] <= 10
    mine = {**options, "config_kwargs": {"read_timeout": 30, "retries": {"max_attempts": 1}}}
    config = Location("s3://bucket/run", storage_options=mine).storage_options["config_kwargs"]
    assert config == {"read_timeout": 30, "retries": {"max_attempts": 1}, "connect_timeout": 5}
    assert "config_kwargs" not in Location("memory://run", storage_options={}).storage_options
    assert mine["config_kwargs"] == {"read_timeout": 30, "retries": {"max_attempts": 1}}  # the caller's dict as given


def _trainer(dirpath: str, options: dict, **kwargs):
    callback = DCPModelCheckpoint(dirpath, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    io = DCPCheckpointIO(storage_options=options)
    return make_trainer(1, strategy="dcp_single_device", max_epochs=-1, callbacks=[callback], plugins=[io], **kwargs)


@pytest.mark.full
def test_a_stopped_server_fails_a_resume_in_bounded_time_naming_the_setting(s3_server_factory, monkeypatch):
    """The defaults bound the wait (shortened here from 5 s to 1 s per read, so the test takes ~20 s, not ~55 s)."""
    monkeypatch.setitem(S3_TIMEOUTS, "read_timeout", 1)
    server = s3_server_factory()
    dirpath = f"s3://{server.new_bucket()}/run"
    options = server.storage_options()  # no timeouts of the caller's
    seed()
    _trainer(dirpath, options, max_steps=4).fit(TinyModel(), datamodule=RandomDataModule(n=16))
    assert Location(f"{dirpath}/step=4.ckpt", storage_options=options).is_committed()
    os.killpg(server.proc.pid, signal.SIGSTOP)
    thaw = threading.Timer(120.0, lambda: os.killpg(server.proc.pid, signal.SIGCONT))  # the old code hung on
    thaw.start()
    started = time.monotonic()
    try:
        with pytest.raises(StorageUnavailableError) as err:
            _trainer(dirpath, options, max_steps=8).fit(
                TinyModel(), datamodule=RandomDataModule(n=16), ckpt_path="last"
            )
        elapsed = time.monotonic() - started
    finally:
        thaw.cancel()
        os.killpg(server.proc.pid, signal.SIGCONT)
    message = str(err.value)
    assert elapsed < 60, f"the resume took {elapsed:.0f} s to fail"
    assert dirpath in message and "did not answer" in message and "read_timeout" in message


class _FreezeAt(Callback):
    """Stops the store (SIGSTOP) after training step ``step``; notes when training ended (teardown starts then)."""

    def __init__(self, server, step: int) -> None:
        self.server, self.step, self.ended = server, step, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.killpg(self.server.proc.pid, signal.SIGSTOP)

    def on_train_end(self, trainer, pl_module) -> None:
        self.ended = time.monotonic()


def test_a_stopped_store_ends_a_tiered_teardown_at_its_one_deadline(s3_server_factory, tmp_path):
    """Issue 51: with the store stopped, teardown waited for the first request to time out (s3fs' retries: ~50 s) and
    only then for ``at_teardown`` (60 s): ~111 s. Now one deadline covers the wait (3 s here), hanging requests too."""
    server = s3_server_factory()
    dirpath = f"s3://{server.new_bucket()}/run"
    options = server.storage_options()  # the default request timeouts
    seed()
    freeze = _FreezeAt(server, step=3)
    callback = DCPModelCheckpoint(
        dirpath, filename="{step}", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max"
    )
    io = DCPCheckpointIO(storage_options=options, local_dir=str(tmp_path / "local"))
    io.tiers.retry = Retry(at_teardown=3.0)
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=5, callbacks=[callback, freeze], plugins=[io])
    thaw = threading.Timer(150.0, lambda: os.killpg(server.proc.pid, signal.SIGCONT))  # the old code waits ~111 s
    thaw.start()
    try:
        with pytest.raises(StorageUnavailableError) as err:
            trainer.fit(TinyModel(), datamodule=RandomDataModule(n=16))
        waited = time.monotonic() - freeze.ended
    finally:
        thaw.cancel()
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert trainer.global_step == 5 and 3.0 <= waited < 6.0, f"teardown took {waited:.1f} s"
    message = str(err.value)
    assert "the wait for the uploads ended after 3 s without an answer" in message, message
    assert "'step=5.ckpt'" in message and str(tmp_path / "local") in message  # what is left, and where it is
    local = {loc.name for _, loc in committed_checkpoints(Location(str(tmp_path / "local")))}
    assert {"step=4.ckpt", "step=5.ckpt"} <= local  # top-2 committed locally: the next run uploads them
