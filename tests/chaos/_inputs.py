"""Hypothesis strategies for hostile checkpoint bytes: mutated files, pickle programs, torch.save archives, JSON.

Everything here builds bytes only; nothing is unpickled. The pickle programs name the globals a crafted checkpoint
would (DCP's metadata classes, torch's rebuild functions, ``builtins.bytearray``, ``builtins.open``, ``os.system``,
the tests' :class:`~tests._models.Payload`), so a reader that runs code or allocates what a number claims shows it.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import zipfile
from typing import Any

import torch
from hypothesis import strategies as st

from tests._models import Payload

# --------------------------------------------------------------------------------------------- byte mutations


@st.composite
def mutated(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` with a few bit flips, byte overwrites, insertions, deletions, truncations or splices."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        if not data:
            data += draw(st.binary(min_size=1, max_size=8))
            continue
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, ord("."), ord("("), ord("R")]))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "truncate":
            del data[at:]
        else:
            end = min(len(data), at + draw(st.integers(1, 64)))
            data[at:at] = data[at:end]
    return bytes(data)


# --------------------------------------------------------------------------------------------- pickle programs

GLOBALS = [
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("torch", "float32"),
    ("torch", "FloatStorage"),
    ("torch", "ByteStorage"),
    ("torch", "LongTensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"),
    ("collections", "OrderedDict"),
    ("collections", "Counter"),
    ("pathlib", "PosixPath"),
    ("_codecs", "encode"),
    ("builtins", "bytearray"),
    ("builtins", "set"),
    ("builtins", "complex"),
    ("builtins", "open"),
    ("builtins", "eval"),
    ("builtins", "getattr"),
    ("os", "system"),
    ("tests._models", "Payload"),
]
"""Globals a crafted pickle names: allowed ones (used wrongly), allocating ones, and ones that would run code."""


def _int_op(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    encoded = pickle.encode_long(value)
    return b"\x8a" + bytes([len(encoded)]) + encoded


def _str_op(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _global_op(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


_INTS = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([2**31 - 1, 2**32, 2**40, 2**44, 2**62, 2**63, 2**64, -(2**63), 10**9, 10**12]),
    st.integers(-(2**80), 2**80),
)
_NAMES = st.one_of(
    st.sampled_from(["state_dict", "state_dict.w", "lightning", "__0_0.distcp", "../x", "/etc/passwd", "", "0"]),
    st.text(max_size=12),
)


def _opcode() -> st.SearchStrategy[bytes]:
    """One pickle opcode with its argument (possibly lying about sizes)."""
    simple = st.sampled_from(
        [b"(", b")", b"]", b"}", b"N", b"\x88", b"\x89", b"t", b"\x85", b"\x86", b"\x87", b"R", b"b", b"\x81",
         b"\x92", b"s", b"u", b"a", b"e", b"0", b"1", b"2", b"\x94", b"\x93", b"Q", b"\x8f", b"\x90", b"\x91",
         b"l", b"d", b"o", b"\x97", b"\x98", b"."]
    )  # fmt: skip
    return st.one_of(
        simple,
        _INTS.map(_int_op),
        _NAMES.map(_str_op),
        st.sampled_from(GLOBALS).map(lambda g: _global_op(*g)),
        st.sampled_from(GLOBALS).map(lambda g: _str_op(g[0]) + _str_op(g[1]) + b"\x93"),
        st.binary(max_size=24).map(lambda b: b"C" + bytes([len(b)]) + b),
        st.tuples(st.integers(0, 2**64 - 1), st.binary(max_size=16), st.sampled_from([b"\x8e", b"\x8d", b"\x96"])).map(
            lambda t: t[2] + struct.pack("<Q", t[0]) + t[1]
        ),  # BINBYTES8 / BINUNICODE8 / BYTEARRAY8 claiming any size
        st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=16), st.sampled_from([b"B", b"X", b"T"])).map(
            lambda t: t[2] + struct.pack("<I", t[0]) + t[1]
        ),
        st.integers(0, 300).map(lambda i: b"q" + bytes([i % 256]) if i < 256 else b"r" + struct.pack("<I", i)),
        st.integers(0, 300).map(lambda i: b"h" + bytes([i % 256]) if i < 256 else b"j" + struct.pack("<I", i)),
        st.integers(0, 2**64 - 1).map(lambda n: b"\x95" + struct.pack("<Q", n)),
        st.floats(allow_nan=True).map(lambda f: b"G" + struct.pack(">d", f)),
        st.sampled_from([b"\x80\x02", b"\x80\x05", b"\x80\x09"]),
    )


def pickle_program(max_ops: int = 40) -> st.SearchStrategy[bytes]:
    """A random sequence of pickle opcodes (protocol 2 header, ``.`` at the end)."""
    return st.lists(_opcode(), max_size=max_ops).map(lambda ops: b"\x80\x02" + b"".join(ops) + b".")


@st.composite
def spliced_pickle(draw: st.DrawFn, original: bytes) -> bytes:
    """A valid pickle with a few random opcodes inserted or replacing a slice of it."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        end = draw(st.integers(at, min(len(data), at + 16))) if draw(st.booleans()) else at
        data[at:end] = b"".join(draw(st.lists(_opcode(), min_size=1, max_size=4)))
    return bytes(data)


def hostile_pickle(original: bytes, marker: str) -> st.SearchStrategy[bytes]:
    """Pickles a crafted file might hold: mutated, spliced, generated, or one whose loading creates ``marker``."""
    return st.one_of(
        mutated(original),
        spliced_pickle(original),
        pickle_program(),
        st.sampled_from(["open", "system", "payload"]).map(lambda kind: code_pickle(kind, marker)),
        sized_call(),
    )


def sized_call() -> st.SearchStrategy[bytes]:
    """``callable(n)`` for the allow-listed callables that allocate ``n``: a tiny pickle claiming a terabyte or more
    (never a size a machine could give: a reader that does not refuse it fails at once, and is reported)."""
    sized = [g for g in GLOBALS if g[1] in ("bytearray", "FloatStorage", "ByteStorage", "LongTensor", "UntypedStorage")]
    return st.tuples(st.sampled_from(sized), st.sampled_from([2**40, 2**50, 2**62])).map(
        lambda t: b"\x80\x02" + _global_op(*t[0]) + _int_op(t[1]) + b"\x85R."
    )


def code_pickle(kind: str, marker: str) -> bytes:
    """A pickle whose loading would create the file ``marker`` (never, if the reader is safe)."""
    if kind == "open":
        return b"\x80\x02" + _global_op("builtins", "open") + _str_op(marker) + _str_op("w") + b"\x86R."
    if kind == "system":
        return b"\x80\x02" + _global_op("os", "system") + _str_op(f"touch {marker}") + b"\x85R."
    return pickle.dumps(Payload(marker), protocol=2)


# ------------------------------------------------------------------------------------------- torch.save archives


def archive(data_pkl: bytes, records: dict[str, bytes] | None = None) -> bytes:
    """A torch.save zip archive holding ``data_pkl`` and the storage ``records`` (``{"0": bytes}``)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", b"little")
        for key, value in (records or {}).items():
            z.writestr(f"archive/data/{key}", value)
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


def archive_parts(blob: bytes) -> tuple[bytes, dict[str, bytes]]:
    """``(data.pkl, {storage key: bytes})`` of a torch.save archive."""
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        for info in z.infolist():
            info.CRC = None  # lightning_dcp's writer skips torch's zip CRCs (records carry their own checksum)
        names = z.namelist()
        prefix = names[0].split("/", 1)[0]
        records = {n.rsplit("/", 1)[1]: z.read(n) for n in names if n.startswith(f"{prefix}/data/")}
        return z.read(f"{prefix}/data.pkl"), records


_STORAGES = ["FloatStorage", "DoubleStorage", "LongStorage", "ByteStorage", "BFloat16Storage", "BoolStorage"]


@st.composite
def tensor_archive(draw: st.DrawFn) -> bytes:
    """A torch.save archive of one tensor whose storage key, size, offset, shape and strides may all lie."""
    numel = draw(_INTS.filter(lambda v: v >= -1))
    nbytes = draw(st.integers(0, 64))
    shape = draw(st.lists(_INTS.filter(lambda v: v >= -1), max_size=3))
    stride = draw(st.one_of(st.just(None), st.lists(_INTS.filter(lambda v: v >= -1), max_size=3)))
    if stride is None:
        stride = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    offset = draw(_INTS.filter(lambda v: v >= -1))
    key = draw(st.sampled_from(["0", "1", "../0", ""]))
    storage = draw(st.sampled_from(_STORAGES))
    pkl = (
        b"\x80\x02"
        + _global_op("torch._utils", "_rebuild_tensor_v2")
        + b"(("
        + _str_op("storage")
        + _global_op("torch", storage)
        + _str_op(key)
        + _str_op("cpu")
        + _int_op(numel)
        + b"tQ"
        + _int_op(offset)
        + b"("
        + b"".join(_int_op(v) for v in shape)
        + b"t("
        + b"".join(_int_op(v) for v in stride)
        + b"t\x89"
        + _global_op("collections", "OrderedDict")
        + b")RtR."
    )
    return archive(pkl, {"0": draw(st.binary(min_size=nbytes, max_size=nbytes))})


_DTYPES = [torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool, torch.bfloat16, torch.complex64]


@st.composite
def some_tensor(draw: st.DrawFn) -> torch.Tensor:
    """A small real tensor, possibly a view: transposed, expanded (stride 0), sliced."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    tensor = torch.zeros(shape, dtype=torch.float64).uniform_(-3, 3, generator=torch.Generator().manual_seed(1))
    tensor = tensor.to(dtype)
    view = draw(st.sampled_from(["plain", "t", "expand", "slice"]))
    if view == "t" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    elif view == "expand" and tensor.dim() >= 1 and tensor.shape[0] == 1:
        tensor = tensor.expand(draw(st.integers(1, 1000)), *tensor.shape[1:])
    elif view == "slice" and tensor.dim() >= 1:
        tensor = tensor[::2]
    return tensor


def _plain_values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        _INTS,
        st.floats(allow_nan=False),
        st.text(max_size=8),
        st.binary(max_size=8),
        some_tensor(),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.tuples(children, children),
            st.dictionaries(st.text(max_size=6), children, max_size=4),
        ),
        max_leaves=12,
    )


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


NUMPY_TAG = "\x00lightning_dcp.numpy"
"""The blob's stand-in for numpy values (lightning_dcp.engine.format.layout): crafted ones must be refused cleanly."""


def _numpy_tags() -> st.SearchStrategy[Any]:
    kinds = st.sampled_from(["ndarray", "scalar", "x"])
    dtypes = st.sampled_from(["float32", "int64", "object", "U1000000", "V1000000", "S9", "nonsense", "bool", "M8"])
    payloads = st.one_of(some_tensor(), _INTS, st.floats(), st.text(max_size=4), st.none())
    tag = st.one_of(st.tuples(kinds, dtypes, payloads), st.lists(kinds, max_size=4), _INTS, st.none())
    return tag.map(lambda t: {NUMPY_TAG: t})


def python_archive() -> st.SearchStrategy[bytes]:
    """``torch.save`` of real Python values: plain ones, crafted numpy tags, or an object that would run code."""
    return st.one_of(
        st.dictionaries(st.text(max_size=8), st.one_of(_plain_values(), _numpy_tags()), max_size=4),
        _plain_values(),
    ).map(torch_bytes)


# ------------------------------------------------------------------------------------------------------ JSON
def json_values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        _INTS,
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=10),
        st.sampled_from(["../x", "/etc/passwd", "__0_0.distcp", ".metadata", "a" * 300, "xxh3_64", "lightning_dcp"]),
    )
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=10,
    )


@st.composite
def edited_json(draw: st.DrawFn, original: Any) -> Any:
    """``original`` (decoded JSON) with a few values replaced, keys deleted or added, anywhere in its tree."""
    doc = json.loads(json.dumps(original))
    for _ in range(draw(st.integers(1, 3))):
        slots = list(_slots(doc))
        if not slots:
            return draw(json_values())
        container, key = draw(st.sampled_from(slots))
        action = draw(st.sampled_from(["replace", "replace", "tweak", "delete", "add"]))
        value = container[key]
        if action == "tweak" and isinstance(value, int) and not isinstance(value, bool):
            container[key] = value + draw(st.sampled_from([-1, 1, 2**32, -(2**63), 2**64, -value - 1]))
        elif action == "delete" and isinstance(container, dict):
            del container[key]
        elif action == "add" and isinstance(container, dict):
            container[draw(st.text(max_size=6))] = draw(json_values())
        else:
            container[key] = draw(json_values())
    return doc


def _slots(doc: Any):
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield doc, key
            yield from _slots(value)
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield doc, i
            yield from _slots(value)


# ------------------------------------------------------------------------------------------------ codec tags
CODEC_TAG = "\x00lightning_dcp.object"
"""The codec's tag key (engine/format/codec.py): crafted tags must be refused cleanly or decode to allowed types."""
CODEC_KINDS = [
    "omegaconf", "partial", "namespace", "path", "datetime", "date", "time", "timedelta", "timezone", "frozenset",
    "namedtuple", "dataclass", "enum", "type",
]  # fmt: skip
CODEC_NAMES = [
    # allowed: torch's optimizers and schedulers, config classes, builtins as values, the fuzz's registered classes
    "torch.optim.adamw.AdamW", "torch.optim.lr_scheduler.ReduceLROnPlateau", "omegaconf.dictconfig.DictConfig",
    "omegaconf.listconfig.ListConfig", "builtins.dict", "builtins.int", "argparse.Namespace", "PosixPath",
    "PureWindowsPath", "tests.chaos.readers.FuzzColor", "tests.chaos.readers.FuzzConfig",
    "tests.chaos.readers.FuzzPoint",
    # outside the allow-list: what a crafted checkpoint would name to run or import something
    "os.system", "posix.system", "builtins.eval", "builtins.exec", "builtins.open", "builtins.__import__",
    "builtins.getattr", "subprocess.Popen", "importlib.import_module", "pickle.loads", "torch.load", "shutil.rmtree",
    "tests._models.Payload", "functools.partial", "omegaconf.OmegaConf.load", "pathlib.Path.write_text",
    "antigravity.fly", "torch._utils._rebuild_tensor_v2", "collections.OrderedDict", "typing.Any", "",
]  # fmt: skip
_RESOLVERS = [
    "${a}",
    "${oc.env:HOME}",
    "${oc.create:{}}",
    "${eval:1}",
    "${..x}",
    "???",
    "${",
    "\\${x}",
    "${oc.decode:1}",
]


def _codec_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(_INTS, st.floats(), st.text(max_size=6), st.sampled_from(_RESOLVERS), st.none(), st.booleans())


@st.composite
def _omegaconf_tree(draw: st.DrawFn, depth: int = 0) -> Any:
    kind = draw(st.sampled_from(["dict", "list", "value", "dict", "x"]))
    flags = draw(
        st.one_of(
            st.dictionaries(st.sampled_from(["struct", "readonly", "allow_objects", "convert", "x"]), st.booleans()),
            st.just({"struct": "yes"}),
            _INTS,
        )
    )
    if kind == "value" or depth > 2:
        return ("value", flags, draw(_codec_leaf()))
    if kind == "dict":
        keys = st.one_of(st.text(max_size=4), _INTS, st.none())
        items = draw(st.lists(st.tuples(keys, _omegaconf_tree(depth + 1)), max_size=3))
        return (kind, flags, draw(st.sampled_from([[list(i) for i in items], items, "???", None, "${a}"])))
    return (kind, flags, draw(st.lists(_omegaconf_tree(depth + 1), max_size=3)))


@st.composite
def codec_tag(draw: st.DrawFn, depth: int = 0) -> dict[str, Any]:
    """A crafted codec tag: a kind, a name (allowed or not) and a payload of the kind's shape or any other."""
    kind = draw(st.one_of(st.sampled_from(CODEC_KINDS), st.text(max_size=6)))
    name = draw(st.one_of(st.sampled_from(CODEC_NAMES), st.none(), st.text(max_size=10)))
    inner = codec_tag(depth + 1) if depth < 2 else _codec_leaf()
    values = st.one_of(_codec_leaf(), inner)
    shaped = {
        "omegaconf": st.tuples(_omegaconf_tree(), st.lists(st.one_of(st.text(max_size=3), _INTS), max_size=2)),
        "partial": st.one_of(
            st.tuples(
                st.lists(values, max_size=2).map(tuple), st.dictionaries(st.text(max_size=4), values, max_size=2)
            ),
            st.tuples(
                st.just(()),
                st.just({}),
                st.dictionaries(
                    st.just("hydra"),
                    st.dictionaries(
                        st.sampled_from(["_hydra_resolved_from", "_hydra_full_key", "x"]),
                        st.one_of(st.text(max_size=8), _INTS),
                    ),
                ),
            ),
        ),
        "namespace": st.dictionaries(st.one_of(st.text(max_size=4), _INTS), values, max_size=3),
        "path": st.one_of(st.text(max_size=12), _INTS),
        "datetime": st.tuples(*[_INTS] * 8, st.one_of(st.none(), inner)),
        "time": st.tuples(*[_INTS] * 5, st.one_of(st.none(), inner)),
        "date": st.tuples(_INTS, _INTS, _INTS),
        "timedelta": st.tuples(_INTS, _INTS, _INTS),
        "timezone": st.tuples(_INTS, _INTS, _INTS),
        "frozenset": st.lists(values, max_size=3),
        "namedtuple": st.lists(values, max_size=3),
        "dataclass": st.dictionaries(st.sampled_from(["warmup", "name", "x", "__class__", "__dict__"]), values),
        "enum": st.sampled_from(["RED", "BLUE", "_missing_", "__class__", ""]),
        "type": st.none(),
    }
    payload = draw(st.one_of(shaped.get(kind, st.none()), values, st.lists(values, max_size=3).map(tuple)))
    return {CODEC_TAG: draw(st.sampled_from([(kind, name, payload), (kind, name), [kind, name, payload]]))}
