"""``Location``: cleaning a directory after crashed saves (``remove_incomplete``)."""

from __future__ import annotations

import os

import torch

from lightning_dcp.engine import Checkpointer, CheckpointerConfig, Location
from lightning_dcp.engine.storage.names import new_token, staging_name


def test_remove_incomplete_keeps_committed_and_busy_checkpoints_and_foreign_entries(tmp_path):
    checkpointer = Checkpointer(CheckpointerConfig())
    checkpointer.save({"state_dict": {"w": torch.arange(4.0)}}, str(tmp_path / "done.ckpt"))
    for name in ("crashed.ckpt", "uploading.ckpt", "notes", ".hidden.ckpt"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
    stale = staging_name("crashed.ckpt", new_token())
    busy_staging = staging_name("uploading.ckpt", new_token())
    for name in (stale, busy_staging):
        os.makedirs(tmp_path / name)

    removed = Location(str(tmp_path)).remove_incomplete(".ckpt", busy={"uploading.ckpt"})

    assert sorted(os.path.basename(url) for url in removed) == sorted(["crashed.ckpt", stale])
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["done.ckpt", "uploading.ckpt", "notes", ".hidden.ckpt", busy_staging]
    )
    assert Location(str(tmp_path / "done.ckpt")).is_committed()
    assert Location(str(tmp_path)).remove_incomplete(".ckpt", busy={"uploading.ckpt"}) == []
