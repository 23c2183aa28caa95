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


_TIER_ORDER = ("unit", "lightning_suite", "integration", "distributed", "setups", "chaos", "gpu")


def pytest_collection_modifyitems(config, items):
    """Runs the quick tiers first (unit, then integration, then the multi-process distributed tests), each in its
    collection order, so that the test command shows progress from its first seconds instead of starting with minutes
    of silent multi-process runs."""

    def tier(item) -> int:
        parts = item.nodeid.split("/")
        name = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        return _TIER_ORDER.index(name) if name in _TIER_ORDER else len(_TIER_ORDER)

    items[:] = sorted(items, key=tier)  # sorted() is stable: the order inside a tier is kept
