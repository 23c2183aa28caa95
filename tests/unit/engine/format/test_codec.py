"""The safe codec of the non-tensor state (engine/format/codec.py) and the blob and file loaders over it."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import functools
import io
import pathlib
import typing

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

import lightning_dcp
from lightning_dcp import CheckpointError, CorruptCheckpointError
from lightning_dcp.engine.format import allowlist, codec
from lightning_dcp.engine.format.blob import decode_extra, encode_extra, load_stock_file


class Color(enum.Enum):
    RED = 1
    BLUE = "b"


class Mode(str, enum.Enum):
    TRAIN = "train"


@dataclasses.dataclass(frozen=True)
class Schedule:
    warmup: int
    decay: list = dataclasses.field(default_factory=list)
    note: str = dataclasses.field(default="", init=False)


class Point(typing.NamedTuple):
    x: int
    label: str = ""


@dataclasses.dataclass
class Unregistered:
    a: int


def make_factory(scale: float) -> float:
    return scale


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    monkeypatch.setattr(allowlist, "_registered", {})
    lightning_dcp.add_safe_globals([Color, Mode, Schedule, Point, make_factory])


def _config() -> DictConfig:
    cfg = OmegaConf.create(
        {
            "data": {"width": 16, "root": "/data"},
            "model": {"hidden": "${data.width}", "depth": 2, "name": "???", "tags": ["a", "${data.root}"]},
            "trainer": {"max_steps": 10, "precision": None},
        }
    )
    OmegaConf.set_struct(cfg.model, True)
    OmegaConf.set_readonly(cfg.trainer, True)
    return cfg


def _round_trip(state: dict) -> dict:
    return decode_extra(encode_extra(state), path="mem", entry="lightning")


def test_every_kind_comes_back_with_its_type_and_value():
    cfg = _config()
    zone = datetime.timezone(datetime.timedelta(hours=-3, seconds=7), "Somewhere")
    state = {
        "optimizer": functools.partial(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0),
        "scheduler": functools.partial(torch.optim.lr_scheduler.ReduceLROnPlateau, mode="min", patience=10),
        "registered_partial": functools.partial(make_factory, 2.0),
        "namespace": argparse.Namespace(lr=0.1, layers=[1, 2], inner=argparse.Namespace(x=Color.BLUE)),
        "paths": [pathlib.Path("/tmp/run"), pathlib.PurePosixPath("a/b"), pathlib.PureWindowsPath("C:/x")],
        "times": [
            datetime.datetime(2026, 11, 23, 12, 30, 1, 5, tzinfo=zone, fold=1),
            datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc),
            datetime.datetime(2026, 1, 1),
            datetime.date(2020, 2, 29),
            datetime.time(23, 59, 59, 999999),
            datetime.timedelta(days=-1, seconds=5, microseconds=7),
        ],
        "enums": [Color.RED, Color.BLUE, Mode.TRAIN],
        "dataclass": Schedule(5, [1.0, Point(1, "p")]),
        "named_tuple": Point(3),
        "sets": [{1, 2}, frozenset({"a", 3})],
        "torch": [torch.float16, torch.device("cpu"), torch.Size([2, 3]), torch.arange(3)],
        "numpy": [np.arange(4, dtype=np.int16), np.float32(1.5)],
        "types": [DictConfig, ListConfig, dict],
    }
    loaded = _round_trip({"hyper_parameters": state, "cfg": cfg, "sub": cfg.model, "list": ListConfig([1, "${x}"])})
    got = loaded["hyper_parameters"]
    for key in ("optimizer", "scheduler", "registered_partial"):
        assert type(got[key]) is functools.partial and got[key].func is state[key].func
        assert got[key].args == state[key].args and got[key].keywords == state[key].keywords
    assert got["namespace"] == state["namespace"] and type(got["namespace"].inner) is argparse.Namespace
    assert [type(p) for p in got["paths"]] == [type(p) for p in state["paths"]] and got["paths"] == state["paths"]
    assert [type(t) for t in got["times"]] == [type(t) for t in state["times"]] and got["times"] == state["times"]
    assert got["times"][0].fold == 1 and got["times"][0].tzinfo.tzname(None) == "Somewhere"
    assert got["times"][1].tzinfo is datetime.timezone.utc
    assert got["enums"][0] is Color.RED and got["enums"][2] is Mode.TRAIN
    assert got["dataclass"] == state["dataclass"] and type(got["dataclass"].decay[1]) is Point
    assert got["named_tuple"] == Point(3) and type(got["named_tuple"]) is Point
    assert got["sets"] == state["sets"] and type(got["sets"][1]) is frozenset
    assert got["torch"][:3] == state["torch"][:3] and torch.equal(got["torch"][3], state["torch"][3])
    assert got["numpy"][0].dtype == np.int16 and type(got["numpy"][1]) is np.float32
    assert got["types"] == [DictConfig, ListConfig, dict]


def test_omegaconf_configs_keep_interpolations_missing_values_flags_and_their_root():
    cfg = _config()
    loaded = _round_trip({"cfg": cfg, "sub": cfg.model, "hparams_type": type(cfg)})
    new, sub = loaded["cfg"], loaded["sub"]
    assert type(new) is DictConfig and loaded["hparams_type"] is DictConfig
    assert OmegaConf.to_container(new, resolve=False) == OmegaConf.to_container(cfg, resolve=False)
    assert new.model._get_node("hidden")._value() == "${data.width}"  # unresolved, as saved
    assert OmegaConf.is_missing(new.model, "name")
    assert OmegaConf.is_struct(new.model) and not OmegaConf.is_struct(new.data)
    assert OmegaConf.is_readonly(new.trainer) and not OmegaConf.is_readonly(new.model)
    assert new.model._metadata.flags == {"struct": True} and new._metadata.flags == {}
    assert sub.hidden == 16 and sub.tags[1] == "/data"  # a sub-config resolves against its saved root
    assert OmegaConf.to_container(sub, resolve=False) == OmegaConf.to_container(cfg.model, resolve=False)


def test_the_blob_stays_readable_by_plain_weights_only_loading():
    """What exists (torch.load(weights_only=True), an older lightning_dcp) reads the blob: tags are plain values."""
    blob = encode_extra({"cfg": _config(), "opt": functools.partial(torch.optim.SGD, lr=0.1)})
    plain = torch.load(io.BytesIO(blob), weights_only=True)
    kind, name, (args, keywords) = plain["opt"][codec.TAG]
    assert (kind, name, args, keywords) == ("partial", "torch.optim.sgd.SGD", (), {"lr": 0.1})
    assert plain["cfg"][codec.TAG][0] == "omegaconf"


def test_numpy_tags_of_the_first_format_still_load():
    old = {"x": {codec.NUMPY_TAG: ("ndarray", "float64", torch.tensor([1.0, 2.0], dtype=torch.float64))}}
    buffer = io.BytesIO()
    torch.save(old, buffer)
    loaded = decode_extra(buffer.getvalue(), path="old", entry="lightning")
    assert loaded["x"].dtype == np.float64 and loaded["x"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    ("value", "culprit", "path", "fix"),
    [
        (functools.partial(print, 1), "builtins.print", r"\['hp'\]\['x'\]\[1\]\.func", "add_safe_globals"),
        (Unregistered(1), "Unregistered", r"\['hp'\]\['x'\]\[1\]", "add_safe_globals"),
        (torch.nn.Linear(2, 2), "torch.nn.modules.linear.Linear", r"\['hp'\]\['x'\]\[1\]", "ignore="),
        (lambda: 1, "function", r"\['hp'\]\['x'\]\[1\]", "plain values"),
        (Point(1, print), "builtins.builtin_function_or_method", r"\.label", "plain values"),
    ],
    ids=["partial-of-print", "unregistered-dataclass", "module", "lambda", "in-named-tuple"],
)
def test_what_the_codec_cannot_store_is_refused_at_save_with_path_and_fix(value, culprit, path, fix):
    with pytest.raises(CheckpointError, match=culprit) as info:
        encode_extra({"hp": {"x": [0, value]}})
    assert __import__("re").search(path, str(info.value)) and fix in str(info.value)


def _blob_of(value) -> bytes:
    buffer = io.BytesIO()
    torch.save({"hp": value}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "tag",
    [
        ("partial", "os.system", ((), {})),
        ("partial", "builtins.eval", (("1",), {})),
        ("type", "subprocess.Popen", None),
        ("enum", "signal.Signals", "SIGKILL"),
        ("dataclass", "tests.unit.engine.format.test_codec.Unregistered", {"a": 1}),
        ("namedtuple", "os.stat_result", [1]),
        ("omegaconf", None, (("dict", {}, [["a", ("value", {}, "${oc.env:HOME}")]]), ["b"])),
        ("path", "Path", "/x"),
        ("dataclass", "tests.unit.engine.format.test_codec.Schedule", {"warmup": 1}),
        ("partial", "torch.optim.sgd.SGD", ((), {1: 2})),
        ("datetime", None, (1, 1, 1, 99, 0, 0, 0, 0, None)),
        ("weird", None, None),
        ["partial", "x", None],
    ],
)
def test_crafted_tags_fail_with_a_checkpoint_error_and_import_nothing(tag):
    import sys

    before = set(sys.modules)
    with pytest.raises(CheckpointError):
        decode_extra(_blob_of({codec.TAG: tag}), path="crafted", entry="lightning")
    assert set(sys.modules) == before


def test_a_name_outside_the_allow_list_says_how_to_allow_it():
    blob = _blob_of({codec.TAG: ("dataclass", "tests.unit.engine.format.test_codec.Unregistered", {"a": 1})})
    with pytest.raises(
        CheckpointError, match=r"add_safe_globals\(\[tests.unit.engine.format.test_codec.Unregistered\]\)"
    ) as info:
        decode_extra(blob, path="ckpt", entry="lightning")
    assert not isinstance(info.value, CorruptCheckpointError)
    lightning_dcp.add_safe_globals([Unregistered])
    assert decode_extra(blob, path="ckpt", entry="lightning")["hp"] == Unregistered(1)


def test_classes_registered_with_torch_are_honoured():
    torch.serialization.add_safe_globals([Unregistered])
    try:
        assert _round_trip({"x": Unregistered(2)})["x"] == Unregistered(2)
    finally:
        torch.serialization.clear_safe_globals()


def _stock_file(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # what stock Lightning writes: OmegaConf's node classes, functools.partial, ...
    return buffer.getvalue()


def test_a_stock_file_loads_with_the_same_allow_list_and_leaves_torch_as_it_was():
    cfg = _config()
    data = _stock_file({"hyper_parameters": {"cfg": cfg, "opt": functools.partial(torch.optim.Adam, lr=0.1)}})
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(io.BytesIO(data), weights_only=True)  # what stock Lightning hits on torch >= 2.6
    before = torch.serialization.get_safe_globals()
    loaded = load_stock_file(lambda: torch.load(io.BytesIO(data), weights_only=True), path="stock.ckpt")
    assert torch.serialization.get_safe_globals() == before
    hp = loaded["hyper_parameters"]
    assert type(hp["cfg"]) is DictConfig and OmegaConf.to_container(hp["cfg"], resolve=False) == (
        OmegaConf.to_container(cfg, resolve=False)
    )
    assert OmegaConf.is_readonly(hp["cfg"].trainer) and hp["opt"].func is torch.optim.Adam


def test_a_stock_file_naming_anything_else_fails_cleanly():
    allowed_by_torch = functools.partial(torch._utils._rebuild_tensor_v2)  # a global torch allows, the codec not
    with pytest.raises(CheckpointError, match=r"_rebuild_tensor_v2 at \['x'\]\.func"):
        load_stock_file(
            lambda: torch.load(io.BytesIO(_stock_file({"x": allowed_by_torch})), weights_only=True), path="s"
        )
    for outside in (functools.partial(print), Unregistered(1)):  # torch's unpickler refuses the name itself
        with pytest.raises(CheckpointError, match="Unsupported global"):
            load_stock_file(
                lambda o=outside: torch.load(io.BytesIO(_stock_file({"x": o})), weights_only=True), path="s"
            )
