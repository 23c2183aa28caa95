"""Reading a checkpoint's own files through a Location: its ``.commit`` marker; files that cannot be read."""

from __future__ import annotations

from typing import Any

from lightning_dcp.engine.format.marker import (
    COMMIT_FILE,
    MAX_MARKER_BYTES,
    ORDER_TAIL_BYTES,
    MarkerError,
    order_at_end,
    parse_commit,
)
from lightning_dcp.errors import (
    BucketNotFoundError,
    CheckpointError,
    CorruptCheckpointError,
    StorageAccessError,
    StorageUnavailableError,
)

__all__ = ["permission_message", "read_commit", "read_commit_orders", "unreadable"]


def read_commit(location: Any) -> dict[str, Any] | None:
    """The validated ``.commit`` marker of ``location``, or ``None`` when the checkpoint was never committed.

    Raises:
        CorruptCheckpointError: The marker exists but is not a valid lightning_dcp marker, or a local marker cannot
            be read (a symlink loop, a name too long; the message says why).
    """
    try:
        with location.open(COMMIT_FILE) as f:
            data = f.read(MAX_MARKER_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError as err:
        raise CorruptCheckpointError(f"{location.url!r}: {COMMIT_FILE} is a directory.", file=COMMIT_FILE) from err
    except OSError as err:
        raise unreadable(location, COMMIT_FILE, err) from err
    try:
        return parse_commit(data)
    except MarkerError as err:
        raise CorruptCheckpointError(
            f"{location.url!r}: {COMMIT_FILE} is not a valid lightning_dcp commit marker: {err}. Resume from another"
            " checkpoint, or restore this directory.",
            file=COMMIT_FILE,
        ) from None


def read_commit_orders(directory: Any, names: list[str]) -> list[dict[str, Any] | CheckpointError | None]:
    """What ranking the checkpoints ``names`` of ``directory`` needs of their ``.commit`` markers, read together.

    For each, its marker's last :data:`~lightning_dcp.engine.format.marker.ORDER_TAIL_BYTES` bytes
    (:meth:`~lightning_dcp.engine.storage.location.Location.read_ends`: on an object store, one ranged request per
    marker, all in flight together) and, when they show the order
    (:func:`~lightning_dcp.engine.format.marker.order_at_end`), ``{"order": ...}`` without reading or checking the
    rest; otherwise the whole marker, as :func:`read_commit` returns it, or the ``CheckpointError`` it raises (a
    malformed or refused marker: the caller skips that checkpoint); ``None`` where there is no marker. A marker
    damaged before its end is not seen here: whatever loads the checkpoint reads its marker whole and refuses it then.

    Raises:
        CheckpointError: The store as a whole cannot be read (unreachable, credentials refused, no such bucket):
            a listing that looked empty would let ``ckpt_path="last"`` start from scratch.
    """
    ends = directory.read_ends([f"{name}/{COMMIT_FILE}" for name in names], ORDER_TAIL_BYTES)
    out: list[dict[str, Any] | CheckpointError | None] = []
    for name, end in zip(names, ends, strict=True):
        if isinstance(end, (FileNotFoundError, NotADirectoryError)):
            out.append(None)
            continue
        if isinstance(end, CheckpointError):
            out.append(end)
            continue
        order = None if isinstance(end, OSError) else order_at_end(end)
        if order is not None:
            out.append({"order": order})
            continue
        try:
            out.append(read_commit(directory.child(name)))
        except (StorageUnavailableError, BucketNotFoundError):
            raise  # the store, not this checkpoint: never a listing that looks empty
        except CheckpointError as err:  # this marker only (malformed, refused): the caller skips it
            out.append(err)
    return out


def unreadable(location: Any, name: str, err: OSError) -> CheckpointError:
    """The error for the file ``name`` of a local checkpoint that exists but cannot be read.

    A symlink loop or a name too long is a fact about the checkpoint (``CorruptCheckpointError``); a permission the
    user lacks is not (``StorageAccessError``, "permission denied"); a remote store's failure is raised again as it
    is.
    """
    if not location.local or isinstance(err, CheckpointError):
        raise err
    if isinstance(err, PermissionError):
        return StorageAccessError(permission_message(f"{location.url}/{name}", reading=True))
    return CorruptCheckpointError(f"{location.url!r}: {name} cannot be read ({err}).", file=name)


def permission_message(path: str, *, reading: bool | None = None) -> str:
    """The message of a ``StorageAccessError`` for a local path the operating system refused (``EACCES``).

    ``reading``: the refused access was a read (``True``), a write (``False``) or either (``None``).
    """
    need = {
        True: "read every file of the checkpoint",
        False: "write into the checkpoint directory",
        None: "read and write the checkpoint directory",
    }[reading]
    return (
        f"Permission denied: {path!r}. The user running this process (on every rank) must be able to {need}: check"
        " the permissions of that path and of the directories above it."
    )
