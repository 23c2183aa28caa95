"""The DCP storage writer and reader lightning_dcp uses, and safe reading of DCP's ``.metadata``.

DCP reads ``.metadata`` with plain ``pickle.load``, so a crafted checkpoint could run code at load; every metadata
read here goes through :func:`load_metadata`, which admits DCP's metadata classes only.
"""

from __future__ import annotations

import pickle
from typing import IO, TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_dcp.errors import NotACheckpointError

if TYPE_CHECKING:
    from lightning_dcp._storage import Location

__all__ = ["METADATA_FILE", "load_metadata", "storage_reader", "storage_writer"]

METADATA_FILE = ".metadata"
"""DCP's metadata file; DCP writes it last, after every rank finished writing data."""


def storage_writer(location: Location, *, thread_count: int, sync_files: bool) -> StorageWriter:
    """A DCP storage writer for the directory at ``location``.

    Local disks use DCP's ``FileSystemWriter`` (fsync per file when ``sync_files``). Other protocols use
    ``FsspecWriter`` with the location's storage options, and never ``sync_files``: without a file descriptor DCP
    would fall back to a host-wide ``os.sync()`` per file.
    """
    if location.local:
        return FileSystemWriter(location.path, thread_count=thread_count, sync_files=sync_files, overwrite=True)
    return FsspecWriter(location.url, thread_count=thread_count, sync_files=False, **location.storage_options)


def storage_reader(location: Location) -> StorageReader:
    """A DCP storage reader for ``location`` that reads ``.metadata`` with :func:`load_metadata`."""
    if location.local:
        return _SafeFileSystemReader(location.path)
    return _SafeFsspecReader(location.url, **location.storage_options)


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch._utils": {"_get_layout"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: any other global (a callable that would run code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise NotACheckpointError(
            f"The DCP metadata refers to {module}.{name}, which is not part of DCP's metadata format; refusing to"
            " load it (a crafted checkpoint could run code this way)."
        )


def load_metadata(file: IO[bytes]) -> Metadata:
    """Unpickle DCP's ``.metadata`` allowing only DCP's metadata classes (DCP itself uses plain ``pickle.load``).

    Raises:
        NotACheckpointError: The file refers to anything else, or is not DCP metadata.
    """
    metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise NotACheckpointError(f"The DCP metadata file holds a {type(metadata).__name__}, not DCP metadata.")
    return metadata


class _SafeMetadataReader:
    """``read_metadata`` through :func:`load_metadata` for DCP's filesystem readers (same result otherwise)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata (no collectives): not a layout we write
            raise NotACheckpointError("Per-rank DCP metadata files are not supported.")
        with self.fs.create_stream(self.fs.concat_path(self.path, METADATA_FILE), "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeFileSystemReader(_SafeMetadataReader, FileSystemReader):
    pass


class _SafeFsspecReader(_SafeMetadataReader, FsspecReader):
    pass
