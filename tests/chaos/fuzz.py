"""Fuzzing every reader of a checkpoint with hypothesis: ``.commit``, ``.metadata``, pointers, the blob, data records.

Each reader gets hostile input of its own kind (tests/chaos/_inputs.py), written into a copy of a real committed
checkpoint with the checksums made consistent where that takes the input deeper (so only validation can catch it).
Then the reader itself and the public entry points that use it run on it. Allowed outcomes: a
``CheckpointError`` subclass, or a successful load of exactly what the files hold. Anything else is a finding:
another exception, a hang (a per-example time limit), a jump of the process's peak memory (or a refusal that says
memory could not be allocated: the reader tried to allocate what a number claimed), a file created by unpickling
(``Payload`` and friends), or a load that returns state that was never saved.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import io
import json
import os
import pickle
import re
import resource
import shutil
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp import CheckpointError, DCPCheckpointIO, consolidate, inspect_checkpoint, verify_checkpoint
from lightning_dcp.engine.integrity import committed_checkpoints
from lightning_dcp.engine.layout import decode_extra
from lightning_dcp.engine.marker import COMMIT_FILE, METADATA_FILE, checksum, encode_commit, is_plain_name
from lightning_dcp.engine.metadata import load_metadata
from lightning_dcp.engine.storage import POINTER_HEADER, Location, read_commit
from tests._models import Payload
from tests.chaos import _inputs as inputs
from tests.chaos._inputs import archive, archive_parts, torch_bytes

READERS = ("commit", "metadata", "pointer", "blob", "record")


class Finding(AssertionError):
    """A reader did something other than refuse with a CheckpointError or load what was saved."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class _Hang(BaseException):  # not an Exception: readers' broad `except Exception` must not swallow it
    pass


@contextlib.contextmanager
def address_space_headroom(megabytes: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``megabytes`` (Linux), so that a reader trying to
    allocate what a crafted number claims fails at once (and is reported) instead of taking the machine's memory."""
    try:
        with open("/proc/self/status") as f:
            size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        yield
        return
    previous = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, ((size_kb << 10) + (megabytes << 20), previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, previous)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def guard(seconds: float, memory_mb: float) -> Iterator[None]:
    """Raise a :class:`Finding` when the block runs longer than ``seconds`` or raises the peak RSS by ``memory_mb``."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    before = _peak_mb()
    try:
        yield
    except _Hang:
        raise Finding("hang", f"no answer within {seconds} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    grown = _peak_mb() - before
    if grown > memory_mb:
        raise Finding("memory", f"peak RSS grew by {grown:.0f} MB")


_WRAPPED = re.compile(
    r"failed(?: on rank \d+)?: (TypeError|ValueError|IndexError|KeyError|AttributeError|RuntimeError|AssertionError|"
    r"OverflowError|ZeroDivisionError|UnicodeDecodeError|RecursionError|NotImplementedError|StopIteration|"
    r"struct\.error|OSError|UnpicklingError):"
)
_ALLOC = re.compile(r"MemoryError|can't allocate memory|DefaultCPUAllocator")


def call(fn: Callable[[], Any], stats: Stats) -> tuple[str, Any]:
    """``("ok", value)`` or ``("refused", error)``; any other exception is a :class:`Finding`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", fn()
    except CheckpointError as err:
        text = str(err)
        if _ALLOC.search(text):  # tried to allocate more than the address-space cap: see allocation_refused
            stats.allocation_refused += 1
            stats.samples.setdefault("allocation refused", text[:300])
        raw = _WRAPPED.search(text)
        if raw:  # a refusal, but one where a catch-all wrapped a reader's raw exception: message quality
            stats.unclassified[raw.group(1)] += 1
            stats.samples.setdefault(f"unclassified {raw.group(1)}", text[:300])
        stats.reasons[_reason(text)] += 1
        return "refused", err
    except (Finding, _Hang):
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - any other exception is what this fuzzing looks for
        raise Finding("exception", f"{type(err).__module__}.{type(err).__name__}: {str(err)[:300]}") from None


def _reason(text: str) -> str:
    """A refusal's message without its paths and numbers: what kind of check refused."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|/\S+", "_", text)
    return re.sub(r"\d+", "N", text)[:90]


# ------------------------------------------------------------------------------------------------ comparisons
def same(a: Any, b: Any) -> bool:
    """Exact equality of nested checkpoint values (tensors bit for bit, numpy values by dtype and value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf of nested dicts and lists, by dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    found: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found.update(tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


# ------------------------------------------------------------------------------------------------ the template
class Template:
    """A real committed checkpoint (model + AdamW state + Trainer extras) and what loading it gives."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.marker = os.path.join(root, "pwned")
        self.source = os.path.join(root, "template", "run")
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
        self.checkpoint = {
            "state_dict": {**model.state_dict(), "counter": torch.tensor(7)},
            "optimizer_states": [optimizer.state_dict()],
            "global_step": 1,
            "epoch": 0,
            "loops": {"fit_loop": {"batches": [1, 2, 3], "done": False}},
            "hyper_parameters": {"lr": 0.01, "name": "template"},
            "numpy": np.float32(1.5),
        }
        os.makedirs(self.source)
        DCPCheckpointIO(sync_files=False).save_checkpoint(self.checkpoint, os.path.join(self.source, "step=1.ckpt"))
        self.reference = self._quiet(
            lambda: DCPCheckpointIO().load_checkpoint(os.path.join(self.source, "step=1.ckpt"))
        )
        ckpt = os.path.join(self.source, "step=1.ckpt")
        self.commit_bytes = _read(os.path.join(ckpt, COMMIT_FILE))
        self.metadata_bytes = _read(os.path.join(ckpt, METADATA_FILE))
        self.metadata: Metadata = pickle.loads(self.metadata_bytes)  # the template's own file
        self.records = {
            index.fqn: (info, _read(os.path.join(ckpt, info.relative_path))[info.offset : info.offset + info.length])
            for index, info in self.metadata.storage_data.items()
        }
        self.blob = torch.load(io.BytesIO(self.records["lightning"][1]), weights_only=True)
        self.work = os.path.join(root, "work")

    @staticmethod
    def _quiet(fn: Callable[[], Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()

    def fresh(self) -> str:
        """A fresh copy of the template run directory; returns its checkpoint's path."""
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(self.source, os.path.join(self.work, "run"), symlinks=True)
        return os.path.join(self.work, "run", "step=1.ckpt")

    def target(self) -> dict[str, Any]:
        """A model-only load target (what a ``dcp_*`` strategy passes), zero-filled."""
        return {"state_dict": {k: torch.zeros_like(v) for k, v in self.checkpoint["state_dict"].items()}}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def recommit(ckpt: str, metadata: Any, metadata_bytes: bytes, *, records: bool) -> None:
    """Make ``.commit`` vouch for ``metadata_bytes`` and (``records``) every plausible record ``metadata`` names."""
    marker = json.loads(_read(os.path.join(ckpt, COMMIT_FILE)))
    files = marker["files"]
    if records:
        files = {}
        for info in getattr(metadata, "storage_data", {}).values() if isinstance(metadata, Metadata) else ():
            name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
            if not (is_plain_name(name) and isinstance(offset, int) and isinstance(length, int)):
                continue
            path = os.path.join(ckpt, name)
            if not os.path.isfile(path) or offset < 0 or length < 0 or offset + length > os.path.getsize(path):
                continue
            data = _read(path)[offset : offset + length]
            entry = files.setdefault(name, {"size": os.path.getsize(path), "records": []})
            if [offset, length] not in [r[:2] for r in entry["records"]]:
                entry["records"].append([offset, length, checksum(data)])
    _write(os.path.join(ckpt, COMMIT_FILE), encode_commit(metadata_bytes=metadata_bytes, files=files))


# ------------------------------------------------------------------------------------------------ the readers
class Reader:
    """One reader's inputs (``strategy``) and what is run and checked on each (``check``)."""

    name = ""

    def __init__(self, template: Template, stats: Stats) -> None:
        self.t = template
        self.stats = stats

    def strategy(self) -> st.SearchStrategy[Any]:
        raise NotImplementedError

    def check(self, data: Any) -> str:
        raise NotImplementedError

    # the public entry points, each allowed to refuse or to return exactly the template's state
    def load_all(self, path: str, *, expect: Callable[[dict], None] | None = None) -> str:
        """Load ``path`` with no target (a stock strategy) and into a model-only target (a ``dcp_*`` strategy).

        ``expect(loaded)`` checks what a successful load returned (default: exactly the template's state; for a
        model-only load only ``"state_dict"`` is there). Returns the outcome of the first load.
        """
        expect = expect or self.expect_reference
        outcome, value = call(lambda: DCPCheckpointIO().load_checkpoint(path), self.stats)
        if outcome == "ok":
            expect(value)
        partial_outcome, partial = call(
            lambda: DCPCheckpointIO().load_checkpoint(path, state_dict=self.t.target(), only_model=True), self.stats
        )
        if partial_outcome == "ok":
            expect({"state_dict": partial["state_dict"]})
        return "loaded" if outcome == "ok" else f"refused:{type(value).__name__}"

    def expect_reference(self, loaded: dict) -> None:
        for key in ("state_dict", "optimizer_states", "global_step", "loops", "hyper_parameters", "numpy"):
            if (key in loaded or key != "state_dict" and len(loaded) > 1) and not same(
                loaded.get(key), self.t.reference.get(key)
            ):
                raise Finding("wrong-load", f"loaded {key!r} differs from what was saved")

    def tools(self, path: str, *, also: list[torch.Tensor] = ()) -> None:
        """``verify_checkpoint``, ``inspect_checkpoint`` and ``consolidate``: refuse, or write only tensors that were
        saved (or are in ``also``: what a replaced record holds)."""
        call(lambda: verify_checkpoint(path), self.stats)
        call(lambda: inspect_checkpoint(path), self.stats)
        out = os.path.join(self.t.work, "out.ckpt")
        outcome, _ = call(lambda: consolidate(path, dst=out, overwrite=True, progress=False), self.stats)
        if outcome == "ok":
            # written by lightning_dcp from state that passed weights_only loading (numpy values come back as numpy)
            written = torch.load(out, weights_only=False)
            originals = [*tensors(self.t.reference["state_dict"]).values(), *also]
            for key, tensor in tensors(written.get("state_dict", {})).items():
                if not any(same(tensor, o) for o in originals):
                    raise Finding("wrong-load", f"consolidate wrote {key!r}, which was never saved")


class CommitReader(Reader):
    name = "commit"

    def strategy(self) -> st.SearchStrategy[bytes]:
        marker = json.loads(self.t.commit_bytes)
        return st.one_of(
            st.binary(max_size=200),
            inputs.mutated(self.t.commit_bytes),
            inputs.edited_json(marker).map(lambda doc: json.dumps(doc).encode()),
        )

    def check(self, data: bytes) -> str:
        ckpt = self.t.fresh()
        _write(os.path.join(ckpt, COMMIT_FILE), data)
        outcome, value = call(lambda: read_commit(Location(ckpt)), self.stats)
        if outcome == "ok" and not isinstance(value, dict):
            raise Finding("wrong-load", f"read_commit returned a {type(value).__name__}")
        outcome, _ = call(lambda: committed_checkpoints(Location(os.path.dirname(ckpt))), self.stats)
        if outcome != "ok":
            raise Finding("blocks-dirpath", "listing the committed checkpoints of the directory raised")
        self.load_all(os.path.join(os.path.dirname(ckpt), "last.ckpt"))
        call(lambda: verify_checkpoint(ckpt), self.stats)
        return self.load_all(ckpt)


class MetadataReader(Reader):
    name = "metadata"

    def strategy(self) -> st.SearchStrategy[tuple]:
        return st.tuples(
            st.one_of(
                inputs.hostile_pickle(self.t.metadata_bytes, self.t.marker).map(lambda b: (b, None)),
                self._structured(),
            ),
            st.sampled_from(["records", "records", "checksum", "none"]),
        )

    @st.composite
    def _structured(draw: st.DrawFn, self) -> tuple[bytes, Any]:  # noqa: N805 - hypothesis composite signature
        metadata = copy.deepcopy(self.t.metadata)
        for _ in range(draw(st.integers(1, 3))):
            _mutate_object(draw, metadata, self.t.metadata)
        try:
            data = pickle.dumps(metadata, protocol=draw(st.integers(2, 5)))
        except Exception:  # a value plain pickle cannot write: keep the unmutated bytes
            return self.t.metadata_bytes, self.t.metadata
        return data, metadata

    def check(self, data: tuple) -> str:
        (blob, obj), commit = data
        ckpt = self.t.fresh()
        _write(os.path.join(ckpt, METADATA_FILE), blob)
        if commit != "none":
            recommit(ckpt, obj, blob, records=commit == "records" and obj is not None)
        outcome, value = call(lambda: load_metadata(blob), self.stats)
        if outcome == "ok" and not isinstance(value, Metadata):
            raise Finding("wrong-load", f"load_metadata returned a {type(value).__name__}")
        result = self.load_all(ckpt, expect=self._saved_tensors_only)
        self.tools(ckpt)
        return result

    def _saved_tensors_only(self, loaded: dict) -> None:
        """Metadata can rename or drop entries, but every tensor loaded must be one that was saved, bit for bit."""
        originals = list(tensors(self.t.reference).values())
        for key, tensor in tensors({k: loaded.get(k) for k in ("state_dict", "optimizer_states")}).items():
            if not any(same(tensor, o) for o in originals):
                raise Finding("wrong-load", f"loaded {key!r} {tuple(tensor.shape)}, which was never saved")


class PointerReader(Reader):
    name = "pointer"
    NAMES = ["best.ckpt", "last.ckpt", "p1", "p2"]

    def strategy(self) -> st.SearchStrategy[list]:
        names = st.one_of(
            st.sampled_from(
                ["step=1.ckpt", *self.NAMES, "..", ".", "", "../run/step=1.ckpt", "/etc", "step=1.ckpt/.commit",
                 "nothing.ckpt", "step=1.ckpt\x00", "a" * 300, "\u00e9" * 200, " step=1.ckpt ", "step=1.ckpt\nx"]
            ),
            st.text(max_size=20),
        )  # fmt: skip
        content = st.one_of(
            names.map(lambda n: POINTER_HEADER + n.encode("utf-8", "surrogatepass") + b"\n"),
            st.tuples(names, st.binary(max_size=20)).map(
                lambda t: POINTER_HEADER + t[0].encode("utf-8", "replace") + t[1]
            ),
            st.binary(max_size=64).map(lambda b: POINTER_HEADER + b),
            st.binary(max_size=64),
            st.just(POINTER_HEADER + b"x" * 5000),
        )
        entry = st.one_of(content.map(lambda c: ("file", c)), names.map(lambda n: ("link", n)), st.just(("dir", b"")))
        return st.lists(st.tuples(st.sampled_from(self.NAMES), entry), min_size=1, max_size=4)

    def check(self, data: list) -> str:
        ckpt = self.t.fresh()
        run = os.path.dirname(ckpt)
        for name, (kind, content) in data:
            path = os.path.join(run, name)
            if os.path.lexists(path):
                os.unlink(path) if not os.path.isdir(path) or os.path.islink(path) else shutil.rmtree(path)
            if kind == "file":
                _write(path, content)
            elif kind == "link":
                with contextlib.suppress(OSError, ValueError):
                    os.symlink(content, path)
            else:
                os.makedirs(path)
        results = []
        for name in self.NAMES:
            path = os.path.join(run, name)
            outcome, value = call(lambda path=path: Location(path).read_pointer(), self.stats)
            if outcome == "ok" and value is not None and not is_plain_name(value):
                raise Finding("escape", f"read_pointer returned {value!r}")
            outcome, value = call(lambda path=path: Location(path).resolve(), self.stats)
            if outcome == "ok" and os.path.realpath(os.path.dirname(value.path)) != os.path.realpath(run):
                raise Finding("escape", f"{name} resolves to {value.url!r}, outside {run!r}")
            results.append(self.load_all(path))
            call(lambda path=path: verify_checkpoint(path), self.stats)
        return results[0]


class BlobReader(Reader):
    name = "blob"

    def strategy(self) -> st.SearchStrategy[bytes]:
        pkl, records = archive_parts(self.t.blob)
        return st.one_of(
            st.binary(max_size=300),
            inputs.mutated(self.t.blob),
            inputs.hostile_pickle(pkl, self.t.marker).map(lambda p: archive(p, records)),
            inputs.python_archive(),
            inputs.tensor_archive(),
            st.just(torch_bytes({"x": Payload(self.t.marker)})),
        )

    def check(self, data: bytes) -> str:
        outcome, value = call(lambda: decode_extra(data, path="fuzzed-blob"), self.stats)
        if outcome == "ok" and not isinstance(value, dict):
            raise Finding("wrong-load", f"decode_extra returned a {type(value).__name__}")
        return "loaded" if outcome == "ok" else f"refused:{type(value).__name__}"


class RecordReader(Reader):
    name = "record"

    def strategy(self) -> st.SearchStrategy[tuple]:
        keys = sorted(self.t.records)
        return st.tuples(st.sampled_from(keys), st.booleans(), st.data())

    def _bytes(self, data: st.DataObject, key: str) -> bytes:
        info, original = self.t.records[key]
        others = [record for k, (_, record) in sorted(self.t.records.items()) if k != key]
        pkl, storages = archive_parts(original)
        return data.draw(
            st.one_of(
                st.binary(max_size=300),
                inputs.mutated(original),
                inputs.hostile_pickle(pkl, self.t.marker).map(lambda p: archive(p, storages)),
                inputs.tensor_archive(),
                inputs.some_tensor().map(torch_bytes),
                _near_tensor(self.t.metadata.state_dict_metadata[key]).map(torch_bytes),
                inputs.python_archive(),
                st.sampled_from(others),
                st.just(torch_bytes(Payload(self.t.marker))),
            ),
            label="record",
        )

    def check(self, args: tuple) -> str:
        key, in_place, data = args
        record = self._bytes(data, key)
        info, original = self.t.records[key]
        ckpt = self.t.fresh()
        data_file = os.path.join(ckpt, info.relative_path)
        metadata = copy.deepcopy(self.t.metadata)
        if in_place:  # same place and length: only the bytes change
            record = record[: info.length].ljust(info.length, b"\0")
            with open(data_file, "r+b") as f:
                f.seek(info.offset)
                f.write(record)
        else:  # appended to the file; the metadata points at it
            offset = os.path.getsize(data_file)
            with open(data_file, "ab") as f:
                f.write(record)
            for index, stored in metadata.storage_data.items():
                if index.fqn == key:
                    metadata.storage_data[index] = dataclasses.replace(stored, offset=offset, length=len(record))
        metadata_bytes = pickle.dumps(metadata)
        _write(os.path.join(ckpt, METADATA_FILE), metadata_bytes)
        recommit(ckpt, metadata, metadata_bytes, records=True)
        result = self.load_all(ckpt, expect=lambda loaded: self._expected(loaded, key, record))
        try:
            decoded = torch.load(io.BytesIO(record), weights_only=True) if result == "loaded" else None
        except Exception:
            decoded = None
        self.tools(ckpt, also=[decoded] if isinstance(decoded, torch.Tensor) else [])
        return result

    def _expected(self, loaded: dict, key: str, record: bytes) -> None:
        """Every entry but ``key`` as saved; ``key`` exactly what its new record holds, as the metadata says."""
        reference = tensors(self.t.reference)
        got = tensors({k: loaded.get(k) for k in ("state_dict", "optimizer_states")})
        for name, tensor in got.items():
            if name != key and name in reference and not same(tensor, reference[name]):
                raise Finding("wrong-load", f"{name!r} changed although only {key!r}'s record was replaced")
        if "optimizer_states" not in loaded and not key.startswith("state_dict."):
            return  # a model-only load reads neither the optimizer entries nor the blob
        meta = self.t.metadata.state_dict_metadata[key]
        try:
            decoded = torch.load(io.BytesIO(record), weights_only=True)
        except Exception as err:
            raise Finding("lenient", f"record {key!r} is no torch.save archive ({err!s:.80}), yet it loaded") from None
        if not hasattr(meta, "size"):
            if key == "lightning" and not isinstance(decoded, (bytes, bytearray)):
                raise Finding("lenient", f"the blob record holds a {type(decoded).__name__}, yet it loaded")
            return
        if not (
            isinstance(decoded, torch.Tensor)
            and tuple(decoded.shape) == tuple(meta.size)
            and decoded.dtype == meta.properties.dtype
        ):
            kind = type(decoded).__name__
            shape = tuple(decoded.shape) if isinstance(decoded, torch.Tensor) else ""
            raise Finding(
                "lenient",
                f"record {key!r} holds {kind}{shape} but the metadata says {meta.properties.dtype}{tuple(meta.size)};"
                " it loaded anyway",
            )
        if key in got and not same(got[key], decoded):
            raise Finding("wrong-load", f"{key!r} loaded other values than its record holds")


def _near_tensor(meta: Any) -> st.SearchStrategy[torch.Tensor]:
    """A tensor of the entry's dtype whose shape is the entry's, or one element off in some dimensions."""
    if not hasattr(meta, "size"):
        return st.just(torch.zeros(1))
    shape = list(meta.size)
    deltas = st.lists(st.sampled_from([-1, 0, 0, 1]), min_size=len(shape), max_size=len(shape))
    extra = st.lists(st.integers(1, 3), max_size=1)
    return st.tuples(deltas, extra).map(
        lambda t: torch.full([max(0, d + e) for d, e in zip(shape, t[0], strict=True)] + t[1], 2.5).to(
            meta.properties.dtype
        )
    )


def _mutate_object(draw: st.DrawFn, root: Any, original: Metadata) -> None:
    """Replace one slot anywhere in DCP metadata (a field, a dict item or key, a list item) with a hostile value."""
    slots = list(_object_slots(root))
    if not slots:
        return
    kind, owner, key = draw(st.sampled_from(slots))
    peers = [v for v in _object_values(original) if type(v).__module__.startswith("torch")]
    current = _get(kind, owner, key)
    value = draw(
        st.one_of(
            inputs.json_values(),
            st.sampled_from([torch.float32, torch.int64, torch.uint8, torch.complex128, torch.Size([]), None]),
            st.sampled_from(peers) if peers else st.none(),
            st.lists(st.integers(-2, 2**40), max_size=3).map(torch.Size),
            st.sampled_from([-1, 0, 1, 2**31, 2**62, 2**63, 10**9])
            if isinstance(current, int)
            else st.sampled_from(["", "../x", "__0_0.distcp", ".commit", "state_dict.0.weight", "lightning"]),
        )
    )
    if kind == "dictkey":
        owner[value if _hashable(value) else str(value)] = owner.pop(key)
    elif kind == "delete":
        owner.pop(key)
    else:
        _set(kind, owner, key, value)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _object_slots(obj: Any, depth: int = 0) -> Iterator[tuple[str, Any, Any]]:
    if depth > 6:
        return
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield "attr", obj, field.name
            yield from _object_slots(getattr(obj, field.name), depth + 1)
    elif isinstance(obj, dict):
        for key, value in list(obj.items())[:64]:
            yield "item", obj, key
            yield "dictkey", obj, key
            yield "delete", obj, key
            if dataclasses.is_dataclass(key):  # MetadataIndex: its fields too (the dict is pickled right after)
                yield from _object_slots(key, depth + 1)
            yield from _object_slots(value, depth + 1)
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:16]):
            yield "item", obj, i
            yield from _object_slots(value, depth + 1)


def _object_values(obj: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 6:
        return
    yield obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _object_values(getattr(obj, field.name), depth + 1)
    elif isinstance(obj, dict):
        for value in list(obj.values())[:64]:
            yield from _object_values(value, depth + 1)


def _get(kind: str, owner: Any, key: Any) -> Any:
    return getattr(owner, key) if kind == "attr" else owner[key]


def _set(kind: str, owner: Any, key: Any, value: Any) -> None:
    if kind == "attr":
        object.__setattr__(owner, key, value)  # frozen dataclasses too (MetadataIndex)
    else:
        owner[key] = value


# ------------------------------------------------------------------------------------------------ the runner
@dataclasses.dataclass
class Stats:
    """What one reader's fuzzing saw."""

    reader: str
    examples: int = 0
    seconds: float = 0.0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unclassified: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    allocation_refused: int = 0
    findings: list[dict[str, str]] = dataclasses.field(default_factory=list)
    samples: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "seconds": round(self.seconds, 1),
            "outcomes": dict(self.outcomes),
            "non_checkpoint_errors": sum(1 for f in self.findings if f["kind"] == "exception"),
            "findings_by_kind": dict(collections.Counter(f["kind"] for f in self.findings)),
            "findings": self.findings[:20],
            "refusals_wrapping_a_raw_error": dict(self.unclassified),
            "refusals_after_an_allocation_failed": self.allocation_refused,
            "samples": self.samples,
            "top_refusals": dict(self.reasons.most_common(12)),
        }


def _plain(data: Any) -> Any:
    """``data`` without hypothesis's draw object (record fuzzing draws its bytes inside the test)."""
    if isinstance(data, tuple):
        return tuple(_plain(d) for d in data if not isinstance(d, st.DataObject))
    return data


READER_CLASSES = {cls.name: cls for cls in (CommitReader, MetadataReader, PointerReader, BlobReader, RecordReader)}


def fuzz_reader(
    name: str,
    *,
    root: str,
    examples: int,
    seed: int,
    keep_going: bool,
    timeout_s: float = 20.0,
    memory_mb: float = 400.0,
    artifacts: str | None = None,
) -> Stats:
    """Run ``examples`` hypothesis examples (seeded) against one reader.

    With ``keep_going`` every finding is recorded and the run goes on (the campaign); without, the first finding
    fails (hypothesis shrinks it and reports the smallest input: the CI tests). ``artifacts``: a directory where each
    finding's whole input is pickled.
    """
    os.makedirs(root, exist_ok=True)
    template = Template(os.path.join(root, name))
    stats = Stats(name)
    reader = READER_CLASSES[name](template, stats)
    phases = [Phase.explicit, Phase.generate] if keep_going else [Phase.explicit, Phase.generate, Phase.shrink]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis_seed(seed)
    @given(reader.strategy())
    def run(data: Any) -> None:
        stats.examples += 1
        try:
            with guard(timeout_s, memory_mb):
                stats.outcomes[reader.check(data)] += 1
            if os.path.exists(template.marker) or os.path.exists("chaos-pwned"):
                raise Finding("code-ran", "unpickling created the payload's marker file")
        except Finding as finding:
            for path in (template.marker, "chaos-pwned"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            record = {"kind": finding.kind, "detail": finding.detail, "input": repr(data)[:400]}
            if artifacts is not None and len(stats.findings) < 50:  # the whole input, to reproduce it
                os.makedirs(artifacts, exist_ok=True)
                record["file"] = os.path.join(artifacts, f"{name}-{len(stats.findings)}.pkl")
                with contextlib.suppress(Exception), open(record["file"], "wb") as f:
                    pickle.dump(_plain(data), f)
            stats.findings.append(record)
            if not keep_going:
                raise

    started = time.perf_counter()
    try:
        with address_space_headroom(3072):
            run()
    finally:
        stats.seconds = time.perf_counter() - started
        shutil.rmtree(template.root, ignore_errors=True)
    return stats
