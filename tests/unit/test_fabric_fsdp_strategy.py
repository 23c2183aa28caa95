"""Fabric's ``DCPFSDPStrategy`` (FSDP1) on a CPU-only machine: what can be checked without a GPU.

FSDP1 refuses CPU, so the wrapping itself is for tests/gpu. Here: the registry builds it, it takes no CheckpointIO
plugin, ``fabric.setup_module`` fails with torch's clear error, and ``fabric.save``/``fabric.load`` route through the
engine (a committed DCP directory, read back exactly) rather than Fabric's ``torch.save``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.fabric import DCPFSDPStrategy, DCPStrategyMixin


def test_dcp_fsdp_construction_and_plugin_refusal():
    strategy = DCPFSDPStrategy(thread_count=2, sync_files=False)
    assert isinstance(strategy.checkpointer, Checkpointer) and strategy.checkpointer.thread_count == 2
    assert DCPFSDPStrategy.save_checkpoint is DCPStrategyMixin.save_checkpoint
    assert DCPFSDPStrategy.load_checkpoint is DCPStrategyMixin.load_checkpoint
    with pytest.raises(TypeError, match=r"takes no CheckpointIO plugin .* `DCPFSDPStrategy\(storage_options="):
        DCPFSDPStrategy(checkpoint_io=TorchCheckpointIO())


def test_dcp_fsdp_on_cpu_refuses_to_wrap_and_saves_through_the_engine(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_fsdp")
    assert type(fabric.strategy) is DCPFSDPStrategy
    fabric.launch()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        with pytest.raises(RuntimeError, match="FSDP needs a non-CPU accelerator device"):
            fabric.setup_module(model)
        path = str(tmp_path / "step-1")
        fabric.save(path, {"model": model, "step": 1})
        assert sorted(os.listdir(path)) == [".commit", ".metadata", "__0_0.distcp"]  # DCP, committed; no torch.save
        other = torch.nn.Linear(4, 4)
        remainder = fabric.load(path, {"model": other})
        assert remainder == {"step": 1}
        torch.testing.assert_close(other.state_dict(), model.state_dict(), rtol=0, atol=0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
