"""Progress bars of the tools: tqdm on stderr, in bytes, shown by default only when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import IO, Any

__all__ = ["ReadCounter", "progress_bar"]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool | None, *, desc: str) -> Any:
    """A tqdm bar over ``total`` bytes (``update(n)``, ``close()``), or one that shows nothing.

    Args:
        total: Bytes the work will go through.
        enabled: Show it; ``None``: only when stderr is a terminal.
        desc: What the bar is about (a file or checkpoint name).
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


class ReadCounter:
    """A binary file whose ``read`` calls advance ``bar`` by the bytes they return (seek, close, ``with`` pass on)."""

    def __init__(self, file: IO[bytes], bar: Any) -> None:
        self._file, self._bar = file, bar

    def read(self, size: int = -1) -> bytes:
        """Read as the file does, and count the bytes."""
        data = self._file.read(size)
        self._bar.update(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        """Seek as the file does."""
        return self._file.seek(offset, whence)

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> ReadCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
