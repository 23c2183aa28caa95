"""The fsspec defaults DCPModelCheckpoint sets while Lightning stats the "last" candidate: scoped and restored."""

from __future__ import annotations

import fsspec
import pytest
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_dcp.trainer.model_checkpoint import _STAT_DEFAULTS


@pytest.fixture
def user_config(monkeypatch):
    monkeypatch.setitem(fsspec.config.conf, "s3", {"anon": False, "default_block_size": 123})
    yield fsspec.config.conf["s3"]


def test_storage_options_reach_a_bare_filesystem_only_while_set(user_config):
    pytest.importorskip("s3fs")
    options = {"key": "AKIA-scoped", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    _STAT_DEFAULTS.set("s3://bucket/run/a.ckpt/.commit", options)
    try:
        fs = get_filesystem("s3://bucket/run/a.ckpt/.commit")  # what Lightning's connector builds
        assert fs.key == "AKIA-scoped" and fs.default_block_size == 123  # ours over the user's own defaults
        _STAT_DEFAULTS.set("s3://bucket/run/b.ckpt/.commit", {"key": "second"})  # a second callback
    finally:
        _STAT_DEFAULTS.restore()
    assert fsspec.config.conf["s3"] == {"anon": False, "default_block_size": 123}  # exactly the user's again
    assert get_filesystem("s3://bucket/x").key is None
    _STAT_DEFAULTS.restore()  # idempotent
    _STAT_DEFAULTS.set("gs://bucket/x", {"token": "anon"})
    _STAT_DEFAULTS.restore()
    assert "gs" not in fsspec.config.conf  # a protocol the user never configured is left unconfigured
