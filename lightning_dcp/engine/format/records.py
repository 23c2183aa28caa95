"""DCP data records built around a tensor's own memory: ``torch.save``'s archive without ``torch.save``.

DCP's readers (``FileSystemReader``, ``dcp_to_torch_save``, ours) read every tensor record of a data file with
``torch.load``: a record is a ``torch.save`` zip archive (stored, uncompressed) holding ``data.pkl`` (the pickled
tensor, whose storage is named by a persistent id), ``data/0`` (the raw bytes of that storage) and small
``byteorder`` / ``version`` entries. Everything in the archive except the raw bytes depends only on the tensor's
dtype and shape, so a record is ``prefix + raw bytes + suffix`` where :func:`tensor_record` computes ``prefix``
(local headers, ``data.pkl``, the header of ``data/0`` padded so the bytes start 64-byte aligned) and ``suffix`` (the
central directory) once per dtype and shape. A writer then sends the tensor's memory to the file with ``pwritev``
between the two, without serializing it through a Python stream, and a reader that knows the layout reads the bytes
straight into the target tensor.

``data.pkl`` is byte for byte what ``torch.save`` pickles for a contiguous tensor that owns its storage (checked in
the tests); entries carry no CRC-32 (``torch.load`` does not check it, and ``torch.save`` writes none either when
``torch.serialization.set_crc32_options(False)``): every record is checksummed as a whole in ``.commit`` instead.
Archives whose ``data/0`` reaches 4 GiB use the zip64 extensions, as ``torch.save`` does.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import io
import pickle
import struct
from collections.abc import Sequence

import torch

from lightning_dcp._compat.torch_dcp import rebuild_tensor, rebuild_tensor_v3, storage_type_name

__all__ = ["RecordLayout", "cpu_contiguous", "raw_bytes", "record_frame", "tensor_record"]

_ALIGNMENT = 64
_ARCHIVE = "archive/"
_PAD_FIELD = 0x4C44  # zip extra-field id of our alignment padding (readers skip unknown extra fields)
_ZIP64_FIELD = 0x0001
_SMALL = (("byteorder", b"little"), ("version", b"3\n"), (".format_version", b"1"), (".storage_alignment", b"64"))
_LIMIT = 0xFFFFFFFF
_DOS_DATE = (0, 0)  # 1980-00-00 00:00, as torch.save writes


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """The bytes around a tensor's raw bytes in its record: ``prefix + raw + suffix``.

    Attributes:
        prefix: Everything before the raw bytes (``len(prefix)`` is where they start, a multiple of 64).
        suffix: Everything after them (the zip central directory).
        nbytes: Length of the raw bytes (``numel * itemsize``).
    """

    prefix: bytes
    suffix: bytes
    nbytes: int

    @property
    def length(self) -> int:
        """Bytes of the whole record."""
        return len(self.prefix) + self.nbytes + len(self.suffix)

    @property
    def data_offset(self) -> int:
        """Offset of the raw bytes inside the record."""
        return len(self.prefix)


def cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, on the CPU and contiguous (a copy only where it is not already): what a record holds."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's elements, without a copy (any dtype, 0-d included).

    The view does not keep ``tensor`` alive: the caller must.

    Raises:
        ValueError: ``tensor`` is not a contiguous CPU tensor.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("raw_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


@functools.lru_cache(maxsize=8192)
def tensor_record(dtype: torch.dtype, shape: tuple[int, ...]) -> RecordLayout:
    """The record layout of a contiguous tensor of ``dtype`` and ``shape`` (cached: shapes repeat).

    ``torch.load`` of ``prefix + raw_bytes(t) + suffix`` gives a tensor equal to ``t``.
    """
    shape = tuple(int(d) for d in shape)
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * dtype.itemsize
    entries: list[tuple[str, int, int]] = []  # (name, local header offset, size)
    prefix = bytearray()
    for name, data in (("data.pkl", _pickled(dtype, shape, numel)), *_SMALL):
        entries.append((name, len(prefix), len(data)))
        prefix += _local_header(name, len(data), pad_to=None)
        prefix += data
    entries.append(("data/0", len(prefix), nbytes))
    prefix += _local_header("data/0", nbytes, pad_to=len(prefix))
    directory = b"".join(_central_header(name, offset, size) for name, offset, size in entries)
    start = len(prefix) + nbytes
    return RecordLayout(bytes(prefix), directory + _end_of_directory(len(entries), len(directory), start), nbytes)


@functools.lru_cache(maxsize=8192)
def record_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int, int, bytes, bytes]:
    """:func:`tensor_record` as a flat tuple for per-record loops: ``(length, raw start, raw end, prefix, suffix)``.

    ``length`` is the whole record's bytes; the raw bytes are ``record[raw start:raw end]``.
    """
    layout = tensor_record(dtype, shape)
    begin = layout.data_offset
    return layout.length, begin, begin + layout.nbytes, layout.prefix, layout.suffix


# ------------------------------------------------------------------------------------------------ data.pkl
class _Storage:
    __slots__ = ("dtype", "numel")

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype, self.numel = dtype, numel


class _Tensor:
    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = dtype, shape


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickling of one contiguous tensor that owns its storage (key ``"0"``).

    ``_rebuild_tensor_v2`` over a typed storage for dtypes with a legacy storage class, ``_rebuild_tensor_v3`` over
    an untyped one (sized in bytes) for the others.
    """

    def reducer_override(self, obj: object) -> object:
        if not isinstance(obj, _Tensor):
            return NotImplemented
        numel = 1
        for dim in obj.shape:
            numel *= dim
        stride = _contiguous_stride(obj.shape)
        hooks = collections.OrderedDict()
        if _legacy_name(obj.dtype) is not None:
            return rebuild_tensor, (_Storage(obj.dtype, numel), 0, obj.shape, stride, False, hooks)
        storage = _Storage(None, numel * obj.dtype.itemsize)
        return rebuild_tensor_v3, (storage, 0, obj.shape, stride, False, hooks, obj.dtype)

    def persistent_id(self, obj: object) -> object:
        if not isinstance(obj, _Storage):
            return None
        if obj.dtype is None:
            return ("storage", torch.UntypedStorage, "0", "cpu", obj.numel)
        return ("storage", getattr(torch, _legacy_name(obj.dtype)), "0", "cpu", obj.numel)


def _legacy_name(dtype: torch.dtype) -> str | None:
    try:
        return storage_type_name(dtype)
    except KeyError:
        return None


def _pickled(dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=2).dump(_Tensor(dtype, shape))
    return buffer.getvalue()


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


# ------------------------------------------------------------------------------------------------ zip
def _local_header(name: str, size: int, *, pad_to: int | None) -> bytes:
    """A local file header (stored, sizes known, no CRC).

    With ``pad_to`` (the header's own offset) it is padded so that the entry's data starts at a multiple of 64.
    """
    encoded = (_ARCHIVE + name).encode("ascii")
    extra = b""
    if size >= _LIMIT:
        extra = struct.pack("<HHQQ", _ZIP64_FIELD, 16, size, size)
    if pad_to is not None:
        used = 30 + len(encoded) + len(extra) + 4
        pad = -(pad_to + used) % _ALIGNMENT
        extra += struct.pack("<HH", _PAD_FIELD, pad) + b"\0" * pad
    zip64 = size >= _LIMIT
    sizes = (_LIMIT, _LIMIT) if zip64 else (size, size)
    fields = (0x04034B50, 45 if zip64 else 20, 0, 0, *_DOS_DATE, 0, *sizes, len(encoded), len(extra))
    return struct.pack("<IHHHHHIIIHH", *fields) + encoded + extra


def _central_header(name: str, offset: int, size: int) -> bytes:
    encoded = (_ARCHIVE + name).encode("ascii")
    zip64 = size >= _LIMIT or offset >= _LIMIT
    extra = b""
    if zip64:
        extra = struct.pack("<HHQQQ", _ZIP64_FIELD, 24, size, size, offset)
        size, offset = _LIMIT, _LIMIT
    version = 45 if zip64 else 20
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            version,
            version,
            0,
            0,
            *_DOS_DATE,
            0,
            size,
            size,
            len(encoded),
            len(extra),
            0,
            0,
            0,
            0,
            offset,
        )
        + encoded
        + extra
    )


def _end_of_directory(entries: int, size: int, offset: int) -> bytes:
    """The end-of-central-directory record (preceded by the zip64 ones when the directory starts past 4 GiB)."""
    out = b""
    if offset >= _LIMIT:
        zip64_end = offset + size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries, size, offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1)
        offset = _LIMIT
    return out + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, entries, entries, size, offset, 0)
