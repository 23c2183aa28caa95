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

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, StorageUnavailableError
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.stores import S3_TIMEOUTS
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
