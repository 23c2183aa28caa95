"""Shared pytest fixtures: the storage servers (SeaweedFS for S3, fake-gcs-server for GCS, Azurite for Azure)."""

import os

import pytest

from tests._s3 import s3_bucket, s3_server, s3_server_factory  # noqa: F401  (fixtures, registered by import)
from tests._stores import azure_server, gcs_server, remote_store  # noqa: F401


@pytest.fixture(autouse=True)
def _restore_environ():
    """Each test leaves ``os.environ`` as it found it. A Trainer run in the test process sets ``LOCAL_RANK``,
    ``MASTER_PORT``, ...; a later test's training subprocess that inherits ``LOCAL_RANK`` takes its processes as
    launched by someone else and waits for ranks that never start."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
