"""Shared pytest fixtures: the storage servers (SeaweedFS for S3, fake-gcs-server for GCS, Azurite for Azure)."""

from tests._s3 import s3_bucket, s3_server, s3_server_factory  # noqa: F401  (fixtures, registered by import)
from tests._stores import azure_server, gcs_server, remote_store  # noqa: F401
