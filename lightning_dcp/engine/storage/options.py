"""fsspec options that survive DCP's resets of its fsspec readers and writers."""

from __future__ import annotations

import os
from typing import Any

from lightning_dcp._compat.torch_dcp import DCPFsspecFileSystem


class _OptionsFileSystem(DCPFsspecFileSystem):
    """DCP's fsspec adapter, except that ``init_path`` (called by ``reset(checkpoint_id)``) keeps the options."""

    def __init__(self, inner: DCPFsspecFileSystem, storage_options: dict[str, Any]) -> None:
        super().__init__()
        self.fs = inner.fs
        self._storage_options = storage_options

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        return super().init_path(path, **{**self._storage_options, **kwargs})


def keep_options(io: Any, storage_options: dict[str, Any]) -> Any:
    """``io`` (a DCP fsspec writer or reader) with a filesystem that keeps ``storage_options`` across resets."""
    # DCP's FsspecWriter/FsspecReader.reset(checkpoint_id) re-create their filesystem from the URL alone; give them
    # one that re-applies our storage options, so credentials and endpoint survive any reset.
    if isinstance(getattr(io, "fs", None), DCPFsspecFileSystem):
        io.fs = _OptionsFileSystem(io.fs, storage_options)
    return io
