"""Local load planning: the same read items as DCP's planner, in one pass; a load without the central round trip."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from lightning_dcp import CorruptCheckpointError
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.load.dcp_reader import storage_reader
from lightning_dcp.engine.load.local_load import FastLoadPlanner, load
from lightning_dcp.engine.save import planning
from lightning_dcp.engine.storage.location import Location
from tests._crafting import write_commit


def _items(plan) -> set:
    return {
        (
            i.type,
            i.dest_index.fqn,
            tuple(i.dest_index.offset or ()),
            i.storage_index.fqn,
            tuple(i.storage_index.offset or ()),
            tuple(i.dest_offsets),
            tuple(i.storage_offsets),
            tuple(i.lengths),
        )
        for i in plan.items
    }


def test_fast_local_plan_equals_dcps_for_whole_chunked_partial_and_blob_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(planning, "CHUNK_BYTES", 1 << 12)  # "big" (16 KiB) is saved in 4 row chunks
    torch.manual_seed(0)
    tree = {"state_dict": {"big": torch.randn(64, 64), "w": torch.randn(5), "s": torch.tensor(2.0)}, "extra": {"e": 1}}
    path = str(tmp_path / "c.ckpt")
    Checkpointer(CheckpointerConfig(thread_count=2)).save(tree, path, objects={"k": 1})
    reader = storage_reader(Location(path))
    metadata = reader.read_metadata()
    assert len(metadata.state_dict_metadata["state_dict.big"].chunks) == 4
    for partial in (False, True):
        target = {"state_dict": {k: torch.zeros_like(v) for k, v in tree["state_dict"].items()}, "extra": {"e": 0}}
        if partial:
            del target["state_dict"]["w"]  # a target with fewer keys than the checkpoint
        plans = []
        for planner in (FastLoadPlanner(allow_partial_load=partial), DefaultLoadPlanner(allow_partial_load=partial)):
            planner.set_up_planner(target, metadata, True)
            plans.append(_items(planner.create_local_plan()))
        assert plans[0] == plans[1], partial
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in tree["state_dict"].items()}}
    Checkpointer().load(path, target=target, strict=False, only=["state_dict"])
    for key, value in tree["state_dict"].items():
        assert torch.equal(target["state_dict"][key], value), key


def test_runs_of_small_records_load_bit_equal_and_any_damaged_byte_fails_naming_the_file(tmp_path):
    torch.manual_seed(1)
    tree = {"state_dict": {f"l{i}.{p}": torch.randn(3 + i % 5, 4) for i in range(120) for p in ("w", "b")}}
    tree["state_dict"]["steps"] = torch.arange(7, dtype=torch.int64)
    path = str(tmp_path / "c.ckpt")
    Checkpointer().save(tree, path, objects={"k": 1})

    def load() -> dict:
        target = {"state_dict": {k: torch.full_like(v, -1) for k, v in tree["state_dict"].items()}}
        Checkpointer().load(path, target=target, only=["state_dict"])
        return target["state_dict"]

    loaded = load()  # many records, read in runs with one call each
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in tree["state_dict"].items())
    commit = json.loads((tmp_path / "c.ckpt" / ".commit").read_text())
    name, entry = max(commit["files"].items(), key=lambda e: len(e[1]["records"]))
    records = sorted(entry["records"])
    offset, length, _ = records[len(records) // 2]  # a record inside a run
    for position in (offset + 3, offset + length // 2, offset + length - 5):  # its framing, data, directory
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(position)
            byte = f.read(1)
            f.seek(position)
            f.write(bytes([byte[0] ^ 0x20]))
            f.flush()
            with pytest.raises(CorruptCheckpointError, match=name):
                load()
            f.seek(position)
            f.write(byte)
    loaded = load()
    assert all(torch.equal(loaded[k], v) for k, v in tree["state_dict"].items())


def test_whole_tensors_are_copied_into_their_targets_and_other_targets_take_the_general_way(tmp_path):
    torch.manual_seed(2)
    tree = {
        "state_dict": {
            "a": torch.randn(6, 5),
            "b": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "c": torch.randn(4, 4),
            "d": torch.randn(3).to(torch.bfloat16),
            "z": torch.empty(0, 3),
        }
    }
    path = str(tmp_path / "c.ckpt")
    Checkpointer().save(tree, path, objects={"k": 1})
    committed: list[str] = []

    class Recording(FastLoadPlanner):  # a commit_tensor that does something: every tensor must reach it
        def commit_tensor(self, read_item, tensor) -> None:
            committed.append(read_item.dest_index.fqn)

    for planner in (FastLoadPlanner(), Recording()):
        target = {"state_dict": {k: torch.full_like(v, 7) for k, v in tree["state_dict"].items()}}
        target["state_dict"]["c"] = torch.full((4, 4), 7.0).t()  # a non-contiguous view: not copied into as it is
        target["state_dict"]["a"] = torch.nn.Parameter(target["state_dict"]["a"])
        load(target, reader=storage_reader(Location(path)), planner=planner, distributed=False)
        for key, value in tree["state_dict"].items():
            assert torch.equal(target["state_dict"][key], value) and target["state_dict"][key].dtype == value.dtype
        if type(planner) is FastLoadPlanner:
            assert set(planner.direct) == {f"state_dict.{k}" for k in "abdz"}
        else:
            assert planner.direct == {}
    assert sorted(committed) == [f"state_dict.{k}" for k in "abcdz"]


def _four_saved(tmp_path):
    """Four float32 (5, 3) tensors saved: the tree, the path, its parsed ``.commit``, a data file's name, its marker
    entry and its bytes (to alter, then write back with the marker)."""
    tree = {"state_dict": {f"w{i}": torch.randn(5, 3) for i in range(4)}}
    path = tmp_path / "c.ckpt"
    Checkpointer().save(tree, str(path), objects={"k": 1})
    commit = json.loads((path / ".commit").read_text())
    name, entry = next((n, e) for n, e in commit["files"].items() if len(e["records"]) > 2)
    return tree, path, commit, name, entry, bytearray((path / name).read_bytes())


def test_a_record_in_another_writers_framing_loads_through_torch_load(tmp_path):
    """A record whose checksum matches but whose framing is not ours byte for byte takes the general way, and loads."""
    import io

    from lightning_dcp.engine.format.marker import checksum

    tree, path, commit, name, entry, data = _four_saved(tmp_path)
    changed = 0
    for record_entry in entry["records"]:
        offset, length, _ = record_entry
        record = bytearray(data[offset : offset + length])
        pad = record.find(b"\x44\x4c", 0, 600)  # our alignment field in data/0's local header (zip readers skip it)
        if pad < 0 or record[pad + 4 : pad + 6] != b"\0\0":
            continue
        record[pad + 4] = 0x55  # another writer's padding: torch.load reads the record as before
        before = torch.load(io.BytesIO(bytes(data[offset : offset + length])), weights_only=True)
        assert torch.equal(torch.load(io.BytesIO(bytes(record)), weights_only=True), before)
        data[offset : offset + length] = record
        record_entry[2] = checksum(bytes(record))
        changed += 1
    assert changed >= 2
    (path / name).write_bytes(bytes(data))
    write_commit(str(path), commit)
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in tree["state_dict"].items()}}
    planner = FastLoadPlanner()
    load(target, reader=storage_reader(Location(str(path))), planner=planner, distributed=False)
    assert len(planner.direct) == 4  # listed for the copy, yet their framing sent them to torch.load
    assert all(torch.equal(target["state_dict"][k], v) for k, v in tree["state_dict"].items())


def test_a_record_framed_as_another_dtype_is_refused_naming_the_file(tmp_path):
    """Same length, checksum recorded, but its archive holds int32 where the metadata says float32: never copied."""
    from lightning_dcp.engine.format.marker import checksum
    from lightning_dcp.engine.format.records import raw_bytes, tensor_record

    tree, path, commit, name, entry, data = _four_saved(tmp_path)
    layout = tensor_record(torch.int32, (5, 3))
    other = layout.prefix + bytes(raw_bytes(torch.arange(15, dtype=torch.int32).reshape(5, 3))) + layout.suffix
    record_entry = next(r for r in entry["records"] if r[1] == len(other))  # a float32 (5, 3) record
    data[record_entry[0] : record_entry[0] + len(other)] = other
    record_entry[2] = checksum(other)
    (path / name).write_bytes(bytes(data))
    write_commit(str(path), commit)
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in tree["state_dict"].items()}}
    with pytest.raises(CorruptCheckpointError, match=f"{name}.*holds torch.int32"):
        Checkpointer().load(str(path), target=target, only=["state_dict"])
