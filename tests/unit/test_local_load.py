"""Local load planning: the same read items as DCP's planner, in one pass; a load without the central round trip."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from lightning_dcp import CorruptCheckpointError
from lightning_dcp.engine import planning
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.dcp_reader import storage_reader
from lightning_dcp.engine.local_load import FastLoadPlanner
from lightning_dcp.engine.storage import Location


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
    Checkpointer(thread_count=2).save(tree, path, objects={"k": 1})
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
