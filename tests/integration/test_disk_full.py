"""A save into a full disk (a real, small tmpfs): clear error, no partial checkpoint, earlier ones still load."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from lightning_dcp import CheckpointError, DCPCheckpointIO


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.decode().strip()}")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _checkpoint(mb: float) -> dict:
    return {"state_dict": {"w": torch.arange(int(mb * 2**18), dtype=torch.float32)}, "global_step": int(mb)}


def test_disk_full(small_disk):
    io = DCPCheckpointIO()
    io.save_checkpoint(_checkpoint(1), os.path.join(small_disk, "small.ckpt"))
    io.save_checkpoint(_checkpoint(0.5), os.path.join(small_disk, "last.ckpt"))
    with pytest.raises(CheckpointError, match="disk is full"):
        io.save_checkpoint(_checkpoint(2.5), os.path.join(small_disk, "big.ckpt"))
    with pytest.raises(CheckpointError, match="disk is full"):
        io.save_checkpoint(_checkpoint(2.5), os.path.join(small_disk, "last.ckpt"))  # an overwrite that fails
    assert sorted(os.listdir(small_disk)) == ["last.ckpt", "small.ckpt"]  # nothing partial is visible or left
    assert torch.equal(
        io.load_checkpoint(os.path.join(small_disk, "small.ckpt"))["state_dict"]["w"], _checkpoint(1)["state_dict"]["w"]
    )
    assert io.load_checkpoint(os.path.join(small_disk, "last.ckpt"))["global_step"] == 0
