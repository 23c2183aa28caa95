"""``DurableCatalog``: one answer to "which committed checkpoints does this directory hold, newest first, and which is
whole", without a local tier and with one (a local directory as the fast tier of a ``memory://`` remote)."""

from __future__ import annotations

import os
import uuid

import torch

from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.config import CheckpointerConfig
from lightning_dcp.engine.format.marker import METADATA_FILE
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import DurableCatalog


def _tree(value: float) -> dict:
    return {"state_dict": {"w": torch.full((8, 3), value)}}


def test_a_marker_damaged_before_its_end_is_ranked_but_never_the_newest_committed(tmp_path):
    checkpointer = Checkpointer()
    for step in (1, 2):
        checkpointer.save(_tree(step), str(tmp_path / f"step-{step}"), step=step)
    marker = tmp_path / "step-2" / ".commit"
    data = marker.read_bytes()
    at = data.index(b'"records": [[') + len(b'"records": [[')
    marker.write_bytes(data[:at] + (b"1" if data[at : at + 1] != b"1" else b"2") + data[at + 1 :])  # not resealed
    directory = Location(str(tmp_path))
    catalog = checkpointer.catalog
    assert [loc.name for _, loc in catalog.checkpoints(directory)] == ["step-2", "step-1"]  # ranked by the end
    key, newest = catalog.newest_committed(directory)  # the memory tier and latest_checkpoint compare with this one
    assert newest.name == "step-1" and key == catalog.checkpoints(directory)[1][0]
    assert catalog.newest_valid(directory)[0].name == "step-1"


def test_a_directory_lists_newest_first_and_the_newest_whole_one_is_chosen(tmp_path):
    checkpointer = Checkpointer()
    for step in (1, 2, 3):
        checkpointer.save(_tree(step), str(tmp_path / f"step-{step}"), step=step)
    os.makedirs(tmp_path / "interrupted")  # a save that never committed: never listed
    catalog = checkpointer.catalog
    directory = Location(str(tmp_path))
    assert [loc.name for _, loc in catalog.checkpoints(directory)] == ["step-3", "step-2", "step-1"]
    assert [(key, loc.url) for key, loc in catalog.known(directory)] == [
        (key, loc.url) for key, loc in catalog.checkpoints(directory)
    ]
    assert catalog.candidates(directory.child("last")) == [loc.url for _, loc in catalog.checkpoints(directory)]
    with open(tmp_path / "step-3" / METADATA_FILE, "r+b") as f:  # the newest fails the fast checks
        f.write(b"\0" * 16)
    newest, metadata = catalog.newest_valid(directory)
    assert newest.name == "step-2" and metadata.state_dict_metadata
    assert DurableCatalog(None).checkpoints(Location(str(tmp_path / "missing"))) == []


def test_with_a_local_tier_both_tiers_are_listed_and_known_makes_no_remote_call(tmp_path):
    remote = f"memory://durable-{uuid.uuid4().hex[:8]}/run"
    checkpointer = Checkpointer(CheckpointerConfig(local_dir=str(tmp_path / "local")))
    try:
        for step in (1, 2):
            checkpointer.save(_tree(step), f"{remote}/step-{step}", step=step)
        checkpointer.tiers.wait()  # uploaded: each checkpoint is on both tiers
        catalog, directory = checkpointer.catalog, Location(remote)
        listed = [(loc.local, loc.name) for _, loc in catalog.checkpoints(directory)]
        assert listed == [(True, "step-2"), (False, "step-2"), (True, "step-1"), (False, "step-1")]
        assert [loc.name for _, loc in catalog.known(directory)][:2] == ["step-2", "step-2"]
        newest, _ = catalog.newest_valid(directory)
        assert newest.local and newest.name == "step-2"  # the local copy first
        assert catalog.candidates(directory.child("last"))[0] == newest.url
    finally:
        checkpointer.close()
