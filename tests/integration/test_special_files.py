"""Readers open only regular files (issue 21.8): a FIFO, socket or device inside a checkpoint is a
``CorruptCheckpointError`` naming it, never a hang, in every way a user reads checkpoints."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from lightning_dcp import CorruptCheckpointError, DCPCheckpointIO, DCPModelCheckpoint, verify_checkpoint
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.inspect import main as inspect_main
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


def _bounded(fn, seconds: float = 60.0):
    """Run ``fn`` in a thread; fail (instead of hanging the suite) when it has not returned in ``seconds``."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} blocked for {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def _fit(dirpath: str, max_steps: int, ckpt_path: str | None = None):
    seed()
    model = TinyModel()
    callback = DCPModelCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last="link"
    )
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=-1, max_steps=max_steps, callbacks=[callback])
    trainer.fit(model, datamodule=RandomDataModule(n=16), ckpt_path=ckpt_path)
    return trainer


def _replace_with(path: str, kind: str, keep: list) -> None:
    os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        keep.append(server)
    else:
        os.symlink("/dev/zero", path)  # a link to a device: followed, then refused by type


@pytest.mark.parametrize(("name", "kind"), [(".commit", "fifo"), (".metadata", "fifo"), (".commit", "socket"),
                                            (".metadata", "device")])  # fmt: skip
def test_special_file_in_the_newest_checkpoint_never_blocks_a_reader(tmp_path, capsys, name, kind):
    dirpath = str(tmp_path / "run")
    _fit(dirpath, 4)
    newest = os.path.join(dirpath, "step=4.ckpt")
    keep: list = []
    _replace_with(os.path.join(newest, name), kind, keep)

    with pytest.raises(CorruptCheckpointError) as err:
        _bounded(lambda: verify_checkpoint(newest))
    assert name in str(err.value) and err.value.file == name
    with pytest.raises(CorruptCheckpointError):
        _bounded(lambda: Checkpointer().load(newest))
    assert _bounded(lambda: inspect_main([dirpath])) == 1  # a folder of checkpoints: lists them, names step=2
    assert "step=2.ckpt" in capsys.readouterr().err
    # "last" and load_from_checkpoint fall back to the newest checkpoint that can be read.
    with pytest.warns(UserWarning, match="step=4"):
        loaded = _bounded(lambda: DCPCheckpointIO().load_checkpoint(os.path.join(dirpath, "last.ckpt")))
    assert loaded["global_step"] == 2
    with pytest.warns(UserWarning, match="step=4"):
        model = _bounded(lambda: TinyModel.load_from_checkpoint(os.path.join(dirpath, "last.ckpt")))
    assert isinstance(model, TinyModel)
    with pytest.warns(UserWarning, match="step=4"):
        trainer = _bounded(lambda: _fit(dirpath, 6, ckpt_path="last"), seconds=120)
    assert trainer.global_step == 6
    for held in keep:
        held.close()
