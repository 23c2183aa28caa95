"""Shared pytest fixtures: the SeaweedFS S3 server (``s3_server``, ``s3_bucket``, ``s3_server_factory``)."""

from tests._s3 import s3_bucket, s3_server, s3_server_factory  # noqa: F401  (fixtures, registered by import)
