"""The readers the fuzzing pass attacks: for each, the hostile inputs of its kind and what runs on each.

Each input is written into a fresh copy of a real committed checkpoint (:class:`Template`), with the checksums made
consistent where that takes it deeper; then the reader itself and the public entry points that use it run on it
(``DCPCheckpointIO.load_checkpoint`` with and without a target, ``verify_checkpoint``, ``inspect_checkpoint``,
``consolidate``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import enum
import functools
import io
import json
import os
import pathlib
import pickle
import shutil
import sys
import typing
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp import DCPCheckpointIO, add_safe_globals, consolidate, inspect_checkpoint, verify_checkpoint
from lightning_dcp._compat import omegaconf_hydra
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.metadata import load_metadata
from lightning_dcp.engine.format import allowlist, codec
from lightning_dcp.engine.format.blob import decode_extra
from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE, checksum, encode_commit, is_plain_name
from lightning_dcp.engine.storage.location import POINTER_HEADER, Location, read_commit
from tests._crafting import sealed
from tests._models import Payload
from tests.chaos import _inputs as inputs
from tests.chaos._checks import Finding, Stats, call, same, tensors
from tests.chaos._edits import mutate_object, near_tensor
from tests.chaos._inputs import archive, archive_parts, torch_bytes


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
            inputs.edited_json(marker).map(sealed),  # its own checksum recomputed: deeper into the checks
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
            mutate_object(draw, metadata, self.t.metadata)
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
        outcome, value = call(lambda: decode_extra(data, path="fuzzed-blob", entry="lightning"), self.stats)
        if outcome == "ok" and not isinstance(value, dict):
            raise Finding("wrong-load", f"decode_extra returned a {type(value).__name__}")
        return "loaded" if outcome == "ok" else f"refused:{type(value).__name__}"


class FuzzColor(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class FuzzConfig:
    warmup: int
    name: str = ""


class FuzzPoint(typing.NamedTuple):
    x: int
    y: int = 0


class CodecReader(Reader):
    """The codec's tags (lightning_dcp.engine.format.codec) inside a blob: crafted kinds, names and payloads, and real
    encodings with their names swapped. Allowed: a CheckpointError, or objects of allowed types only; no import."""

    name = "codec"

    def __init__(self, template: Template, stats: Stats) -> None:
        super().__init__(template, stats)
        add_safe_globals([FuzzColor, FuzzConfig, FuzzPoint])
        import hydra._internal.target_policy  # noqa: F401 - what the codec may import, imported before measuring
        import omegaconf  # noqa: F401

        cfg = omegaconf.OmegaConf.create({"a": {"b": "${c}", "m": "???"}, "c": [1, 2]})
        omegaconf.OmegaConf.set_struct(cfg.a, True)
        self.real = codec.encode(
            {
                "cfg": cfg,
                "sub": cfg.a,
                "opt": functools.partial(torch.optim.AdamW, lr=0.1),
                "ns": argparse.Namespace(x=1),
                "path": pathlib.Path("/tmp/x"),
                "when": datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc),
                "delta": datetime.timedelta(seconds=3),
                "set": frozenset({1}),
                "enum": FuzzColor.RED,
                "dc": FuzzConfig(1, "n"),
                "nt": FuzzPoint(1),
                "type": omegaconf.DictConfig,
            }
        )

    def strategy(self) -> st.SearchStrategy[Any]:
        crafted = st.dictionaries(st.text(max_size=4), inputs.codec_tag(), min_size=1, max_size=3)
        return st.one_of(crafted, self._renamed(), inputs.codec_tag())

    @st.composite
    def _renamed(draw: st.DrawFn, self) -> Any:  # noqa: N805 - hypothesis composite signature
        """The real encoding with some tags' names or kinds replaced, or one of its tags replaced by a crafted one."""

        def edit(value: Any) -> Any:
            if isinstance(value, dict) and set(value) == {codec.TAG}:
                kind, name, payload = value[codec.TAG]
                action = draw(st.sampled_from(["keep", "keep", "name", "kind", "crafted"]))
                if action == "name":
                    name = draw(st.sampled_from(inputs.CODEC_NAMES))
                elif action == "kind":
                    kind = draw(st.sampled_from(inputs.CODEC_KINDS))
                elif action == "crafted":
                    return draw(inputs.codec_tag())
                return {codec.TAG: (kind, name, edit(payload))}
            if isinstance(value, dict):
                return {k: edit(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return type(value)(edit(v) for v in value)
            return value

        return edit(self.real)

    def check(self, data: Any) -> str:
        before = set(sys.modules)
        outcome, value = call(
            lambda: decode_extra(torch_bytes(data), path="fuzzed-blob", entry="lightning"), self.stats
        )
        imported = sorted(set(sys.modules) - before)
        if imported:
            raise Finding("import", f"decoding imported {imported[:5]}")
        if outcome == "ok":
            self._allowed_only(value)
        return "loaded" if outcome == "ok" else f"refused:{type(value).__name__}"

    def _allowed_only(self, value: Any, depth: int = 0) -> None:
        """Every object a load returned is of a plain type, or of a kind the codec builds from its allow-list."""
        import omegaconf

        kind = type(value)
        if kind in (str, int, float, bool, type(None), bytes, complex) or isinstance(value, torch.Tensor):
            return
        if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
            return
        items: Any = ()
        if kind in (dict, list, tuple, set, frozenset):
            items = list(value.values()) + list(value) if kind is dict else list(value)
        elif isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
            items = [omegaconf_hydra.omegaconf_tree(value)]
        elif isinstance(value, functools.partial):
            self._named(value.func)
            items = [value.args, value.keywords, vars(value)]
        elif isinstance(value, type):
            self._named(value)
        elif kind is argparse.Namespace:
            items = [vars(value)]
        elif isinstance(value, (enum.Enum, FuzzConfig, FuzzPoint)):
            self._named(kind)
            items = (
                []
                if isinstance(value, enum.Enum)
                else [vars(value) if dataclasses.is_dataclass(value) else tuple(value)]
            )
        elif not isinstance(
            value, (pathlib.PurePath, datetime.date, datetime.time, datetime.timedelta, datetime.tzinfo)
        ):
            raise Finding("wrong-load", f"a load returned a {kind.__module__}.{kind.__qualname__}")
        for item in items:
            self._allowed_only(item, depth + 1)

    @staticmethod
    def _named(obj: Any) -> None:
        name = allowlist.name_of(obj)
        if name is None or allowlist.lookup(name) is not obj:
            raise Finding("wrong-load", f"a load returned {obj!r:.80}, which is outside the allow-list")


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
                near_tensor(self.t.metadata.state_dict_metadata[key]).map(torch_bytes),
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
            decoded = (
                torch.load(io.BytesIO(record), map_location="cpu", weights_only=True) if result == "loaded" else None
            )
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
        try:  # mapped to the CPU as the reader maps every record: a storage's device tag is not consulted
            decoded = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
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


READER_CLASSES = {
    cls.name: cls for cls in (CommitReader, MetadataReader, PointerReader, BlobReader, RecordReader, CodecReader)
}
