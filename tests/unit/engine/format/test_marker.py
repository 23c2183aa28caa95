"""The names inside a checkpoint directory (format/marker.py): which kind a listing is, which path names a marker, and
the order at a marker's end (what a listing reads of each ``.commit`` to rank checkpoints)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dcp.engine.format.marker import (
    ORDER_TAIL_BYTES,
    checkpoint_kind,
    encode_commit,
    is_marker_path,
    order_at_end,
    parse_commit,
    run_of,
)

_RUNS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", min_size=1, max_size=64)
_ORDERS = st.fixed_dictionaries(
    {"counter": st.integers(1, 2**64 - 1), "step": st.none() | st.integers(0, 2**64 - 1)},
    optional={"run": _RUNS},
)
# Names a user can give state (FQNs, object keys): anything, including what an order looks like in JSON.
_CRAFTED = ['x, "order": {"counter": 99}, "version": 1}', '"order": {', "}}", "order"]
_NAMES = st.text(max_size=40) | st.sampled_from(_CRAFTED)


@st.composite
def _markers(draw: st.DrawFn, order: bool = True) -> tuple[bytes, dict | None]:
    size = draw(st.integers(0, 10_000))
    records = draw(st.lists(st.tuples(st.integers(0, size), st.integers(0, 2**64 - 1)), max_size=30))
    files = {"__0_0.distcp": {"size": size, "records": [[off, size - off, digest] for off, digest in records]}}
    index = draw(st.none() | st.dictionaries(_NAMES, st.lists(_NAMES, max_size=3), max_size=20))
    chosen = draw(_ORDERS) if order else None
    return encode_commit(metadata_bytes=draw(st.binary(max_size=64)), files=files, order=chosen, index=index), chosen


@settings(max_examples=300, deadline=None)
@given(_markers(), st.integers(0, ORDER_TAIL_BYTES))
def test_the_order_at_the_end_is_the_one_the_whole_marker_holds(drawn, cut):
    data, _ = drawn
    whole = parse_commit(data)
    assert order_at_end(data[-ORDER_TAIL_BYTES:]) == whole["order"]
    assert order_at_end(data) == whole["order"]
    assert run_of({"order": order_at_end(data)}) == run_of(whole)
    shorter = data[-ORDER_TAIL_BYTES:][cut:]  # any suffix: the whole order, or nothing at all
    assert order_at_end(shorter) in (None, whole["order"])


@settings(max_examples=100, deadline=None)
@given(_markers(order=False))
def test_a_marker_without_an_order_shows_none_at_its_end(drawn):
    data, _ = drawn
    assert "order" not in parse_commit(data)
    assert order_at_end(data[-ORDER_TAIL_BYTES:]) is None  # the listing then reads it whole


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_give_a_valid_order_or_none(tail):
    for candidate in (tail, tail + b', "version": 1}', b', "order": ' + tail + b', "version": 1}'):
        found = order_at_end(candidate)
        assert found is None or (isinstance(found, dict) and found["counter"] > 0)


@pytest.mark.parametrize(
    "end",
    [
        b', "order": {"counter": 0, "step": 1}, "version": 1}',  # a counter is positive
        b', "order": {"counter": 3, "step": -1}, "version": 1}',
        b', "order": {"counter": 3, "step": 1, "run": "a-b"}, "version": 1}',  # a run is letters and digits
        b', "order": {"counter": 3, "step": 1}, "version": 2}',  # another version: read whole, refused there
        b', "order": {"counter": 3, "step": 1}, "version": 1}\n',  # not the writer's bytes
        b', "order": {"counter": 3, "step": 1}}, "version": 1}',  # the object is not the marker's own key
        b', "order": [3, 1], "version": 1}',
        b', "order": {"counter": 3, "step": 1} , "version": 1}',
    ],
)
def test_crafted_ends_show_no_order(end):
    assert order_at_end(b'{"files": {}' + end) is None


def test_the_order_is_read_from_the_last_key_not_from_names_inside_the_marker():
    inside = 'a, "order": {"counter": 99, "step": 99}, "version": 1}'
    index = {"a": 1, inside: [inside], "order": {"counter": 99, "step": 99}}  # a key "order" inside, too
    data = encode_commit(metadata_bytes=b"m", files={}, order={"counter": 2, "step": 5}, index=index)
    assert json.loads(data)["order"] == {"counter": 2, "step": 5}
    assert order_at_end(data[-ORDER_TAIL_BYTES:]) == {"counter": 2, "step": 5}


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        ({".commit", ".metadata", "__0_0.distcp"}, "dcp"),  # ours, committed
        ({".metadata", "__0_0.distcp"}, "dcp"),  # dcp.save's own
        ({".metadata", "__0_0.distcp", "meta.pt"}, "lightning"),  # Lightning's sharded strategies
        ({"meta.pt"}, "lightning"),
        ({"__0_0.distcp"}, None),  # an interrupted save of ours: no checkpoint (yet)
        ({"model.safetensors", "config.json"}, None),
        (set(), None),
    ],
)
def test_a_listing_names_its_kind(names, kind):
    assert checkpoint_kind(names) == kind


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("/runs/step=4.ckpt/.commit", True),
        ("s3://bucket/runs/step=4.ckpt/.commit/", True),
        (".commit", True),
        ("/runs/step=4.ckpt", False),
        ("/runs/.commit.ckpt", False),
        ("/runs/x.commit", False),
    ],
)
def test_a_marker_path_is_a_path_ending_in_the_marker(path, named):
    assert is_marker_path(path) is named
