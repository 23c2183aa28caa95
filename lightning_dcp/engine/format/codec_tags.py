"""The codec's tag keys and errors, shared by its encoding and its decoding.

See :mod:`lightning_dcp.engine.format.codec` and :mod:`lightning_dcp.engine.format.decoding`.
"""

from __future__ import annotations

import datetime
import pathlib

TAG = "\x00lightning_dcp.object"
"""Key of the one-entry dict that stands for an object the codec stores as ``(kind, name, payload)``."""


NUMPY_TAG = "\x00lightning_dcp.numpy"
"""Key of the one-entry dict that stands for a numpy array or scalar, ``(kind, dtype, payload)``."""


_PLAIN = (str, int, float, bool, type(None), bytes, complex)


_DATETIMES = {"datetime": datetime.datetime, "date": datetime.date, "time": datetime.time}


_PATHS = {
    c.__name__: c for c in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)
}


class UnstorableValue(ValueError):
    """A value the codec cannot store safely; ``path`` is its key path, ``culprit`` its type, ``hint`` the fix."""

    def __init__(self, path: str, culprit: str, hint: str) -> None:
        super().__init__(culprit)
        self.path, self.culprit, self.hint = path, culprit, hint

    def __str__(self) -> str:
        return f"{self.culprit} at {self.path or 'the top level'}"


class MalformedTag(ValueError):
    """A tag that the codec never writes (a damaged or crafted checkpoint)."""


class DisallowedName(ValueError):
    """A tag naming a class or function outside the allow-list; ``name`` is the dotted name."""

    def __init__(self, name: str, kind: str) -> None:
        super().__init__(f"{kind} {name!r}")
        self.name, self.kind = name, kind


def _fields_of(kind: type) -> tuple[str, ...]:
    time = ("hour", "minute", "second", "microsecond")
    return ("year", "month", "day", *time) if kind is datetime.datetime else time
