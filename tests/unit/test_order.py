"""The order door: which checkpoint of a directory is the newest comes from what the saves recorded, never a clock."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_dcp import DCPCheckpointIO
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.format.marker import MarkerError, encode_commit, order_key, parse_commit
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.fabric import latest_checkpoint
from tests._crafting import edit_commit, sealed


def _save(io: DCPCheckpointIO, path: str, step: int) -> None:
    io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, path)


def _loaded_step(path: str) -> int:
    return int(DCPCheckpointIO().load_checkpoint(path)["global_step"])


def _set_committed_at(path: str, when: float) -> None:
    edit_commit(path, lambda marker: {**marker, "committed_at": when})


def test_marker_records_counter_and_step(tmp_path):
    io = DCPCheckpointIO()
    for step in (2, 4):
        _save(io, str(tmp_path / f"step={step}.ckpt"), step)
    orders = [json.loads((tmp_path / f"step={s}.ckpt" / ".commit").read_text())["order"] for s in (2, 4)]
    assert [(o["counter"], o["step"]) for o in orders] == [(1, 2), (2, 4)]
    assert orders[0]["run"] == orders[1]["run"] and len(orders[0]["run"]) == 12  # one process, one run


def test_newest_ignores_committed_at_in_either_direction(tmp_path):
    io = DCPCheckpointIO()
    for step in (2, 4, 6):
        _save(io, str(tmp_path / f"step={step}.ckpt"), step)
    # A clock an hour fast for the oldest, an hour slow for the newest, and the epoch itself for the middle one.
    _set_committed_at(str(tmp_path / "step=2.ckpt"), 4e9)
    _set_committed_at(str(tmp_path / "step=4.ckpt"), 0.0)
    _set_committed_at(str(tmp_path / "step=6.ckpt"), 1.0)
    names = [c.name for _, c in committed_checkpoints(Location(str(tmp_path)))]
    assert names == ["step=6.ckpt", "step=4.ckpt", "step=2.ckpt"]
    assert _loaded_step(str(tmp_path / "last.ckpt")) == 6
    assert latest_checkpoint(str(tmp_path)).endswith("step=6.ckpt")


def test_a_new_process_counts_on_from_the_directory(tmp_path):
    _save(DCPCheckpointIO(), str(tmp_path / "step=6.ckpt"), 6)
    _set_committed_at(str(tmp_path / "step=6.ckpt"), 4e9)  # saved by a machine whose clock ran far ahead
    # A rewind: a later run (another process, another clock) resumed from an older step and saved again.
    _save(DCPCheckpointIO(), str(tmp_path / "step=3.ckpt"), 3)
    order = json.loads((tmp_path / "step=3.ckpt" / ".commit").read_text())["order"]
    assert (order["counter"], order["step"]) == (2, 3)
    assert _loaded_step(str(tmp_path / "last.ckpt")) == 3  # the newest save wins, not the largest step or clock


def test_checkpoints_without_an_order_are_older_than_ordered_ones(tmp_path):
    io = DCPCheckpointIO()
    for step in (1, 2, 3):
        _save(io, str(tmp_path / f"step={step}.ckpt"), step)
    for step, when in ((1, 300.0), (2, 200.0)):  # written before the order existed: only their clock orders them
        edit_commit(
            str(tmp_path / f"step={step}.ckpt"),
            lambda m, w=when: {**{k: v for k, v in m.items() if k != "order"}, "committed_at": w},
        )
    names = [c.name for _, c in committed_checkpoints(Location(str(tmp_path)))]
    assert names == ["step=3.ckpt", "step=1.ckpt", "step=2.ckpt"]


@pytest.mark.parametrize(
    "order",
    [
        {"counter": 0, "step": 1},
        {"counter": -1},
        {"counter": True},
        {"counter": 1, "step": -2},
        {"counter": 1, "step": "7"},
        {"counter": 2.5},
        [1, 2],
        "1",
        {"step": 3},
    ],
)
def test_malformed_order_is_refused(order):
    marker = json.loads(encode_commit(metadata_bytes=b"x", files={}))
    marker["order"] = order
    with pytest.raises(MarkerError, match="'order'"):
        parse_commit(sealed(marker))


def test_order_key_compares_counter_then_step():
    def key(counter, step):
        return order_key(
            parse_commit(encode_commit(metadata_bytes=b"", files={}, order={"counter": counter, "step": step}))
        )

    assert key(2, 1) > key(1, 100) > key(1, None)
