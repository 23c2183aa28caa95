"""The names inside a checkpoint directory, and the ``.commit`` marker that makes it a checkpoint.

A lightning_dcp checkpoint is a DCP directory (``.metadata`` plus ``__{rank}_{n}.distcp`` data files) with one more
file, ``.commit``, written last by the coordinator once every rank finished: a JSON object with the checksum of
``.metadata`` and of every record of every data file. A directory without it is never treated as a checkpoint.

The marker carries a checksum of its own (:data:`SEAL_KEY`, the first key of the object: the checksum of the rest of
the bytes), so an edit of the marker after commit (two names of the record index swapped, two records' places
swapped) is refused rather than trusted: the record index is what a restore reads tensors by, without ``.metadata``.
Like every checksum here it has no key: it refuses damage and edits that leave it stale, not a marker whose writer
recomputed it (``docs/integrity.md`` says what is and is not detected).

This module holds the format only (no I/O): :mod:`lightning_dcp.engine.storage.location` reads markers, the writer in
:mod:`lightning_dcp.engine.save.dcp_io` encodes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from typing import Any

import xxhash

__all__ = [
    "CHECKSUM",
    "COMMIT_FILE",
    "DATA_SUFFIX",
    "LIGHTNING_META_FILE",
    "METADATA_FILE",
    "SEAL_KEY",
    "ORDER_TAIL_BYTES",
    "MarkerError",
    "checkpoint_kind",
    "checksum",
    "encode_commit",
    "is_marker_path",
    "is_plain_name",
    "is_run_token",
    "order_at_end",
    "order_key",
    "parse_commit",
    "run_of",
    "seal",
]

METADATA_FILE = ".metadata"
"""DCP's metadata file; DCP's coordinator writes it after every rank finished writing data."""
COMMIT_FILE = ".commit"
"""lightning_dcp's commit marker (JSON: checksums and sizes), written last."""
LIGHTNING_META_FILE = "meta.pt"
"""The non-tensor Trainer state in Lightning's own sharded checkpoint directories (beside DCP's files)."""
DATA_SUFFIX = ".distcp"
"""DCP's data file suffix: ``__{rank}_{n}.distcp``."""
CHECKSUM = "xxh3_64"
"""Checksum of every record and of ``.metadata``: 64-bit xxHash3 (~26 GB/s here, vs ~2 GB/s for zlib's CRC32)."""
FORMAT = "lightning_dcp"
VERSION = 1
SEAL_KEY = "marker_checksum"
"""The marker's own checksum: written first, ``{"marker_checksum": N, ...}``, ``N`` the :data:`CHECKSUM` of the
marker's bytes without it (``{`` followed by everything after ``N, ``)."""
_SEAL_PREFIX = b'{"' + SEAL_KEY.encode() + b'": '
_KEYS = frozenset({SEAL_KEY, "format", "version", "algorithm", "committed_at", "metadata", "files", "order", "index"})
"""Every key a marker of :data:`VERSION` may have (:func:`encode_commit` writes them)."""


def checksum(data: Any) -> int:
    """The :data:`CHECKSUM` of a bytes-like object, as an unsigned 64-bit integer."""
    return xxhash.xxh3_64_intdigest(data)


def encode_commit(
    *,
    metadata_bytes: bytes,
    files: dict[str, dict[str, Any]],
    order: dict[str, Any] | None = None,
    index: dict[str, Any] | None = None,
) -> bytes:
    """The ``.commit`` marker for a checkpoint whose ``.metadata`` holds ``metadata_bytes``.

    Args:
        metadata_bytes: The exact bytes of ``.metadata``.
        files: ``{file name: {"size": bytes, "records": [[offset, length, checksum], ...]}}`` for every data file.
        order: ``{"counter": int, "step": int | None, "run": str | None}``: the save's place in its directory (see
            :func:`order_key`) and the run that saved it (:func:`run_of`). ``None`` writes no order (such a
            checkpoint counts as older than every ordered one).
        index: The record index (:mod:`lightning_dcp.engine.format.record_index`): what each record holds, so that a
            restore need not read ``.metadata``. ``None`` writes none.
    """
    marker: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "algorithm": CHECKSUM,
        "committed_at": time.time(),  # informational: never used to order checkpoints
        "metadata": {"size": len(metadata_bytes), "checksum": checksum(metadata_bytes)},
        "files": files,
    }
    if order is not None:
        marker["order"] = {"counter": int(order["counter"]), "step": order.get("step")}
        if order.get("run") is not None:
            marker["order"]["run"] = str(order["run"])
    if index is not None:
        marker["index"] = index
    return seal(json.dumps(marker, sort_keys=True).encode())


def seal(body: bytes) -> bytes:
    """``body`` (a JSON object's bytes) with its checksum inserted as the first key, :data:`SEAL_KEY`."""
    if not body.startswith(b"{") or body.startswith(b"{}"):
        raise ValueError("a marker is a non-empty JSON object")
    return _SEAL_PREFIX + str(checksum(body)).encode() + b", " + body[1:]


def _check_seal(data: bytes, marker: dict[str, Any]) -> None:
    """A marker that carries :data:`SEAL_KEY` matches it (one hash of its bytes, ~10 us per MB)."""
    if SEAL_KEY not in marker:
        return  # written before markers were sealed: readable, but its record index is not used
    if not data.startswith(_SEAL_PREFIX):
        raise MarkerError(f"its own checksum ({SEAL_KEY!r}) is not its first key: it was rewritten after commit")
    end = data.find(b", ", len(_SEAL_PREFIX))
    digits = data[len(_SEAL_PREFIX) : end]
    hasher = xxhash.xxh3_64(b"{")
    hasher.update(memoryview(data)[end + 2 :])
    if end < 0 or not digits.isdigit() or int(digits) != marker[SEAL_KEY] or hasher.intdigest() != int(digits):
        raise MarkerError(
            f"it does not match its own checksum ({SEAL_KEY!r}): it was edited or damaged after commit (its record"
            " index could name the wrong tensors)"
        )


def order_key(marker: dict[str, Any]) -> tuple[int, int, float]:
    """The sort key of a parsed marker: larger is newer. ``(counter, step, committed_at)``.

    Which checkpoint of a directory is the newest never depends on a wall clock: the clocks of the machines that
    saved them may be skewed or stepped back. ``counter`` is the directory's save counter (one more than the largest
    the saving process saw in the directory, then one more per save), so a run that resumed from an older checkpoint
    and saved again is newer than everything it resumed over (a rewind stays rewound); ``step`` (the global step)
    breaks ties. Markers written before the order existed have ``counter`` 0: older than every ordered checkpoint,
    ordered among themselves by ``committed_at`` (the only order they carry).
    """
    order = marker.get("order")
    if order is None:
        return (0, -1, float(marker["committed_at"]))
    step = order.get("step")
    return (order["counter"], -1 if step is None else step, 0.0)


def run_of(marker: dict[str, Any]) -> str | None:
    """The run that saved the checkpoint of a parsed marker; ``None`` when it recorded none (saved before runs were).

    A run is a line of training: a fit that starts fresh begins a new run (a random token), a fit that resumes a
    checkpoint continues that checkpoint's run, whatever process, job or world size does it. ``ckpt_path="last"``
    follows the run its ``last`` entry names (:func:`lightning_dcp.engine.catalog.lookup.candidates`).
    """
    order = marker.get("order")
    return order.get("run") if isinstance(order, dict) else None


MAX_MARKER_BYTES = 64 << 20
"""Largest ``.commit`` accepted (a checkpoint of 100k records writes ~6 MB)."""


class MarkerError(ValueError):
    """A ``.commit`` marker that is not what lightning_dcp writes (the caller names the file)."""


def parse_commit(data: bytes) -> dict[str, Any]:
    """Decode and validate a ``.commit`` marker: every field present, of the right type and in range.

    Returns:
        ``{"committed_at": float, "metadata": {"size", "checksum"}, "files": {name: {"size", "records"}}, ...}``
        (``"order": {"counter", "step"}`` too when the writer recorded it)
        where every file name is a plain name inside the checkpoint directory and every record
        ``[offset, length, checksum]`` lies within its file's size.

    A marker that carries its own checksum (:data:`SEAL_KEY`, as :func:`encode_commit` writes) must match it; one
    written before markers were sealed is accepted (without it,
    :func:`~lightning_dcp.engine.format.record_index.parse_index` does not use its record index).

    Raises:
        MarkerError: Not valid JSON, its own checksum does not match, or any field missing, mistyped or out of range.
    """
    if len(data) > MAX_MARKER_BYTES:
        raise MarkerError(f"it is {len(data)} bytes, more than the {MAX_MARKER_BYTES} a marker can be")
    try:
        marker = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise MarkerError(f"it is not valid JSON ({err})") from None
    if not isinstance(marker, dict):
        raise MarkerError(f"it holds a JSON {type(marker).__name__}, not an object")
    _check_seal(data, marker)
    if marker.get("format") != FORMAT or marker.get("version") != VERSION or marker.get("algorithm") != CHECKSUM:
        raise MarkerError(
            f"format {marker.get('format')!r} version {marker.get('version')!r} algorithm"
            f" {marker.get('algorithm')!r}; expected {FORMAT!r} {VERSION} {CHECKSUM!r}"
        )
    unknown = sorted(set(marker) - _KEYS)
    if unknown:  # a damaged key (its own checksum's name, say) would otherwise pass for a marker written unsealed
        raise MarkerError(f"it has keys no marker of version {VERSION} has ({', '.join(map(repr, unknown[:4]))})")
    if not _number(marker.get("committed_at")):
        raise MarkerError("'committed_at' is not a number")
    order = marker.get("order")
    if order is not None and not _valid_order(order):
        raise MarkerError(
            "'order' must hold a positive integer 'counter', a non-negative integer or null 'step' and, if any, a"
            " 'run' of 1-64 letters and digits"
        )
    meta = marker.get("metadata")
    if not isinstance(meta, dict) or not _uint(meta.get("size")) or not _uint(meta.get("checksum")):
        raise MarkerError("'metadata' must hold a non-negative integer 'size' and 'checksum'")
    files = marker.get("files")
    if not isinstance(files, dict):
        raise MarkerError("'files' is not an object")
    for name, entry in files.items():
        if not is_plain_name(name):
            raise MarkerError(f"file name {name!r} is not a plain name inside the checkpoint directory")
        if not isinstance(entry, dict) or not _uint(entry.get("size")) or not isinstance(entry.get("records"), list):
            raise MarkerError(f"entry of {name!r} must hold an integer 'size' and a 'records' list")
        size = entry["size"]
        for record in entry["records"]:  # thousands per file: JSON gives exact ints and lists, checked inline
            if type(record) is not list or len(record) != 3:
                raise MarkerError(f"a record of {name!r} is not [offset, length, checksum] (non-negative integers)")
            offset, length, digest = record
            if not (
                type(offset) is int
                and type(length) is int
                and type(digest) is int
                and 0 <= offset < 2**64
                and 0 <= length < 2**64
                and 0 <= digest < 2**64
            ):
                raise MarkerError(f"a record of {name!r} is not [offset, length, checksum] (non-negative integers)")
            if offset + length > size:
                raise MarkerError(f"a record of {name!r} ends at byte {offset + length}, past its size")
    return marker


ORDER_TAIL_BYTES = 4096
"""How many bytes at the end of a ``.commit`` marker :func:`order_at_end` reads the order from."""
_END = b', "version": ' + str(VERSION).encode() + b"}"
_ORDER_AT = b', "order": '


def order_at_end(tail: bytes) -> dict[str, Any] | None:
    """The ``order`` of a marker read from its last bytes alone, or ``None`` when they do not show it plainly.

    :func:`encode_commit` writes sorted keys, so a marker it wrote ends ``, "order": {...}, "version": 1}``: the order
    (:func:`order_key`, :func:`run_of`) of a checkpoint is in its last :data:`ORDER_TAIL_BYTES` bytes, whatever the size
    of its records and index before it (a checkpoint of 2,800 tensors writes an 840 KB marker). A listing that only
    ranks checkpoints reads that much of each marker; whatever it then opens is read and checked whole
    (:func:`parse_commit`). A quote inside a JSON string is escaped, so ``, "order": `` followed by one object and
    exactly that end can only be the marker's own last but one key.

    Args:
        tail: The last bytes of a marker (at most :data:`ORDER_TAIL_BYTES`; the whole marker works too).

    Returns:
        ``{"counter": int, "step": int | None, "run": str}`` (``run`` when recorded), checked as :func:`parse_commit`
        checks it; ``None`` for anything else (a marker without an order, another writer's layout, damage at its end):
        the caller then reads the whole marker, which says what is wrong.
    """
    if not tail.endswith(_END):
        return None
    at = tail.rfind(_ORDER_AT)
    if at < 0:
        return None
    try:
        text = tail[at + len(_ORDER_AT) : len(tail) - len(_END)].decode()
        order, end = json.JSONDecoder().raw_decode(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return order if end == len(text) and _valid_order(order) else None


def _valid_order(order: object) -> bool:
    """Whether ``order`` is an ``order`` field a marker may hold (see :func:`encode_commit`)."""
    return (
        isinstance(order, dict)
        and _uint(order.get("counter"))
        and order["counter"] > 0
        and (order.get("step") is None or _uint(order.get("step")))
        and (order.get("run") is None or is_run_token(order.get("run")))
    )


def checkpoint_kind(names: Collection[str]) -> str | None:
    """Which kind of checkpoint directory holds the entries ``names``: ``"dcp"``, ``"lightning"`` or ``None``.

    ``"dcp"``: a committed lightning_dcp checkpoint (its ``.commit``) or a plain DCP directory (``.metadata``
    without :data:`LIGHTNING_META_FILE`); ``"lightning"``: Lightning's own sharded layout (with it); ``None``:
    neither (an ordinary directory).
    """
    if COMMIT_FILE in names or (METADATA_FILE in names and LIGHTNING_META_FILE not in names):
        return "dcp"
    return "lightning" if LIGHTNING_META_FILE in names else None


def is_marker_path(path: str) -> bool:
    """Whether ``path`` (a path or URL, no I/O) names a checkpoint's ``.commit`` marker rather than a checkpoint."""
    return path.rstrip("/").rpartition("/")[2] == COMMIT_FILE


def is_plain_name(name: object) -> bool:
    """Whether ``name`` names an entry directly inside a directory: no separator, not ``.``/``..``, printable."""
    return (
        isinstance(name, str)
        and 0 < len(name) <= 255
        and name not in (".", "..")
        and "/" not in name
        and "\\" not in name
        and name.isprintable()
    )


def is_run_token(value: object) -> bool:
    """Whether ``value`` is a run token a marker may carry: 1-64 ASCII letters and digits."""
    return isinstance(value, str) and 0 < len(value) <= 64 and value.isascii() and value.isalnum()


def _uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN
