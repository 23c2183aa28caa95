"""The names this library gives its own hidden entries beside a checkpoint, bounded to what a filesystem takes.

A save writes into a hidden sibling of its target (``.{name}.tmp-{token}``), a replaced checkpoint is moved aside as
``.{name}.tmp-old-{token}``, a copy across filesystems is made as ``.{name}.tmp-copy-{token}``, and the local tier
freezes a checkpoint for its upload as ``.upload-{name}-{token}``. Each adds up to 23 bytes to the checkpoint's name,
while stock Lightning writes any name up to the filesystem's limit (:data:`MAX_NAME_BYTES`, 255 bytes per component
on ext4, xfs, btrfs and tmpfs). A checkpoint name longer than :data:`SHORT_NAME_BYTES` therefore stands in these
names as a *tag*: its first bytes (cut at a character boundary), ``~`` and 16 hex digits of its SHA-256, between
229 and 232 bytes. Every hidden name fits in 255 bytes, and a tag is longer than any name used as it is, so the
hidden entries of two checkpoints never mix: :func:`is_staging_of` tells which checkpoint a staging entry belongs to
by its whole name (prefix and token), never by a prefix alone.

Pure functions of strings; no I/O (:func:`name_limit` only asks the filesystem for its limit).
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid

__all__ = [
    "MAX_NAME_BYTES",
    "SHORT_NAME_BYTES",
    "SNAPSHOT_PREFIX",
    "STAGING_INFIX",
    "is_internal_name",
    "is_staging_name",
    "is_staging_of",
    "name_limit",
    "name_tag",
    "new_token",
    "snapshot_name",
    "snapshot_prefix",
    "staging_name",
    "staging_prefix",
    "too_long",
]

STAGING_INFIX = ".tmp-"
"""Hidden siblings of a checkpoint are named ``.{name}.tmp-{token}``: staging, copies, a replaced checkpoint."""
SNAPSHOT_PREFIX = ".upload-"
"""In a local tier, ``.upload-{name}-{token}``: the hard-link snapshot of a checkpoint being uploaded."""
MAX_NAME_BYTES = 255
"""The longest name (one path component, in bytes of UTF-8) that the usual Linux filesystems take."""
_TOKEN = re.compile(r"(?:old-|copy-)?[0-9a-f]{12}")
"""What follows the staging prefix: a token of :func:`new_token`, as itself or after ``old-`` / ``copy-``."""
_LONGEST_SUFFIX = len("copy-") + 12
_TAG_BYTES = MAX_NAME_BYTES - len(".") - len(STAGING_INFIX) - _LONGEST_SUFFIX  # 232
_DIGEST_CHARS = 16
SHORT_NAME_BYTES = 228
"""Names of at most this many bytes stand as themselves in hidden names; longer ones as a tag of 229-232 bytes."""


def is_staging_name(name: str) -> bool:
    """Whether ``name`` is one of the hidden siblings a save, a replace or a copy makes (of any checkpoint)."""
    return name.startswith(".") and STAGING_INFIX in name


def new_token() -> str:
    """A fresh random token (12 hex characters) that names one save's staging directory."""
    return uuid.uuid4().hex[:12]


def name_tag(name: str) -> str:
    """What stands for the checkpoint ``name`` inside the hidden names beside it.

    ``name`` itself when it has at most :data:`SHORT_NAME_BYTES` bytes; else its first bytes (whole characters), ``~``
    and 16 hex digits of its SHA-256: 229 to 232 bytes in all.
    """
    raw = _bytes(name)
    if len(raw) <= SHORT_NAME_BYTES:
        return name
    room, used, end = _TAG_BYTES - 1 - _DIGEST_CHARS, 0, 0
    for char in name:  # whole characters (1-4 bytes each): the head has 212-215 bytes
        used += len(_bytes(char))
        if used > room:
            break
        end += 1
    return f"{name[:end]}~{hashlib.sha256(raw).hexdigest()[:_DIGEST_CHARS]}"


def _bytes(text: str) -> bytes:
    """``text`` as the filesystem stores it (undecodable bytes of a listed name come back as they were)."""
    return text.encode("utf-8", "surrogateescape")


def staging_prefix(name: str) -> str:
    """The start of every staging name of the checkpoint ``name`` (``.{tag}.tmp-``)."""
    return f".{name_tag(name)}{STAGING_INFIX}"


def staging_name(name: str, token: str) -> str:
    """The hidden sibling of the checkpoint ``name`` for ``token`` (a :func:`new_token`, or ``old-``/``copy-`` + one).

    At most :data:`MAX_NAME_BYTES` bytes for any ``name`` of at most that many.
    """
    return staging_prefix(name) + token


def is_staging_of(entry: str, name: str) -> bool:
    """Whether the directory entry ``entry`` is a staging name of the checkpoint ``name`` (any of its tokens)."""
    prefix = staging_prefix(name)
    return entry.startswith(prefix) and _TOKEN.fullmatch(entry[len(prefix) :]) is not None


def snapshot_prefix(name: str) -> str:
    """The start of every upload snapshot's name of the checkpoint ``name`` (``.upload-{tag}-``)."""
    return f"{SNAPSHOT_PREFIX}{name_tag(name)}-"


def snapshot_name(name: str, token: str) -> str:
    """The hidden name under which the local tier freezes the checkpoint ``name`` for one upload."""
    return snapshot_prefix(name) + token


def is_internal_name(name: str) -> bool:
    """Whether ``name`` is one this library gives its own hidden entries (staging, snapshots), never a checkpoint.

    Listings pass over them and clean-ups delete them, so no checkpoint may be saved under such a name.
    """
    return name.startswith(".") and (STAGING_INFIX in name or name.startswith(SNAPSHOT_PREFIX))


def name_limit(directory: str) -> int:
    """The longest entry name (bytes) the filesystem of the local ``directory`` (or its nearest existing parent) takes.

    ``os.pathconf(..., "PC_NAME_MAX")``; :data:`MAX_NAME_BYTES` where the filesystem does not say.
    """
    path = os.path.abspath(directory)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return int(os.pathconf(path, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return MAX_NAME_BYTES


def too_long(path: str, *, limit: int) -> str | None:
    """The first component of the local ``path`` longer than ``limit`` bytes, or ``None`` when every one fits."""
    for part in os.path.abspath(path).split(os.sep):
        if len(_bytes(part)) > limit:
            return part
    return None
