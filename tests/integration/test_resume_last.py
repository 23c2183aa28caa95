"""``fit(ckpt_path="last")`` through a real Trainer: the newest committed and valid checkpoint, whatever happened to the
newest one, the ``last`` link or a neighbour's ``.commit``; never a fresh start while a committed checkpoint exists."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from lightning_dcp import CheckpointError, DCPCheckpointIO, DCPModelCheckpoint, StateDictMismatchError
from tests._crafting import edit_commit
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed, snapshot


def _fit(dirpath: str, max_steps: int, ckpt_path: str | None = None, model=None, **checkpoint_kwargs):
    seed()
    model = model if model is not None else TinyModel()
    kwargs = {"every_n_train_steps": 4, "save_top_k": -1, "save_last": "link", **checkpoint_kwargs}
    callback = DCPModelCheckpoint(dirpath=dirpath, filename="{step}", **kwargs)
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=-1, max_steps=max_steps, callbacks=[callback])
    trainer.fit(model, datamodule=RandomDataModule(n=16), ckpt_path=ckpt_path)  # 4 steps per epoch
    return trainer, model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    trainer, _ = _fit(str(tmp_path_factory.mktemp("reference")), max_steps=12)
    return snapshot(trainer)


def _record_of(path: str, fqn: str):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the test's own checkpoint
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def _flip_inside(path: str, fqn: str) -> None:
    info = _record_of(path, fqn)
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(info.offset + info.length // 2)
        f.write(bytes([byte[0] ^ 0x10]))


def _wrong_digests(marker: dict) -> dict:
    for entry in marker["files"].values():
        entry["records"] = [[o, n, (d + 1) % 2**64] for o, n, d in entry["records"]]
    return marker


def _damage_commit_records(path: str) -> None:
    """Change the first record's offset in ``.commit`` without resealing it: only a read of the whole marker sees it
    (a listing ranks checkpoints by the order at each marker's end)."""
    with open(os.path.join(path, ".commit"), "r+b") as f:
        data = f.read()
        at = data.index(b'"records": [[') + len(b'"records": [[')
        f.seek(at)
        f.write(b"1" if data[at : at + 1] != b"1" else b"2")


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: _flip_inside(p, "state_dict.body.0.weight"),
        lambda p: _flip_inside(p, "lightning"),
        lambda p: edit_commit(p, _wrong_digests),
        _damage_commit_records,
    ],
    ids=["tensor-record", "non-tensor-blob", "commit-digests", "commit-records"],
)
def test_damaged_newest_falls_back_to_the_older_committed_one(tmp_path, reference, damage):
    dirpath = str(tmp_path)
    _fit(dirpath, max_steps=8)
    damage(os.path.join(dirpath, "step=8.ckpt"))
    with pytest.warns(UserWarning, match=r"step=8\.ckpt.*Resuming from the newest valid checkpoint instead.*step=4"):
        trainer, model = _fit(dirpath, max_steps=12, ckpt_path="last")
    assert len(model.losses) == 8  # steps 4..12: it resumed from step 4
    got = snapshot(trainer)
    for key in ("params", "optimizers", "global_step"):
        assert_same(reference[key], got[key], key)


def test_dangling_or_stale_link_and_a_malformed_neighbour_still_resume_the_newest(tmp_path, reference):
    dirpath = str(tmp_path)
    _fit(dirpath, max_steps=8)
    last = os.path.join(dirpath, "last.ckpt")
    os.unlink(last)
    os.symlink("step=99.ckpt", last)  # dangling, as a kill during an async save used to leave it
    with open(os.path.join(dirpath, "step=4.ckpt", ".commit"), "w") as f:
        f.write("[1, 2]")  # a malformed marker in the same directory must not block anything
    with pytest.warns(UserWarning, match=r"skipping .*step=4\.ckpt"):
        trainer, model = _fit(dirpath, max_steps=12, ckpt_path="last")
    assert len(model.losses) == 4  # steps 8..12
    assert_same(reference["params"], snapshot(trainer)["params"], "params")


def test_without_save_last_a_committed_checkpoint_is_still_resumed(tmp_path, reference):
    dirpath = str(tmp_path)
    _fit(dirpath, max_steps=8, save_last=False)
    assert not os.path.lexists(os.path.join(dirpath, "last.ckpt"))
    trainer, model = _fit(dirpath, max_steps=12, ckpt_path="last", save_last=False)
    assert len(model.losses) == 4
    assert_same(reference["params"], snapshot(trainer)["params"], "params")


def test_nothing_committed_starts_fresh(tmp_path):
    os.makedirs(tmp_path / "step=4.ckpt")  # a first save that was killed: nothing committed
    _, model = _fit(str(tmp_path), max_steps=4, ckpt_path="last")
    assert len(model.losses) == 4


def test_fewer_optimizers_than_saved_fail_clearly(tmp_path):
    _fit(str(tmp_path), max_steps=4, model=TinyModel(two_optimizers=True))
    with pytest.raises(StateDictMismatchError, match=r"2 optimizer\(s\), but 1 are configured"):
        _fit(str(tmp_path), max_steps=8, ckpt_path="last", model=TinyModel())


def test_a_failed_commit_is_a_checkpoint_error_and_keeps_the_old_checkpoint(tmp_path):
    target = tmp_path / "a.ckpt"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        io = DCPCheckpointIO()
        io.save_checkpoint({"state_dict": {}, "global_step": 1}, str(tmp_path / "b.ckpt"))
        # a.ckpt is a mount point holding a committed checkpoint: the save stages beside it, and the commit's
        # rename onto a mount point fails (EBUSY) as a storage failure in the commit phase would.
        io.checkpointer._transaction.committed_in.clear()
        for name in os.listdir(tmp_path / "b.ckpt"):
            with open(tmp_path / "b.ckpt" / name, "rb") as src, open(target / name, "wb") as dst:
                dst.write(src.read())
        with pytest.raises(CheckpointError, match=r"Committing the checkpoint to .*a\.ckpt.* failed on rank 0"):
            io.save_checkpoint({"state_dict": {}, "global_step": 2}, str(target))
        assert io.load_checkpoint(str(target))["global_step"] == 1  # the old checkpoint is intact
    finally:
        subprocess.run(["umount", str(target)], check=True)


def _run_link_train(dirpath: str, max_steps: int, ckpt_path: str = "-", *, kill_at: int = 0):
    command = [sys.executable, "-m", "tests.integration._link_kill_train", dirpath, str(max_steps), ckpt_path]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([*command, str(kill_at)], cwd=root, capture_output=True, text=True, timeout=240)
    assert done.returncode == (-signal.SIGKILL if kill_at else 0), done.stderr[-3000:]
    with open(os.path.join(os.path.dirname(dirpath), "resumed.json")) as f:
        return json.load(f)["start_step"]


def test_a_kill_between_lightnings_link_removal_and_relink_still_resumes_the_newest(tmp_path):
    """Lightning's own ``ModelCheckpoint`` removes ``last.ckpt`` and then links it anew; a ``kill -9`` in between
    leaves committed checkpoints and no ``last*`` entry. ``fit(ckpt_path="last")`` resumes the newest of them (stock
    Lightning's candidates are ``last*`` names only: it would start from step 0), with the values of a resume from
    that checkpoint named explicitly."""
    dirpath = str(tmp_path / "killed" / "ckpts")
    _run_link_train(dirpath, 12, kill_at=2)  # killed inside the link after the save at step 8
    assert sorted(os.listdir(dirpath)) == ["step=4.ckpt", "step=8.ckpt"]  # no last.ckpt
    shutil.copytree(dirpath, tmp_path / "named" / "ckpts")
    assert _run_link_train(dirpath, 12, "last") == 8
    assert os.path.islink(os.path.join(dirpath, "last.ckpt"))
    named = str(tmp_path / "named" / "ckpts")
    assert _run_link_train(named, 12, os.path.join(named, "step=8.ckpt")) == 8
    expected, got = torch.load(tmp_path / "named" / "final.pt"), torch.load(tmp_path / "killed" / "final.pt")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
