"""The path door, property-tested: any path string a user may give either is refused at once with a clear error, or
save -> list -> "last" -> load -> remove agree on it, on a local disk, ``memory://`` and a real S3 server.

Also: the same directory written with doubled slashes is the same directory (the issue's silent fresh start).
"""

from __future__ import annotations

import json
import os
import string
import uuid
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dcp import DCPCheckpointIO, InvalidPathError
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.lookup import verify_checkpoint
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.paths import canonical_url

EXAMPLES = int(os.environ.get("LIGHTNING_DCP_PATH_EXAMPLES", "12"))
"""Examples per store in CI; ``nox -s chaos`` runs the path pass with many more."""

_SPECIAL = " -_.=+%~!$&'()*,;:@[]{}^`|<>\"é日\u00a0?#\\\t"
segment = st.one_of(
    st.text(alphabet=string.ascii_letters + string.digits + _SPECIAL, min_size=1, max_size=12),
    st.sampled_from([".", "..", "", "epoch=1-val_loss=0.25", "a b", "x%20y", "100%"]),
)
relative = st.lists(segment, min_size=1, max_size=4).map("/".join)
checkpoint_name = st.one_of(
    st.just("step=2.ckpt"),
    st.just(".hidden.ckpt"),
    st.just(".step=2.ckpt.tmp-0a1b2c"),
    st.text(alphabet=string.ascii_letters + string.digits + "=-_.+ %", min_size=1, max_size=16),
)


def _refused(url: str) -> bool:
    """What the door refuses in a remote URL (the oracle, written from the rules, not from the code)."""
    rest = url.split("://", 1)[1]
    parts = [p for p in rest.split("/") if p]
    return (
        any(c in rest for c in "?#*[]\\")
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in rest)
        or any(p in (".", "..") for p in parts)
    )


def _state(step: int) -> dict:
    return {"state_dict": {"w": torch.full((8,), float(step))}, "global_step": step}


COUNTS: Counter[str] = Counter()
"""``"<store> <outcome>"`` -> examples (``nox -s chaos`` reports them: ``LIGHTNING_DCP_PATH_REPORT``)."""


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    report = os.environ.get("LIGHTNING_DCP_PATH_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(dict(COUNTS), f, indent=1, sort_keys=True)


def _round_trip(base: str, rel: str, name: str, options: dict) -> None:
    dirpath = base.rstrip("/") + "/" + rel
    remote = "://" in dirpath
    store = base.split("://", 1)[0] if remote else "local"
    io = DCPCheckpointIO(storage_options=options)
    if remote and (_refused(dirpath) or _refused(f"{base}/{name}")):
        with pytest.raises(InvalidPathError, match="checkpoint URL"):
            Location(dirpath + "/" + name, storage_options=options)
        COUNTS[f"{store} refused"] += 1
        return
    if name.startswith(".") and (".tmp-" in name or name.startswith(".upload-")):  # the library's own hidden names
        with pytest.raises(InvalidPathError, match="staging and upload"):
            io.save_checkpoint(_state(1), dirpath + "/" + name)
        COUNTS[f"{store} refused"] += 1
        return
    if name in (".", "..", "first.ckpt") or "/" in name or not name.strip(".") or "\x00" in dirpath:
        COUNTS[f"{store} not a name"] += 1
        return  # not a checkpoint name a directory can hold (the OS decides what these mean)
    first, second = dirpath + "/" + "first.ckpt", dirpath + "/" + name
    io.save_checkpoint(_state(1), first)
    io.save_checkpoint(_state(2), second)
    doubled = dirpath.replace("/", "//") if remote else dirpath  # the same directory, written another way
    for spelling in (dirpath, doubled):
        listed = [c.name for _, c in committed_checkpoints(Location(spelling, storage_options=options))]
        assert listed == [Location(second).name, "first.ckpt"], (spelling, listed)
        assert int(io.load_checkpoint(spelling + "/last.ckpt")["global_step"]) == 2
    verify_checkpoint(second, storage_options=options)
    assert torch.equal(io.load_checkpoint(second)["state_dict"]["w"], torch.full((8,), 2.0))
    io.remove_checkpoint(doubled + "/" + name)
    listed = [c.name for _, c in committed_checkpoints(Location(dirpath, storage_options=options))]
    assert listed == ["first.ckpt"]
    assert int(io.load_checkpoint(dirpath + "/last.ckpt")["global_step"]) == 1
    io.remove_checkpoint(first)
    assert committed_checkpoints(Location(dirpath, storage_options=options)) == []
    COUNTS[f"{store} round trip"] += 1


_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)


@_SETTINGS
@given(rel=relative, name=checkpoint_name)
def test_paths_on_a_local_disk(tmp_path_factory, rel, name):
    base = str(tmp_path_factory.mktemp("paths"))
    if rel.startswith("/") or "\x00" in rel or ".." in rel.split("/"):
        return  # ".." on a local disk means what the OS makes of it (even a path through the checkpoint itself)
    _round_trip(base, rel, name, {})


@_SETTINGS
@given(rel=relative, name=checkpoint_name)
def test_paths_in_memory(rel, name):
    _round_trip(f"memory://paths-{uuid.uuid4().hex[:8]}", rel, name, {})


@pytest.mark.s3
@_SETTINGS
@given(rel=relative, name=checkpoint_name)
def test_paths_on_s3(s3_server, rel, name):
    bucket = os.environ.get("LIGHTNING_DCP_PATH_BUCKET") or _shared_bucket(s3_server)
    _round_trip(f"s3://{bucket}/p-{uuid.uuid4().hex[:8]}", rel, name, s3_server.storage_options())


_BUCKETS: dict[int, str] = {}


def _shared_bucket(server) -> str:
    """One bucket for every example (SeaweedFS runs out of volumes after a few dozen buckets)."""
    if id(server) not in _BUCKETS:
        _BUCKETS[id(server)] = server.new_bucket()
    return _BUCKETS[id(server)]


@pytest.mark.parametrize(
    ("given_url", "expected"),
    [
        ("s3://b/exp//run", "s3://b/exp/run"),
        ("s3://b//exp///run/", "s3://b/exp/run"),
        ("memory:///a//b", "memory://a/b"),
        ("gs://b/x/", "gs://b/x"),
        ("/tmp//a/../b", "/tmp//a/../b"),
        ("relative/../x", "relative/../x"),
        ("https://host/x?sig=1", "https://host/x?sig=1"),
        ("simplecache::s3://b//k", "simplecache::s3://b/k"),
    ],
)
def test_canonical_form(given_url, expected):
    assert canonical_url(given_url) == expected
    assert canonical_url(expected) == expected


@pytest.mark.parametrize(
    "bad",
    ["s3://b/run?x=1", "s3://b/run#2", "s3://b/a/../run", "s3://b/./run", "gs://b/a\\b", "s3://b/a\nb", "/tmp/a\x00b"],
)
def test_refused_paths_name_the_path_and_write_nothing(bad, tmp_path):
    with pytest.raises(InvalidPathError) as err:
        DCPCheckpointIO().save_checkpoint(_state(1), bad)
    assert repr(bad)[1:-1][:6] in str(err.value)
