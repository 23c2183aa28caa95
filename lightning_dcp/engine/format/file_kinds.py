"""What a file given as a checkpoint is, from its first bytes, when it is no checkpoint at all.

A checkpoint file is what ``torch.save`` writes: a zip archive (starting ``PK``), or a pickle in the legacy format.
Files of other formats reach ``ckpt_path`` and the loaders too, most often a safetensors export of the weights; handed
to ``torch.load`` they fail with the unpickler's view of their first byte ("Unsupported operand 120"). :func:`identify`
names such a file from its first :data:`HEAD_BYTES` bytes, and :func:`describe` says what it is and what to use. The
loaders ask only once ``torch.load`` failed (``lightning_dcp.engine.load.loading``), so a checkpoint is never refused
for its first bytes.

Pure functions of bytes.
"""

from __future__ import annotations

import dataclasses
import string

__all__ = ["HEAD_BYTES", "MAX_SAFETENSORS_HEADER", "FileKind", "describe", "identify"]

HEAD_BYTES = 16
"""How many bytes of a file :func:`identify` looks at."""
MAX_SAFETENSORS_HEADER = 100_000_000
"""The largest JSON header a safetensors file may have (the safetensors library refuses larger ones)."""
_PRINTABLE = frozenset(string.printable.encode())


@dataclasses.dataclass(frozen=True)
class FileKind:
    """A format that is no checkpoint."""

    name: str
    """Short name: ``"safetensors"``, ``"gguf"``, ``"numpy"``, ``"hdf5"``, ``"gzip"``, ``"empty"``, ``"text"``."""
    what: str
    """What such a file is, in words (``"a safetensors file: tensors only (model weights), ..."``)."""
    weights: bool = False
    """Whether :func:`lightning_dcp.load_model_weights` loads it into a model."""


SAFETENSORS = FileKind(
    "safetensors",
    "a safetensors file: tensors only (model weights), with no optimizer, loop or callback state to resume from",
    weights=True,
)
_MAGIC = (
    (b"GGUF", FileKind("gguf", "a GGUF file (llama.cpp's weights), a format neither Lightning nor torch reads")),
    (b"\x93NUMPY", FileKind("numpy", "a NumPy array file (.npy), written by `numpy.save`")),
    (b"\x89HDF\r\n\x1a\n", FileKind("hdf5", "an HDF5 file (Keras or h5py weights), a format torch does not read")),
    (b"\x1f\x8b", FileKind("gzip", "a gzip archive: unpack it first")),
)
_EMPTY = FileKind("empty", "an empty file (0 bytes): a save that never wrote, or a file truncated to nothing")
_TEXT = FileKind("text", "a text file (a config or a log?), not a checkpoint")


def identify(head: bytes, *, size: int | None = None) -> FileKind | None:
    """The format of a file that starts with ``head`` (its first :data:`HEAD_BYTES` bytes), when it is no checkpoint.

    Args:
        head: The file's first bytes (fewer when the file is shorter).
        size: The file's size in bytes, when known (a safetensors header must fit in it).

    Returns:
        ``None`` for what may be a checkpoint (``torch.save``'s zip archive or pickle, or anything not recognised:
        ``torch.load`` then decides).
    """
    if not head:
        return _EMPTY if size in (None, 0) else None
    if len(head) >= 9 and head[8:9] == b"{":
        length = int.from_bytes(head[:8], "little")
        if 2 <= length <= MAX_SAFETENSORS_HEADER and (size is None or 8 + length <= size):
            return SAFETENSORS
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if all(byte in _PRINTABLE for byte in head):
        return _TEXT
    return None


def describe(url: str, kind: FileKind) -> str:
    """The message for ``url``, found to be ``kind``: what it is, and what to use instead."""
    message = f"{url!r} is {kind.what}; it is not a checkpoint."
    if kind.weights:
        return (
            f"{message} Load its weights into your model with `lightning_dcp.load_model_weights(model, {url!r})`"
            " (before `trainer.fit` without `ckpt_path`, or in `configure_model`), or resume from a checkpoint the"
            " Trainer saved."
        )
    return f"{message} Pass a checkpoint saved by the Trainer, Fabric or `torch.save`."
