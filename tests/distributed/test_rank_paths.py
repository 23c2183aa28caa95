"""Ranks that disagree on where a checkpoint goes, on 2 real gloo processes.

- Names: ``DCPModelCheckpoint(filename="{step}-{train_loss:.4f}")`` with ``train_loss`` logged without ``sync_dist``
  formats a different name on each rank. Every rank saves to (and removes) rank 0's path, as Lightning's stock
  strategies write rank 0's name; the other rank is told why once.
- Disks: each rank sees its own disk at the same path (a mount namespace and a tmpfs per process, as nodes with
  node-local disks do). Rank 0's directory then lacks rank 1's data file: the commit is refused on every rank with
  the same error, and the checkpoint saved before it is intact.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import warnings

import pytest
from lightning.pytorch import Trainer

from harness.ranks import spawn
from lightning_dcp import CorruptCheckpointError, DCPModelCheckpoint, verify_checkpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import load_result, make_trainer, save_result, seed, snapshot


def _unsynced_worker(rank: int, world_size: int, tmp: str) -> None:
    dirpath = os.path.join(tmp, "unsynced")

    def fit(max_steps: int, ckpt_path: str | None) -> tuple[Trainer, DCPModelCheckpoint, list[str]]:
        seed()
        callback = DCPModelCheckpoint(
            dirpath=dirpath,
            filename="{step}-{train_loss:.4f}",  # TinyModel logs train_loss without sync_dist
            monitor="train_loss",
            save_top_k=2,
            every_n_train_steps=2,
            save_last="link",
        )
        trainer = make_trainer(world_size, max_epochs=-1, max_steps=max_steps, callbacks=[callback])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path=ckpt_path)
        return trainer, callback, [str(w.message) for w in caught if "every rank uses rank 0's path" in str(w.message)]

    trainer, callback, told = fit(10, None)
    listing = sorted(os.listdir(dirpath))
    contents = {name: sorted(os.listdir(os.path.join(dirpath, name))) for name in listing if name != "last.ckpt"}
    if rank == 0:
        for name in contents:
            verify_checkpoint(os.path.join(dirpath, name))  # every committed checkpoint loads, byte for byte
    last = os.path.realpath(os.path.join(dirpath, "last.ckpt"))
    save_result(
        tmp,
        "first",
        rank,
        {"best_k": sorted(callback.best_k_models), "told": told, "listing": listing, "contents": contents},
    )
    save_result(tmp, "first_state", rank, {"last": last, **snapshot(trainer)})
    trainer, _, _ = fit(12, "last")
    save_result(tmp, "resumed", rank, {"global_step": trainer.global_step})


@pytest.fixture(scope="module")
def unsynced(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("unsynced"))
    spawn(_unsynced_worker, 2, tmp)
    return tmp


def test_unsynced_metric_in_filename_saves_rank0s_name_on_every_rank(unsynced):
    first = [load_result(unsynced, "first", rank) for rank in (0, 1)]
    assert first[0]["best_k"] != first[1]["best_k"]  # the ranks did format different names
    kept = sorted(os.path.basename(p) for p in first[0]["best_k"])
    assert first[0]["listing"] == sorted([*kept, "last.ckpt"])  # rank 0's top-k, no orphans of rank 1
    assert first[0]["contents"] == {name: [".commit", ".metadata", "__0_0.distcp", "__1_0.distcp"] for name in kept}
    assert first[0]["told"] == []
    assert first[1]["told"] and "sync_dist=True" in first[1]["told"][0]


def test_unsynced_metric_run_resumes_from_last(unsynced):
    first = load_result(unsynced, "first_state", 0)
    assert first["global_step"] == 10
    assert [load_result(unsynced, "resumed", rank)["global_step"] for rank in (0, 1)] == [12, 12]


def _own_disk(path: str) -> None:
    """Give this process its own tmpfs at ``path`` (a private mount namespace): what a node-local disk is."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, b"size=64m") != 0:
        raise OSError(ctypes.get_errno(), f"mount tmpfs {path}")


def _node_disk_save(rank: int, world_size: int, tmp: str) -> None:
    local = os.path.join(tmp, "local")
    seed()
    trainer = make_trainer(world_size, max_epochs=1)
    trainer.fit(TinyModel(), datamodule=RandomDataModule(n=16))
    trainer.save_checkpoint(os.path.join(tmp, "shared.ckpt"))
    _own_disk(local)
    error = None
    try:
        trainer.save_checkpoint(os.path.join(local, "step.ckpt"))
    except CorruptCheckpointError as err:
        error = (type(err).__name__, str(err), err.file)
    save_result(tmp, "refused", rank, {"error": error, "listing": sorted(os.listdir(local))})


def test_a_commit_is_refused_on_every_rank_when_a_ranks_file_is_elsewhere(tmp_path):
    probe = subprocess.run(  # needs root (a mount namespace and a tmpfs): as the tests run here and in CI
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace here: {probe.stderr.strip()}")
    (tmp_path / "local").mkdir()
    spawn(_node_disk_save, 2, str(tmp_path))
    refused = [load_result(str(tmp_path), "refused", rank) for rank in (0, 1)]
    assert refused[0]["error"] is not None and refused[0]["error"] == refused[1]["error"]  # the same error everywhere
    name, message, file = refused[0]["error"]
    assert file == "__1_0.distcp" and "written by rank 1, is missing" in message and "Nothing was committed" in message
    assert refused[0]["listing"] == []  # rank 0's half of the refused save is gone
    verify_checkpoint(str(tmp_path / "shared.ckpt"))  # the checkpoint saved before is intact
    assert os.listdir(tmp_path / "local") == []  # the outer disk never saw either rank's part
