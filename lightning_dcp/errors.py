"""The exceptions lightning_dcp raises: one shallow hierarchy under :class:`CheckpointError`.

Each also derives from the builtin a caller would already catch (``FileNotFoundError``, ``ValueError``), so code
written against Lightning's own checkpoint errors keeps working.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

__all__ = [
    "BucketNotFoundError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "StateDictMismatchError",
    "StorageAccessError",
    "checkpoint_not_found",
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
    """The storage server refused the credentials (wrong key or secret, or no permission on the bucket)."""


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
    """

    def __init__(
        self,
        path: str,
        *,
        missing_keys: Iterable[str] = (),
        unexpected_keys: Iterable[str] = (),
        mismatched: dict[str, tuple] | None = None,
    ) -> None:
        self.path = path
        self.missing_keys = sorted(missing_keys)
        self.unexpected_keys = sorted(unexpected_keys)
        self.mismatched = dict(mismatched or {})
        lines = [f"The checkpoint at {path!r} does not match the model it is loaded into."]
        if self.missing_keys:
            lines.append(f"Missing keys ({len(self.missing_keys)}): {_preview(self.missing_keys)}.")
        if self.unexpected_keys:
            lines.append(f"Unexpected keys ({len(self.unexpected_keys)}): {_preview(self.unexpected_keys)}.")
        for fqn, (saved_shape, saved_dtype, shape, dtype) in sorted(self.mismatched.items())[:8]:
            lines.append(f"{fqn!r}: saved shape {tuple(saved_shape)} {saved_dtype}, expected {tuple(shape)} {dtype}.")
        lines.append(
            "Load a checkpoint of this model, or set `LightningModule.strict_loading = False` to load only the"
            " keys both have (shapes must still match)."
        )
        super().__init__(" ".join(lines))


def checkpoint_failure(err: BaseException, context: str) -> Exception:
    """Turn a failed save or load into one ``Exception`` whose message says where it failed and how to fix it.

    DCP's ``CheckpointException`` (a ``BaseException``) holds each rank's failure; its first failure is used.
    """
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict):
        if isinstance(err, CheckpointError):
            return err
        return CheckpointError(f"{context}: {describe_failure(err)}")
    for rank, wrapped in sorted(failures.items()):
        failure = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # DCP stores (exception, traceback)
        if isinstance(failure, CheckpointError):
            return failure
        if isinstance(failure, Exception):
            return CheckpointError(f"{context} on rank {rank}: {describe_failure(failure)}")
    return CheckpointError(f"{context}: {err}")


def describe_failure(err: BaseException) -> str:
    """``Type: message`` plus the fix, for the failures a user can act on."""
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        text += ". The disk is full: free space or save elsewhere; earlier checkpoints are intact."
    elif isinstance(err, PermissionError):
        text += ". Check that every rank may write to the checkpoint directory."
    return text
