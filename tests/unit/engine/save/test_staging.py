"""The async staging copy: independent of the live tensors, buffers reused across saves."""

from __future__ import annotations

import torch

from lightning_dcp.engine.save.staging import Stager


def test_staged_copy_does_not_see_later_changes_and_reuses_buffers():
    live = {"model": {"w": torch.randn(64, 32), "b": torch.zeros(32)}, "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    stager = Stager(pin_memory=False)
    staged = stager.stage(live)
    expected = live["model"]["w"].clone()
    live["model"]["w"].add_(1.0)
    live["groups"][0]["lr"] = 0.5
    assert torch.equal(staged["model"]["w"], expected)
    assert staged["groups"][0] == {"lr": 0.1, "betas": (0.9, 0.99)}
    pointer = staged["model"]["w"].data_ptr()
    again = stager.stage(live)
    assert again["model"]["w"].data_ptr() == pointer  # same buffer, refreshed in place
    assert torch.equal(again["model"]["w"], live["model"]["w"])
    assert stager.nbytes == (64 * 32 + 32) * 4
    stager.close()
    assert stager.nbytes == 0
