"""Checking a ``torch.save`` archive read from a checkpoint before ``torch.load`` sees it.

``torch.load(weights_only=True)`` runs no code, but it still allocates what the bytes claim: a deflated zip entry
decompresses to any size (a 1 MB blob became a 1 GB string and 4 GB of peak memory), and its allow-list calls
``bytearray(n)`` and torch's storage and tensor classes with a number from the pickle (8 GB of zeros from a 200-byte
blob). lightning_dcp's own records (the non-tensor blob, DCP's bytes entries) never need either: ``torch.save``
writes a zip of stored (uncompressed) entries, and it pickles storages by reference and bytearrays from their
content. :func:`check_archive` refuses the rest from the zip directory and one pass over the pickle's opcodes, before
anything is allocated.
"""

from __future__ import annotations

import io
import pickletools
import re
import zipfile
from typing import Any

import torch

__all__ = ["UnsafeArchiveError", "check_archive", "load_checked"]

_SIZED = re.compile(r"^(builtins|__builtin__) bytearray$|^torch(\.cuda|\.sparse|\.storage)? \w*(Storage|Tensor)$")
"""Allowed callables of ``weights_only`` unpickling that allocate what an integer argument says."""
_MARK = object()
_UNKNOWN = ("?",)


class UnsafeArchiveError(ValueError):
    """Bytes that are not a ``torch.save`` archive lightning_dcp would load (the caller names the file)."""


def check_archive(data: bytes | memoryview) -> None:
    """Refuse a ``torch.save`` archive whose loading could allocate more than it holds.

    It must be a zip of stored entries, each within the archive, and every pickle in it must call no allocating
    class (``bytearray``, a torch storage or tensor class) with a number.

    Raises:
        UnsafeArchiveError: It is not such an archive (the message says why).
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = archive.infolist()
    except Exception as err:  # zipfile raises several types for bytes that are not a zip
        raise UnsafeArchiveError(f"not a torch.save zip archive ({type(err).__name__}: {err})") from None
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise UnsafeArchiveError(f"its entry {entry.filename!r} is compressed; torch.save stores entries as is")
        if entry.header_offset + entry.file_size > len(data):
            raise UnsafeArchiveError(f"its entry {entry.filename!r} claims {entry.file_size} bytes past its end")
    for entry in entries:
        if entry.filename.endswith(".pkl"):
            entry.CRC = None  # lightning_dcp writes archives without zip CRCs (records carry their own checksum)
            try:
                with archive.open(entry) as f:
                    pickled = f.read()
            except Exception as err:  # a local header that disagrees with the directory, a truncated entry
                raise UnsafeArchiveError(f"its entry {entry.filename!r} is unreadable ({err})") from None
            _check_pickle(pickled)


def load_checked(data: bytes | memoryview | io.BytesIO, *, weights_only: bool = True) -> Any:
    """The one door to ``torch.load`` for bytes read from a checkpoint: :func:`check_archive`, then the load.

    Nothing the archive claims is allocated beyond what it holds; the load maps every tensor to the CPU.

    Raises:
        UnsafeArchiveError: The archive claims more than it holds (or is malformed the way the check sees).
        Exception: What ``torch.load`` raises for bytes it refuses (the callers name the file).
    """
    if isinstance(data, io.BytesIO):
        check_archive(data.getbuffer())
        return torch.load(data, map_location="cpu", weights_only=weights_only)
    check_archive(data)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)


def _check_pickle(data: bytes) -> None:
    """Follow the pickle's stack just enough to see what each call is called with."""
    stack: list[Any] = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            _step(op, arg, stack, memo)
    except UnsafeArchiveError:
        raise
    except Exception as err:  # genops raises ValueError on malformed pickles, our stack IndexError
        raise UnsafeArchiveError(f"its pickle is malformed ({type(err).__name__}: {err})") from None


def _step(op: pickletools.OpcodeInfo, arg: Any, stack: list[Any], memo: dict[Any, Any]) -> None:
    name = op.name
    if name == "MARK":
        stack.append(_MARK)
    elif name in ("INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"):
        stack.append(("int", arg))
    elif op.stack_after == [pickletools.pyunicode] and isinstance(arg, str) and not op.stack_before:
        stack.append(("str", arg))
    elif name == "GLOBAL":
        stack.append(("global", arg))
    elif name == "STACK_GLOBAL":
        attr, module = stack.pop(), stack.pop()
        known = module[0] == "str" and attr[0] == "str"
        stack.append(("global", f"{module[1]} {attr[1]}") if known else _UNKNOWN)
    elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
        memo[arg] = stack[-1]
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in ("GET", "BINGET", "LONG_BINGET"):
        stack.append(memo.get(arg, _UNKNOWN))
    elif name == "DUP":
        stack.append(stack[-1])
    elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
        count = int(name[-1])
        items = stack[-count:]
        del stack[-count:]
        stack.append(("tuple", items))
    elif name == "EMPTY_TUPLE":
        stack.append(("tuple", []))
    elif name == "TUPLE":
        stack.append(("tuple", _pop_to_mark(stack)))
    elif name in ("REDUCE", "NEWOBJ"):
        args = stack.pop()
        _check_call(stack.pop(), args)
        stack.append(_UNKNOWN)
    elif name == "NEWOBJ_EX":
        stack.pop()
        args = stack.pop()
        _check_call(stack.pop(), args)
        stack.append(_UNKNOWN)
    elif name == "OBJ":
        items = _pop_to_mark(stack)
        _check_call(items[0], ("tuple", items[1:]))
        stack.append(_UNKNOWN)
    elif name == "INST":
        _check_call(("global", arg), ("tuple", _pop_to_mark(stack)))
        stack.append(_UNKNOWN)
    else:  # every other opcode: its documented stack effect, with values we need not follow
        before = op.stack_before
        if pickletools.markobject in before:
            _pop_to_mark(stack)
        for _ in [x for x in before if x not in (pickletools.markobject, pickletools.stackslice)]:
            stack.pop()
        stack.extend(_UNKNOWN for _ in op.stack_after)


def _pop_to_mark(stack: list[Any]) -> list[Any]:
    items = []
    while True:
        item = stack.pop()
        if item is _MARK:
            return items[::-1]
        items.append(item)


def _check_call(func: Any, args: Any) -> None:
    if func is _MARK or func[0] != "global":
        raise UnsafeArchiveError("its pickle calls something that is not a named class or function")
    if _SIZED.match(func[1]) and (args is _MARK or args[0] != "tuple" or any(a[0] == "int" for a in args[1])):
        raise UnsafeArchiveError(f"its pickle calls {func[1].replace(' ', '.')} with a size, which would allocate it")
