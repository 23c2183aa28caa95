"""``load_one`` (lightning_dcp/engine/load/restore.py) given the caller's own probe: ``Checkpointer.load(checked=...)``.

Fabric's ``load_state`` probes a checkpoint once and loads its parts with that probe; such a load must give what a
load that probes again gives, and must still refuse a record that does not match ``.commit``.
"""

from __future__ import annotations

import os

import pytest
import torch

from lightning_dcp.engine import Checkpointer, Location, layout, probe
from lightning_dcp.engine.storage.commit_reads import read_commit
from lightning_dcp.errors import CorruptCheckpointError


def _objects(loaded) -> dict:
    return {k: v for k, v in loaded.objects.items() if k != layout.INFO_KEY}


def _saved(tmp_path) -> tuple[Checkpointer, str, dict]:
    torch.manual_seed(0)
    tree = {"model": {f"layer{i}.weight": torch.randn(8, 4 + i) for i in range(6)}, "other": {"x": torch.arange(5.0)}}
    checkpointer = Checkpointer()
    path = str(tmp_path / "step-3")
    checkpointer.save(tree, path, objects={"epoch": 3, "note": "kept"})
    return checkpointer, path, tree


@pytest.mark.parametrize("only", [None, ["model"]])
def test_a_load_with_the_callers_probe_gives_what_a_probing_load_gives(tmp_path, only):
    checkpointer, path, tree = _saved(tmp_path)
    found = probe(Location(path))
    assert found.kind == "dcp" and found.metadata is not None

    def target():
        return {key: {k: torch.zeros_like(v) for k, v in tree[key].items()} for key in (only or tree)}

    again = checkpointer.load(path, target=target(), only=only)
    given = checkpointer.load(path, target=target(), only=only, checked=found)
    assert given.url == again.url == found.url
    assert given.objects == again.objects
    assert _objects(given) == ({} if only else {"epoch": 3, "note": "kept"})
    for key in only or tree:
        for name, value in tree[key].items():
            assert torch.equal(given.tree[key][name], value) and torch.equal(again.tree[key][name], value)
    head = checkpointer.load(path, target={}, strict=False, objects_only=True, checked=found)
    assert _objects(head) == {"epoch": 3, "note": "kept"} and head.tree == {}


def test_a_load_with_the_callers_probe_still_checks_every_record(tmp_path):
    checkpointer, path, tree = _saved(tmp_path)
    found = probe(Location(path))
    marker = read_commit(Location(path))
    name = sorted(marker["files"])[0]
    offset, length, _ = marker["files"][name]["records"][-1]
    with open(os.path.join(path, name), "r+b") as f:  # one byte of a record's tensor bytes, after the probe
        f.seek(offset + length - 9)
        byte = f.read(1)
        f.seek(offset + length - 9)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = {key: {k: torch.zeros_like(v) for k, v in tree[key].items()} for key in tree}
    with pytest.raises(CorruptCheckpointError, match=name):
        checkpointer.load(path, target=target, checked=found)
