"""Refusals that name what they refuse (issue 40, item 9): a codec name outside the allow-list carries ``.file``, a
meta-device target gets an error that says what to do instead of "Default process group has not been initialized"."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

import lightning_dcp
from lightning_dcp import CheckpointError, DCPCheckpointIO
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.format import allowlist
from lightning_dcp.engine.format.blob import load_stock_file


@dataclasses.dataclass
class Settings:
    lr: float


def test_a_name_outside_the_allow_list_names_the_entry_that_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(allowlist, "_registered", {})
    lightning_dcp.add_safe_globals([Settings])
    path = str(tmp_path / "a.ckpt")
    Checkpointer().save({"state_dict": {"w": torch.ones(2)}}, path, objects={"hp": Settings(0.1)})
    monkeypatch.setattr(allowlist, "_registered", {})  # a later process that did not register it
    with pytest.raises(CheckpointError, match="not in lightning_dcp's allow-list") as err:
        Checkpointer().load(path, target={"state_dict": {"w": torch.zeros(2)}})
    assert err.value.file == "lightning" and path in str(err.value)
    assert "add_safe_globals([tests.unit.test_refusals.Settings])" in str(err.value)


def test_a_stock_file_naming_a_refused_class_names_the_file():
    buffer = io.BytesIO()
    torch.save({"x": Settings(1.0)}, buffer)
    with pytest.raises(CheckpointError, match="outside lightning_dcp's allow-list") as err:
        load_stock_file(lambda: torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), path="stock.ckpt")
    assert err.value.file == "stock.ckpt"


@pytest.mark.parametrize("front", ["checkpointer", "checkpoint_io"])
def test_a_meta_device_target_is_refused_with_the_fix(tmp_path, front):
    path = str(tmp_path / "a.ckpt")
    state = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    Checkpointer().save({"state_dict": state}, path, objects={"step": 1})
    with torch.device("meta"):
        target = {"state_dict": {"w": torch.empty(3, 4), "b": torch.empty(4)}}
    with pytest.raises(CheckpointError) as err:
        if front == "checkpointer":
            Checkpointer().load(path, target=target)
        else:
            DCPCheckpointIO().load_checkpoint(path, state_dict=target)
    message = str(err.value)
    assert path in message and "on the meta device" in message and "to_empty(device=" in message
    assert "Default process group has not been initialized" not in message
    materialised = {"state_dict": {k: torch.empty_like(v, device="cpu") for k, v in target["state_dict"].items()}}
    loaded = Checkpointer().load(path, target=materialised)  # the fix the message gives
    assert all(torch.equal(loaded.tree["state_dict"][k], v) for k, v in state.items())
