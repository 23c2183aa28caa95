"""Progress bars of the tools: tqdm on stderr, in bytes, shown by default only when stderr is a terminal."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["BarCallback", "progress_bar"]


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


class BarCallback:
    """A ``progress(bytes, total)`` callback (as ``verify_checkpoint`` calls it) drawing a :func:`progress_bar`.

    The bar opens on the first call, over the ``total`` bytes that call gives; :meth:`close` closes it.
    """

    def __init__(self, enabled: bool | None, *, desc: str) -> None:
        self._enabled, self._desc, self._bar = enabled, desc, None

    def __call__(self, nbytes: int, total: int) -> None:
        """Advance the bar by ``nbytes`` (of ``total``)."""
        if self._bar is None:
            self._bar = progress_bar(total, self._enabled, desc=self._desc)
        self._bar.update(nbytes)

    def close(self) -> None:
        """Close the bar, if it was opened."""
        if self._bar is not None:
            self._bar.close()
