"""The check of parsed ``.metadata`` (lightning_dcp/engine/format/metadata_check.py): its fast pass over all entries at
once engages on what lightning_dcp writes, and never accepts metadata the per-entry checks refuse (property-tested with
the fuzzing pass's object-level edits of a real checkpoint's metadata)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from lightning_dcp import DCPCheckpointIO
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.format.metadata_check import _plainly_valid, _problem, metadata_problem
from lightning_dcp.engine.storage.location import Location
from tests.chaos._edits import mutate_object

_STATE = {
    "state_dict": {
        "w": torch.arange(12.0).reshape(3, 4),
        "b": torch.ones(3, dtype=torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 5),
    },
    "optimizer_states": [{"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(3, 4)}}}],
    "global_step": 2,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("metadata_check") / "a.ckpt")
    DCPCheckpointIO().save_checkpoint(_STATE, path)
    return read_metadata(Location(path))


def test_the_fast_pass_accepts_what_lightning_dcp_writes(saved):
    assert len(saved.state_dict_metadata) >= 7 and saved.planner_data
    assert _plainly_valid(saved) is True
    assert _problem(saved) is None and metadata_problem(saved) is None


def _chunked_in_two(metadata):
    """``state_dict.w`` (3x4 float32) saved as two row chunks, each with its own record at the end of its file."""
    meta = metadata.state_dict_metadata["state_dict.w"]
    meta.chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 4])),
        ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([1, 4])),
    ]
    storage = metadata.storage_data
    (old,) = [index for index in storage if index.fqn == "state_dict.w"]
    info = storage.pop(old)
    end = max(i.offset + i.length for i in storage.values() if i.relative_path == info.relative_path)
    storage[MetadataIndex("state_dict.w", torch.Size([0, 0]))] = dataclasses.replace(info, offset=end, length=32)
    storage[MetadataIndex("state_dict.w", torch.Size([2, 0]))] = dataclasses.replace(info, offset=end + 32, length=16)


def test_a_tensor_in_several_chunks_is_left_to_the_per_entry_checks(saved):
    metadata = copy.deepcopy(saved)
    _chunked_in_two(metadata)
    assert _plainly_valid(metadata) is False
    assert metadata_problem(metadata) is None  # valid: the per-entry checks accept it


def _first(storage, fqn):
    return next(index for index in storage if index.fqn == fqn)


def _shrink(m):
    index = _first(m.storage_data, "state_dict.w")
    m.storage_data[index] = dataclasses.replace(m.storage_data[index], length=47)


def _overlap(m):
    a, b = _first(m.storage_data, "state_dict.w"), _first(m.storage_data, "state_dict.b")
    m.storage_data[b] = dataclasses.replace(m.storage_data[a], length=m.storage_data[b].length)


def _escape(m):
    index = _first(m.storage_data, "state_dict.b")
    m.storage_data[index] = dataclasses.replace(m.storage_data[index], relative_path="../b.distcp")


def _bool_dim(m):
    m.state_dict_metadata["state_dict.w"].size = (True, 4)


def _moved_chunk(m):
    m.state_dict_metadata["state_dict.w"].chunks[0].offsets = torch.Size([1, 0])


def _misjoined(m):
    key = next(k for k in m.planner_data if k.startswith("optimizer_states"))
    m.planner_data[key] = ("optimizer_states", 1, *m.planner_data[key][2:])


def _no_blob(m):
    m.storage_data.pop(MetadataIndex("lightning"))


def _twin_record(m):
    """A second record of ``state_dict.w`` whose key is made equal to the first's after insertion, as an unpickled
    dict can hold it: a lookup may find either of the two."""
    first = _first(m.storage_data, "state_dict.w")
    twin = MetadataIndex("state_dict.w", torch.Size([1, 0]))
    end = max(i.offset + i.length for i in m.storage_data.values())
    m.storage_data[twin] = dataclasses.replace(m.storage_data[first], offset=end)  # as long: only its key is wrong
    object.__setattr__(twin, "offset", first.offset)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_shrink, "has no record that holds it"),
        (_overlap, "overlap"),
        (_escape, "outside the checkpoint directory"),
        (_bool_dim, "not a sequence of non-negative integers"),
        (_moved_chunk, "lies outside the shape"),
        (_misjoined, "planner_data"),
        (_no_blob, "has no storage record"),
        (_twin_record, "two storage records"),
    ],
    ids=[
        "short-record",
        "overlap",
        "escaping-path",
        "bool-dim",
        "moved-chunk",
        "misjoined-path",
        "no-blob-record",
        "twin-record",
    ],
)
def test_the_fast_pass_refuses_what_the_per_entry_checks_name(saved, edit, match):
    metadata = copy.deepcopy(saved)
    edit(metadata)
    assert _plainly_valid(metadata) is False
    assert match in metadata_problem(metadata)


def _fast(metadata) -> bool:
    try:
        return _plainly_valid(metadata)
    except Exception:  # metadata_problem treats any error of the fast pass as "not shown"
        return False


def _full(metadata) -> str | None:
    try:
        return _problem(metadata)
    except (AttributeError, TypeError, ValueError) as err:  # what load_metadata reports as a missing field
        return repr(err)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), edits=st.integers(1, 3))
def test_the_fast_pass_never_accepts_what_the_per_entry_checks_refuse(saved, data, edits):
    metadata = copy.deepcopy(saved)
    for _ in range(edits):
        try:
            mutate_object(data.draw, metadata, saved)
        except (KeyError, TypeError):  # an earlier edit changed a dict key's hash: its slot cannot be looked up again
            break
    if _fast(metadata):
        assert _full(metadata) is None
