r"""The path door: every checkpoint path or URL a user gives is put in one canonical form here, once.

:class:`~lightning_dcp.engine.storage.location.Location` calls :func:`canonical_url` on every path it is built from
(dirpath, ``ckpt_path``, CLI arguments, pointer targets), so every later write, listing, lookup and removal uses the
same string. The rules, and why:

- **Object stores and other remote filesystems** (``s3://``, ``gs://``, ``az://``, ``memory://``, ...):

  - Repeated slashes collapse (``s3://b/exp//run`` is ``s3://b/exp/run``) and a trailing slash goes. s3fs writes
    ``exp//run/x`` under the key ``exp/run/x`` but lists ``exp//run``: left as given, nothing saved there is ever
    found again and a resume starts from scratch over the saved checkpoints.
  - ``.`` and ``..`` segments are refused: object stores keep them as literal key parts while some clients resolve
    them, so the same URL names two places.
  - ``?`` and ``#`` are refused: parts of the stack read them as a query string or a fragment (a ``.metadata`` once
    landed at ``.metadata/.metadata.tmp``), so the file written is not the file read back. So are ``*``, ``[`` and
    ``]``, which fsspec expands as glob patterns in some calls and not in others.
  - Control characters (``\x00``-``\x1f``, ``\x7f``) and backslashes are refused: stores and their HTTP APIs
    transform or reject them.

- **Local paths** (and ``file://``) are the operating system's to resolve: ``..`` and repeated slashes mean what they
  mean in a shell. Only a NUL byte, which no local filesystem can store, is refused.
- **http(s) URLs** are read-only sources whose query strings carry meaning (signed URLs): left as given.

A refused path raises :class:`~lightning_dcp.errors.InvalidPathError` naming it, the offending part and the fix, at
the moment the path enters (a ``Location``, ``DCPModelCheckpoint(dirpath=...)``): before anything is written.
"""

from __future__ import annotations

import os

import fsspec.utils

from lightning_dcp.errors import InvalidPathError

__all__ = ["canonical_url", "is_remote_url"]

_LOCAL = {"file", "local"}
_AS_GIVEN = {"http", "https"}
_REFUSED = {
    "?": "a '?' (read as the start of a query string)",
    "#": "a '#' (read as the start of a fragment)",
    "*": "a '*' (expanded as a glob pattern by fsspec's listings and removals)",
    "[": "a '[' (expanded as a glob pattern by fsspec's listings and removals)",
    "]": "a ']' (expanded as a glob pattern by fsspec's listings and removals)",
}


def is_remote_url(path: str) -> bool:
    """Whether ``path`` names a remote filesystem (a protocol other than the local disk)."""
    return fsspec.utils.get_protocol(path.split("::")[-1]) not in _LOCAL


def canonical_url(path: str | os.PathLike) -> str:
    """The canonical form of a checkpoint path or URL (see the module docstring for the rules).

    Args:
        path: A local path, ``file://`` URL or fsspec URL; chained URLs (``simplecache::s3://...``) are checked part
            by part.

    Returns:
        ``str``: the same path with repeated and trailing slashes collapsed on remote filesystems; local paths and
        http(s) URLs unchanged. Idempotent: ``canonical_url(canonical_url(p)) == canonical_url(p)``.

    Raises:
        InvalidPathError: A segment ``.`` or ``..``, a ``?``, ``#``, backslash or control character in a remote URL; a
            NUL byte anywhere.
        TypeError: ``path`` is neither ``str`` nor ``os.PathLike``.
    """
    url = os.fspath(path)
    if not isinstance(url, str):
        raise TypeError(f"A checkpoint path must be a str or os.PathLike of str, got {type(url).__name__}: {url!r}.")
    if "\x00" in url:
        raise InvalidPathError(f"The checkpoint path {url!r} holds a NUL byte, which no filesystem can store.")
    if "::" in url:
        return "::".join(_canonical_part(part, whole=url) for part in url.split("::"))
    return _canonical_part(url, whole=url)


def _canonical_part(url: str, *, whole: str) -> str:
    protocol = fsspec.utils.get_protocol(url)
    if protocol in _LOCAL or protocol in _AS_GIVEN or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    for char, what in _REFUSED.items():
        if char in rest:
            raise InvalidPathError(_message(whole, f"holds {what}", "Rename it without that character."))
    bad = next((c for c in rest if ord(c) < 0x20 or ord(c) == 0x7F or c == "\\"), None)
    if bad is not None:
        raise InvalidPathError(
            _message(whole, f"holds the character {bad!r}, which object stores transform or refuse", "Rename it.")
        )
    segments = [s for s in rest.split("/") if s]
    dots = next((s for s in segments if s in (".", "..")), None)
    if dots is not None:
        raise InvalidPathError(
            _message(
                whole,
                f"has a {dots!r} segment, which object stores keep as a literal name while some clients resolve it",
                "Write the path without it (resolve it yourself: 's3://b/run/../x' is 's3://b/x').",
            )
        )
    return f"{scheme}://" + "/".join(segments)


def _message(url: str, what: str, fix: str) -> str:
    return f"The checkpoint URL {url!r} {what}: the file written there would not be the one read back. {fix}"
