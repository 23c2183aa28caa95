"""The exceptions lightning_dcp raises: one shallow hierarchy under :class:`CheckpointError`.

Each also derives from the builtin a caller would already catch (``FileNotFoundError``, ``ValueError``), so code
written against Lightning's own checkpoint errors keeps working.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable, Iterable

__all__ = [
    "BucketNotFoundError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "InvalidPathError",
    "NotACheckpointError",
    "OutputExistsError",
    "StateDictMismatchError",
    "StorageAccessError",
    "StorageUnavailableError",
    "checkpoint_failure",
    "checkpoint_not_found",
    "describe_failure",
    "describe_load_error",
]


class CheckpointError(Exception):
    """Base class of every error lightning_dcp raises about a checkpoint."""

    def __reduce__(self):  # errors travel between ranks (broadcast): keep the message and the attributes
        return (_restore, (type(self), self.args, dict(self.__dict__)))


def _restore(cls: type, args: tuple, state: dict) -> CheckpointError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist."""


def checkpoint_not_found(path: str, *, designated_by: str | None = None) -> CheckpointNotFoundError:
    """The error for a checkpoint path that does not exist, worded as Lightning words it.

    Lightning's ``TorchCheckpointIO.load_checkpoint`` raises ``FileNotFoundError(f"Checkpoint file not found:
    {path}")`` (2.6.6); code that matches that type and message keeps working with lightning_dcp.

    Args:
        path: The missing path, as given (local path or URL).
        designated_by: The ``last`` link or pointer that named ``path``, if any.
    """
    message = f"Checkpoint file not found: {path}"
    if designated_by is not None:
        message += f" (designated by {designated_by})"
    return CheckpointNotFoundError(message)


class StorageAccessError(CheckpointError, PermissionError):
    """The storage refused to be written or read: wrong credentials, no permission, or a read-only filesystem.

    The storage server refused the credentials (wrong key or secret, or no permission on the bucket); or a local path
    is not writable (permissions, a filesystem mounted read-only). The message names the path and the fix; the
    checkpoints saved before are intact.
    """


class StorageUnavailableError(CheckpointError, ConnectionError):
    """The storage server cannot be reached (connection refused or reset, timeouts, server errors after retries).

    With a local tier (``local_dir``) saves go on locally and their uploads are retried; without one the save or load
    that met it fails with this error, naming the URL.
    """


class InvalidPathError(CheckpointError, ValueError):
    """A checkpoint path or URL that the storage cannot round-trip.

    ``..`` or ``.`` segments and ``?`` or ``#`` in an object store URL, control characters anywhere; the message names
    the path and the fix.
    """


class OutputExistsError(CheckpointError, FileExistsError):
    """An output path (``consolidate -o``) exists and is not something the tool may replace."""


class BucketNotFoundError(CheckpointNotFoundError):
    """The bucket (or container) named in a checkpoint URL does not exist."""


class NotACheckpointError(CheckpointError, ValueError):
    """The path exists but holds no complete checkpoint that lightning_dcp can read."""


class CorruptCheckpointError(NotACheckpointError):
    """A checkpoint's files do not match the checksums recorded when it was saved (bit flip, truncation).

    Attributes:
        file: The file (relative to the checkpoint directory) that failed verification.
    """

    def __init__(self, message: str, *, file: str) -> None:
        super().__init__(message)
        self.file = file


def _preview(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


class StateDictMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer it is loaded into.

    Attributes:
        path: The checkpoint path (a ``str``: local path or URL).
        missing_keys: FQNs the target expects but the checkpoint lacks.
        unexpected_keys: FQNs the checkpoint holds but the target lacks.
        mismatched: ``{fqn: (saved_shape, saved_dtype, expected_shape, expected_dtype)}``.

    Args:
        reason: What does not match when it is not a list of keys (e.g. the number of optimizers), with its fix.
        hint: Replaces the closing advice of the message (the default names the Trainer's ``strict_loading``).
    """

    def __init__(
        self,
        path: str,
        *,
        missing_keys: Iterable[str] = (),
        unexpected_keys: Iterable[str] = (),
        mismatched: dict[str, tuple] | None = None,
        reason: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.path = path
        self.missing_keys = sorted(missing_keys)
        self.unexpected_keys = sorted(unexpected_keys)
        self.mismatched = dict(mismatched or {})
        lines = [f"The checkpoint at {path!r} does not match the model it is loaded into."]
        if reason is not None:
            lines.append(reason)
        if self.missing_keys:
            lines.append(f"Missing keys ({len(self.missing_keys)}): {_preview(self.missing_keys)}.")
        if self.unexpected_keys:
            lines.append(f"Unexpected keys ({len(self.unexpected_keys)}): {_preview(self.unexpected_keys)}.")
        for fqn, (saved_shape, saved_dtype, shape, dtype) in sorted(self.mismatched.items())[:8]:
            lines.append(f"{fqn!r}: saved shape {tuple(saved_shape)} {saved_dtype}, expected {tuple(shape)} {dtype}.")
        if hint is not None:
            lines.append(hint)
        elif reason is None:
            lines.append(
                "Load a checkpoint of this model, or set `LightningModule.strict_loading = False` to load only the"
                " keys both have (shapes must still match)."
            )
        super().__init__(" ".join(lines))


def checkpoint_failure(
    err: BaseException,
    context: str,
    *,
    rank: int | None = None,
    unreachable: Callable[[BaseException], bool] | None = None,
) -> Exception:
    """Turn a failed save or load into one ``Exception`` whose message says where it failed and how to fix it.

    Args:
        err: The failure. DCP's ``CheckpointException`` (a ``BaseException``) holds each rank's failure; the lowest
            failing rank's is used and named.
        context: What failed, e.g. ``"Saving the checkpoint to 's3://b/x' failed"`` (no rank in it).
        rank: The rank that saw ``err`` when it is not a ``CheckpointException``, to name it.
        unreachable: Tells a storage outage (the server cannot be reached) from other failures: such a failure
            becomes a :class:`StorageUnavailableError` (storage libraries are optional, so the caller knows them).
    """
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        if isinstance(err, CheckpointError):
            return err
        where = f" on rank {rank}" if rank is not None else ""
        return _error_type(err, unreachable)(f"{context}{where}: {describe_failure(err, unreachable)}")
    for failed_rank, wrapped in sorted(failures.items()):
        failure = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # DCP stores (exception, traceback)
        if isinstance(failure, CheckpointError):
            return failure
        if isinstance(failure, Exception):
            return _error_type(failure, unreachable)(
                f"{context} on rank {failed_rank}: {describe_failure(failure, unreachable)}"
            )
    return CheckpointError(f"{context}: {err}")


def _error_type(err: BaseException, unreachable: Callable[[BaseException], bool] | None) -> type[CheckpointError]:
    """The ``CheckpointError`` subclass a failure becomes: refused permissions and outages keep their builtin type."""
    if isinstance(err, PermissionError) or (isinstance(err, OSError) and err.errno == errno.EROFS):
        return StorageAccessError
    if unreachable is not None and unreachable(err):
        return StorageUnavailableError
    return CheckpointError


def describe_failure(err: BaseException, unreachable: Callable[[BaseException], bool] | None = None) -> str:
    """``Type: message`` plus the fix, for the failures a user can act on."""
    text = f"{type(err).__name__}: {err}"
    if unreachable is not None and unreachable(err):
        return (
            f"the storage server cannot be reached ({text}). Check the endpoint and the network; earlier checkpoints"
            " are intact, and with `local_dir` saves go on locally while the store is down."
        )
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        text += ". The disk is full: free space or save elsewhere; earlier checkpoints are intact."
    elif isinstance(err, OSError) and err.errno == errno.EROFS:
        where = f" of {err.filename!r}" if getattr(err, "filename", None) else ""
        text = (
            f"the filesystem{where} is mounted read-only ({text}). Save to a writable directory (the"
            " ModelCheckpoint's `dirpath`, or the path given), or remount it read-write; earlier checkpoints are"
            " intact."
        )
    elif isinstance(err, PermissionError):
        where = f" for {err.filename!r}" if getattr(err, "filename", None) else ""
        text = f"Permission denied{where} ({type(err).__name__}: {err})."
        text += " Check the permissions of that path: every rank must be able to read and write the checkpoints."
    return text


def describe_load_error(err: Exception) -> str:
    """A one-line reason from ``torch.load``'s error.

    Its weights-only messages span many lines and advise ``weights_only=False``, which is wrong for bytes that are
    simply not a checkpoint.
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error:" in line:
            detail = line.split("WeightsUnpickler error:", 1)[1].strip() or (lines[i + 1] if i + 1 < len(lines) else "")
            return f"weights-only unpickling: {detail}"
    return f"{type(err).__name__}: {lines[0] if lines else ''}"
