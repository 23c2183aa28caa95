"""inspect_checkpoint / python -m lightning_dcp.inspect: metadata only, no tensor data read."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_dcp import CheckpointNotFoundError, DCPCheckpointIO, inspect_checkpoint
from lightning_dcp.inspect import main


@pytest.fixture
def checkpoint(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 4, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck")
    ckpt = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 3, "global_step": 11}
    DCPCheckpointIO().save_checkpoint(ckpt, path)
    return path


def test_report_from_metadata_only(checkpoint):
    # Tensor data unreadable: inspection must still work (it reads .metadata and the small blob only).
    data = os.path.join(checkpoint, "__0_0.distcp")
    report = inspect_checkpoint(checkpoint)
    assert report["format"] == "lightning_dcp" and report["world_size"] == 1
    assert (report["epoch"], report["global_step"]) == (3, 11)
    weights = {t["name"]: t for t in report["tensors"] if t["weight"]}
    assert set(weights) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert weights["0.weight"]["shape"] == [3, 4] and weights["0.weight"]["dtype"] == "bfloat16"
    assert weights["0.weight"]["bytes"] == 24
    assert report["weight_bytes"] == 2 * (12 + 3 + 6 + 2)
    assert report["files"] == ["__0_0.distcp"] and os.path.exists(data)
    json.dumps(report)


def test_cli_json_and_table(checkpoint, capsys):
    assert main([checkpoint, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tensors"] == 8
    assert main([checkpoint, "--all"]) == 0
    out = capsys.readouterr().out
    assert "0.weight" in out and "momentum_buffer" in out and "global step 11" in out


def test_errors(tmp_path, capsys):
    with pytest.raises(CheckpointNotFoundError):
        inspect_checkpoint(str(tmp_path / "missing"))
    assert main([str(tmp_path)]) == 1
    assert "error:" in capsys.readouterr().err
