"""Our checkpoints are plain DCP checkpoints: torch's own reader and planner load them unchanged."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from lightning_dcp import DCPCheckpointIO


def test_stock_dcp_reader_loads_our_files(tmp_path):
    state = {f"w{i}": torch.randn(257, 31) for i in range(3)}
    state["half"] = torch.randn(64, dtype=torch.bfloat16)
    path = str(tmp_path / "a.ckpt")
    DCPCheckpointIO(thread_count=2).save_checkpoint({"state_dict": state, "global_step": 1}, path)
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)  # torch's reader, default planner
    for key, value in state.items():
        assert torch.equal(target["state_dict"][key], value)
    assert torch.serialization.get_crc32_options()  # our save left torch's process-wide setting as it was
