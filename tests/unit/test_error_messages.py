"""Errors and warnings that lead with the fix (issue 42, item 4), on real checkpoints, Trainers and processes."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, StateDictMismatchError
from lightning_dcp.consolidate import main as consolidate_main
from lightning_dcp.trainer.rank_state import needs_elastic_resume
from tests._models import RandomDataModule, TinyModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trainer_checkpoint(tmp_path, **trainer_kwargs) -> tuple[str, TinyModel]:
    model = TinyModel()
    checkpoint = DCPModelCheckpoint(str(tmp_path / "run1"), every_n_train_steps=2, save_last="link")
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        callbacks=[checkpoint],
        logger=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"strategy": "dcp_single_device", **trainer_kwargs},
    )
    trainer.fit(model, datamodule=RandomDataModule())
    return str(tmp_path / "run1" / "last.ckpt"), model


def test_stateful_loader_refusal_names_elastic_resume_first():
    message = str(needs_elastic_resume(1, saved_world_size=2, world_size=3, path="run1/last.ckpt"))
    assert message.startswith("Add `lightning_dcp.ElasticResume()` to the Trainer's callbacks to resume")
    assert "'run1/last.ckpt'" in message and "world size 2" in message and "at world size 3" in message


def test_fabric_load_of_a_trainer_checkpoint_says_how(tmp_path):
    path, trained = _trainer_checkpoint(tmp_path)
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_single_device")
    fabric.launch()
    torch.manual_seed(1)
    model = TinyModel()
    fabric.setup_module(model)
    with pytest.raises(StateDictMismatchError) as caught:
        fabric.load(path, {"model": model})
    message = str(caught.value)
    assert "{'state_dict': model}" in message and "load_model_weights(model, path)" in message
    assert "strict=False" not in message  # it would load nothing
    with pytest.warns(UserWarning, match="Nothing was loaded") as seen:
        fabric.load(path, {"model": model}, strict=False)
    assert "{'state_dict': model}" in str(seen[0].message)
    fabric.load(path, {"state_dict": model})  # the way the message gives works
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)


def test_dcp_model_checkpoint_warns_without_the_plugin(tmp_path):
    with pytest.warns(UserWarning, match=r"^`DCPModelCheckpoint` saves through the Trainer's `TorchCheckpointIO`"):
        path, _ = _trainer_checkpoint(tmp_path / "stock", strategy="auto")
    assert os.path.isfile(path)  # Lightning's single file: what the warning says
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _trainer_checkpoint(tmp_path / "plugin", strategy="auto", plugins=[DCPCheckpointIO()])
    assert not [w for w in seen if "DCPModelCheckpoint` saves through" in str(w.message)]


def test_inspect_into_head_exits_quietly(tmp_path):
    path = str(tmp_path / "wide")
    tensors = {f"layer{i}.weight": torch.zeros(2) for i in range(4000)}  # an output far beyond a pipe's buffer
    DCPCheckpointIO().save_checkpoint({"state_dict": tensors, "global_step": 0, "epoch": 0}, path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    head = subprocess.run(
        f"{sys.executable} -m lightning_dcp.inspect {path} | head -n 3; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert len(head.stdout.splitlines()) == 3
    assert head.stderr == "" and head.returncode == 0, (head.returncode, head.stderr[-2000:])


def test_consolidate_writes_beside_the_checkpoints_directory(tmp_path, capsys):
    path, _ = _trainer_checkpoint(tmp_path)
    designated = os.path.basename(os.path.realpath(path))
    assert consolidate_main([path, "--no-progress"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / f"run1-{designated}.consolidated")
    assert os.path.isfile(out)
    assert sorted(os.listdir(tmp_path / "run1")) == sorted([designated, "last.ckpt"])  # nothing new among them
