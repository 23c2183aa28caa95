"""Streaming writers: a ``torch.save``-compatible ``.ckpt`` and safetensors, one tensor in memory at a time.

``.ckpt``: ``torch.save`` writes a zip archive (stored, no compression) with ``data.pkl`` (the pickled object, where
each tensor refers to a storage record by key), one ``data/<key>`` record per storage (64-byte aligned), and small
``version`` / ``byteorder`` records. Zip readers find entries through the central directory, so the order of
records is free: :class:`CkptWriter` writes each tensor's bytes as soon as it arrives and ``data.pkl`` last, from a
skeleton whose tensors are :class:`TensorRef` placeholders. ``torch.load(weights_only=True)`` and ``mmap=True`` read
the result like any ``torch.save`` file.

safetensors: an 8-byte little-endian header length, a JSON header with every tensor's dtype, shape and byte
offsets, then the raw bytes in that order. All of it is known from the DCP metadata, so the header goes first and
tensors follow one by one.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import zipfile
from typing import IO, Any

import torch

from lightning_dcp._compat.torch_dcp import rebuild_tensor, storage_type_name

__all__ = ["CkptWriter", "SAFETENSORS_DTYPES", "SafetensorsWriter", "TensorRef"]

_ALIGNMENT = 64
"""Record alignment, as ``torch.save`` uses (``mmap=True`` loads map records in place)."""
_CHUNK = 64 << 20
_PAD_FIELD = 0x4C44
"""Zip extra-field id of our alignment padding (readers skip unknown extra fields)."""
_FORMAT_RECORDS = {"version": "3\n", "byteorder": "little", ".format_version": "1", ".storage_alignment": "64"}

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor in C order, without a copy when it is already contiguous."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


class TensorRef:
    """A placeholder for a tensor that :meth:`CkptWriter.write_tensor` writes (or has written) under ``key``."""

    __slots__ = ("dtype", "key", "shape")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.key, self.dtype, self.shape = key, dtype, tuple(shape)

    def __repr__(self) -> str:
        return f"TensorRef({self.key!r}, {self.dtype}, {self.shape})"


class _StorageRef:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class CkptWriter:
    """Write a ``torch.save``-compatible archive to ``file`` record by record.

    Use: ``ref = writer.reserve(dtype, shape)`` for each tensor (placing the refs in the skeleton), then
    ``writer.write_tensor(ref, tensor)`` for each, then ``writer.finish(skeleton)``. Real tensors inside the
    skeleton (small non-tensor state that happens to hold tensors) are written when the skeleton is pickled.

    Args:
        file: A binary file opened for writing (seekable or not).

    Rank 0 only (or any single process).
    """

    def __init__(self, file: IO[bytes]) -> None:
        self._zip = zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self._next = 0
        self._written: set[str] = set()

    def reserve(self, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorRef:
        """A new placeholder for a tensor of ``dtype`` and ``shape``, to be written later."""
        ref = TensorRef(str(self._next), dtype, shape)
        self._next += 1
        return ref

    def write_tensor(self, ref: TensorRef, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (dtype and shape must match ``ref``) as the record of ``ref``."""
        if tensor.dtype != ref.dtype or tuple(tensor.shape) != ref.shape:
            raise ValueError(f"{ref!r} got a tensor of {tensor.dtype}{tuple(tensor.shape)}.")
        self._record(f"data/{ref.key}", _raw(tensor))
        self._written.add(ref.key)

    def finish(self, obj: Any) -> None:
        """Pickle ``obj`` as ``data.pkl`` (protocol 2, like ``torch.save``) and write the zip's central directory.

        Raises:
            ValueError: ``obj`` refers to a reserved tensor that was never written.
        """
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump(obj)
        self._record("data.pkl", buffer.getbuffer())
        for name, value in _FORMAT_RECORDS.items():
            self._record(name, value.encode())
        self._zip.close()

    def abandon(self) -> None:
        """Drop the archive unfinished (after an error): no central directory is written; the caller deletes it."""
        self._zip.fp = None

    def _tensor_ref(self, tensor: torch.Tensor) -> TensorRef:
        ref = self.reserve(tensor.dtype, tuple(tensor.shape))
        self.write_tensor(ref, tensor)
        return ref

    def _reduce(self, ref: TensorRef) -> tuple:
        if ref.key not in self._written:
            raise ValueError(f"{ref!r} is part of the checkpoint but its data was never written.")
        numel = 1
        for dim in ref.shape:
            numel *= dim
        storage = _StorageRef(ref.key, ref.dtype, numel)
        args = (storage, 0, ref.shape, _contiguous_stride(ref.shape), False, collections.OrderedDict())
        return rebuild_tensor, args

    def _record(self, name: str, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        info = zipfile.ZipInfo("archive/" + name, date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = data.nbytes
        zip64 = data.nbytes * 1.05 > zipfile.ZIP64_LIMIT
        start = self._zip.fp.tell()
        header = 30 + len(info.filename.encode("ascii")) + 4 + (20 if zip64 else 0)
        pad = -(start + header) % _ALIGNMENT
        info.extra = struct.pack("<HH", _PAD_FIELD, pad) + b"\0" * pad
        with self._zip.open(info, mode="w", force_zip64=zip64) as out:
            for begin in range(0, data.nbytes, _CHUNK):
                out.write(data[begin : begin + _CHUNK])


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickling of tensors: ``_rebuild_tensor_v2`` over storages named by persistent ids."""

    def __init__(self, file: IO[bytes], writer: CkptWriter) -> None:
        super().__init__(file, protocol=2)
        self.writer = writer

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return self.writer._reduce(obj)
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise TypeError(f"Cannot write a {type(obj).__name__} into a .ckpt file; convert it to a tensor.")
            return self.writer._reduce(self.writer._tensor_ref(obj.detach().cpu()))
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, storage_type_name(obj.dtype))
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class SafetensorsWriter:
    """Write one safetensors file: the header first (from the planned tensors), then each tensor's bytes in order.

    Args:
        file: A binary file opened for writing.
        planned: ``[(name, dtype, shape)]`` in the order :meth:`write` will be called.
        metadata: String-to-string ``__metadata__`` of the file.

    Raises:
        TypeError: A dtype safetensors has no name for.
    """

    def __init__(
        self, file: IO[bytes], planned: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
    ) -> None:
        self._file = file
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        offset = 0
        self._order = []
        for name, dtype, shape in planned:
            if dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"safetensors cannot store {name!r} of dtype {dtype}; cast it with `dtype=`.")
            nbytes = dtype.itemsize
            for dim in shape:
                nbytes *= dim
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, dtype, tuple(shape)))
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        self._index = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next planned tensor (``name``, dtype and shape must be the next planned ones)."""
        expected = self._order[self._index]
        if (name, tensor.dtype, tuple(tensor.shape)) != expected:
            raise ValueError(f"Expected {expected}, got {(name, tensor.dtype, tuple(tensor.shape))}.")
        data = _raw(tensor)
        for begin in range(0, data.nbytes, _CHUNK):
            self._file.write(data[begin : begin + _CHUNK])
        self._index += 1

    def finish(self) -> None:
        """Check that every planned tensor was written."""
        if self._index != len(self._order):
            raise ValueError(f"{len(self._order) - self._index} planned tensors were not written.")
