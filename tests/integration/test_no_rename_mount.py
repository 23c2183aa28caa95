"""Saves on a mount that cannot rename (issue 40, item 8): FUSE mounts of object stores refuse ``rename`` (``EXDEV``)
and ``chmod`` (``EPERM``). Stock Lightning saves there; so do we, copying with the ``.commit`` marker written last.

The mount is simulated as Lightning's own test simulates it: ``os.rename`` (and ``os.replace``) raise ``EXDEV``,
``os.chmod`` raises ``EPERM``; everything else is the real local filesystem.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from lightning_dcp import CheckpointError, DCPCheckpointIO, DCPModelCheckpoint, verify_checkpoint
from lightning_dcp.engine.storage import localfs
from lightning_dcp.engine.storage.location import Location
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed, snapshot


@pytest.fixture
def no_renames(monkeypatch):
    def rename(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src), None, str(dst))

    def chmod(path, *args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(localfs, "_rename_exchange", lambda src, dst: False)  # renameat2, called through ctypes
    monkeypatch.setattr(os, "replace", rename)
    monkeypatch.setattr(os, "chmod", chmod)


def _fit(dirpath: str, max_steps: int, ckpt_path: str | None = None, **checkpoint_kwargs):
    seed()
    callback = DCPModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=4, **checkpoint_kwargs)
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=-1, max_steps=max_steps, callbacks=[callback])
    trainer.fit(TinyModel(), datamodule=RandomDataModule(n=16), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("save_last", [False, True, "link"])
def test_a_trainer_saves_and_resumes_on_a_mount_that_cannot_rename(tmp_path, no_renames, save_last):
    reference = snapshot(_fit(str(tmp_path / "reference"), max_steps=12))
    dirpath = str(tmp_path / "run")
    _fit(dirpath, max_steps=8, save_top_k=-1, save_last=save_last)
    names = sorted(n for n in os.listdir(dirpath) if not n.startswith("."))
    assert {"step=4.ckpt", "step=8.ckpt"} <= set(names), names
    assert not [n for n in os.listdir(dirpath) if n.startswith(".")], "staging or copies left behind"
    for name in ("step=4.ckpt", "step=8.ckpt"):
        verify_checkpoint(os.path.join(dirpath, name), full=True)
    resumed = _fit(dirpath, max_steps=12, ckpt_path="last", save_top_k=-1, save_last=save_last)
    got = snapshot(resumed)
    for key in ("params", "optimizers", "global_step"):
        assert_same(reference[key], got[key], key)


def test_a_copy_cut_before_its_marker_is_no_checkpoint(tmp_path, no_renames, monkeypatch):
    """A crash while a checkpoint replacing another is copied in place: the directory has no ``.commit``, and the
    newest committed checkpoint left is what ``last`` resumes."""
    io = DCPCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, str(tmp_path / "step=1.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.full((3,), 5.0)}, "global_step": 5}, str(tmp_path / "s2.ckpt"))
    real_fsync_tree = localfs._fsync_tree

    def crash_before_the_marker(root):
        real_fsync_tree(root)
        if os.path.basename(root) == "s2.ckpt":
            raise KeyboardInterrupt  # the process dies between the data and the marker

    monkeypatch.setattr(localfs, "_fsync_tree", crash_before_the_marker)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.full((3,), 2.0)}, "global_step": 2}, str(tmp_path / "s2.ckpt"))
    assert not os.path.exists(tmp_path / "s2.ckpt" / ".commit")
    assert not Location(str(tmp_path / "s2.ckpt")).is_committed()
    with pytest.raises(CheckpointError):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "s2.ckpt"))
    last = DCPCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))  # s2.ckpt's old content went first
    assert last["global_step"] == 1 and torch.equal(last["state_dict"]["w"], torch.ones(3))
    io.save_checkpoint({"state_dict": {"w": torch.full((3,), 3.0)}, "global_step": 3}, str(tmp_path / "s2.ckpt"))
    loaded = DCPCheckpointIO().load_checkpoint(str(tmp_path / "s2.ckpt"))  # the next save to that name: whole
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], torch.full((3,), 3.0))
