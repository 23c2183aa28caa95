"""Async saves whose staging copies run in the background: optimizer steps wait for them; other changes are caught."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.staging import Stager, StagingRaceError


def test_optimizer_step_right_after_the_save_waits_for_the_staging_copies(tmp_path):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(512, 1024)) for _ in range(8)]  # 2 MiB each: copied in the background
    optimizer = torch.optim.SGD(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    checkpointer = Checkpointer(async_save=True, defer_staging=True)
    path = str(tmp_path / "a.ckpt")
    checkpointer.save({"state_dict": {f"p{i}": p.detach() for i, p in enumerate(params)}}, path, objects={})
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the next training step: changes every parameter once the copies are made
    checkpointer.wait()
    loaded = Checkpointer().load(path).tree["state_dict"]
    for i, value in enumerate(before):
        assert torch.equal(loaded[f"p{i}"], value)
        assert torch.equal(params[i].detach(), value - 1.0)
    assert os.path.isfile(os.path.join(path, ".commit"))
    checkpointer.close()


def test_a_tensor_changed_before_its_deferred_copy_fails_the_save_instead_of_tearing_it():
    live = torch.randn(256, 1024)
    item = WriteItem(index=MetadataIndex("w", [0, 0]), type=WriteItemType.TENSOR)
    stager = Stager(pin_memory=False)
    staged, deferred = stager.stage_items([item], lambda _: live, defer_from=1 << 20)
    assert len(deferred) == 1 and staged[item.index] is deferred[0].buffer
    live.add_(1.0)  # changed in place after the save was planned, outside an optimizer step
    with pytest.raises(StagingRaceError, match="'w' was modified in place"):
        Stager.finish(deferred)
    small = torch.randn(16)  # below the threshold: copied at once, later changes are not seen
    staged, deferred = stager.stage_items([item], lambda _: small, defer_from=1 << 20)
    expected = small.clone()
    small.add_(1.0)
    assert deferred == [] and torch.equal(staged[item.index], expected)
