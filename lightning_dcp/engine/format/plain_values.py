"""The plain values of a ``torch.save`` archive, read with the C unpickler where no class or storage is named."""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

__all__ = ["NOT_PLAIN", "PlainUnpickler", "plain_value"]

NOT_PLAIN = object()
"""What :func:`plain_value` returns for an archive whose pickle is not plain."""


class _NotPlain(Exception):
    pass


def _latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it for ``bytes`` (a str and ``"latin1"``), and nothing else."""
    if type(text) is not str or encoding != "latin1":
        raise _NotPlain
    return text.encode("latin1")


class PlainUnpickler(pickle.Unpickler):
    """Unpickles what names no class and holds no storage: numbers, strings, bytes, lists, tuples, dicts, sets.

    ``bytes`` in a protocol 2 pickle (``torch.save``'s) are ``_codecs.encode(str, "latin1")``: that one call is
    allowed, with those arguments only.
    """

    def find_class(self, module: str, name: str) -> Any:
        """``_codecs.encode`` for bytes; any other global makes the pickle not plain."""
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        raise _NotPlain

    def persistent_load(self, pid: Any) -> Any:
        """A storage reference makes the pickle not plain."""
        raise _NotPlain


def plain_value(data: bytes) -> Any:
    """The object of a ``torch.save`` archive whose pickle is plain (:class:`PlainUnpickler`), else ``NOT_PLAIN``.

    The Trainer-state blobs and the optimizers' hyperparameters are such archives: read with the C unpickler, they
    cost microseconds where ``torch.load``'s ``weights_only`` unpickler (Python) takes a millisecond for a list of
    1,200 parameter names. Such a pickle can build only literal values, which ``weights_only`` loading builds alike;
    anything else (a class, a storage, a malformed archive) goes to ``torch.load`` as before, which decides.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
        if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
            return NOT_PLAIN
        pickles[0].CRC = None  # the record's checksum in .commit was checked
        with archive.open(pickles[0]) as f:
            pickled = f.read()
        return PlainUnpickler(io.BytesIO(pickled)).load()
    except Exception:  # _NotPlain, or bytes that are no such archive: torch.load's checks say what is wrong
        return NOT_PLAIN
