"""Local load planning: the same read items as DCP's planner, in one pass; a load without the central round trip."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

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
