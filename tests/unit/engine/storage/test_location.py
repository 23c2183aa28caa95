"""``Location``: staging names, and cleaning a directory after crashed saves (``remove_incomplete``)."""

from __future__ import annotations

import os

import torch

from lightning_dcp.engine import Checkpointer, CheckpointerConfig, Location
from lightning_dcp.engine.storage.names import is_staging_of, new_token, staging_name


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


def test_staging_without_a_token_is_a_fresh_hidden_sibling_that_remove_stale_staging_clears(tmp_path):
    location = Location(str(tmp_path / "step=2.ckpt"))
    first, second = location.staging(), location.staging()

    assert first.url != second.url
    for staging in (first, second):
        assert os.path.dirname(staging.path) == str(tmp_path)
        assert staging.name.startswith(".") and is_staging_of(staging.name, "step=2.ckpt")
    assert location.staging("0123456789ab").name == staging_name("step=2.ckpt", "0123456789ab")

    for staging in (first, second):
        os.makedirs(staging.path)
    kept = first.name.removeprefix(staging_name("step=2.ckpt", ""))
    assert location.remove_stale_staging(keep=kept) == [second.url]
    assert os.listdir(tmp_path) == [first.name]
