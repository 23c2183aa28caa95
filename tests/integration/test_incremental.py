"""Incremental saves through a real Trainer: frozen tensors hard-linked, every checkpoint complete on its own.

A fine-tuning run (frozen embedding and backbone, trained head) saves with ``DCPCheckpointIO(incremental=True)``;
checkpoints are then deleted in a random order and every remaining one must load exactly what was saved, by
lightning_dcp's loader and by stock ``dcp.load``, and resume with ``ckpt_path="last"``. A real ``kill -9`` during
incremental saves leaves every committed checkpoint intact.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from harness.ranks import port_env
from lightning_dcp import DCPCheckpointIO, verify_checkpoint
from tests._models import RandomDataModule
from tests._trainer import seed
from tests.integration._incremental_train import FrozenBackbone, trainer_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FROZEN = ("embed.weight", "backbone.weight")
TRAINED = ("head.weight",)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _files(path: str) -> dict[str, os.stat_result]:
    """``{model key: stat of its data file}`` from the checkpoint's DCP metadata (stock reader)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    out = {}
    for index, info in metadata.storage_data.items():
        key = index.fqn.removeprefix("state_dict.")
        if key in FROZEN + TRAINED:
            out[key] = os.stat(os.path.join(path, info.relative_path))
    return out


def _check_loads(path: str, expected: dict[str, torch.Tensor]) -> None:
    verify_checkpoint(path)
    ours = DCPCheckpointIO().load_checkpoint(path)["state_dict"]
    stock = {"state_dict": {k: torch.empty_like(v) for k, v in expected.items()}}
    dcp.load(stock, checkpoint_id=path, no_dist=True)
    for key, value in expected.items():
        assert torch.equal(ours[key], value), (path, key)
        assert torch.equal(stock["state_dict"][key], value), (path, key)


def test_frozen_tensors_are_linked_and_checkpoints_survive_any_deletion(tmp_path):
    seed()
    ckpt_dir = str(tmp_path / "ckpts")
    model = FrozenBackbone()
    trainer = trainer_for(ckpt_dir, max_steps=8, every=2)
    trainer.fit(model, datamodule=RandomDataModule(n=64, batch_size=4))
    steps = [2, 4, 6, 8]
    paths = {step: os.path.join(ckpt_dir, f"step={step}.ckpt") for step in steps}
    last = os.path.join(ckpt_dir, "last.ckpt")
    assert sorted(os.listdir(ckpt_dir)) == sorted([*(os.path.basename(p) for p in paths.values()), "last.ckpt"])
    files = {step: _files(path) for step, path in paths.items()}
    for key in FROZEN:  # one file for all five checkpoints (four steps and last)
        assert len({files[s][key].st_ino for s in steps} | {_files(last)[key].st_ino}) == 1, key
        assert files[8][key].st_nlink == 5
    for key in TRAINED:  # a new file at every save
        assert len({files[s][key].st_ino for s in steps}) == 4 and files[8][key].st_nlink <= 2
    assert model.saved.keys() == {2, 4, 6, 8}
    expected = {path: model.saved[step] for step, path in paths.items()}
    expected[last] = model.saved[8]
    assert not torch.equal(model.saved[2]["head.weight"], model.saved[8]["head.weight"])  # the head trained
    # Delete the step checkpoints in a random order: after each removal every remaining checkpoint loads exactly.
    order = list(paths.values())
    random.Random(16).shuffle(order)
    for gone in order:
        DCPCheckpointIO().remove_checkpoint(gone)
        del expected[gone]
        for path, values in expected.items():
            _check_loads(path, values)
    assert _files(last)["embed.weight"].st_nlink == 1  # the last name of the shared file
    # Resume from "last" (the only checkpoint left): the run continues at step 8 with the saved weights.
    seed()
    resumed = FrozenBackbone()
    trainer = trainer_for(ckpt_dir, max_steps=10, every=2)
    trainer.fit(resumed, datamodule=RandomDataModule(n=64, batch_size=4), ckpt_path="last")
    assert trainer.global_step == 10 and min(resumed.saved) == 10
    for key in FROZEN:
        assert torch.equal(resumed.state_dict()[key], model.saved[8][key])
    _check_loads(os.path.join(ckpt_dir, "step=10.ckpt"), resumed.saved[10])
    assert _files(os.path.join(ckpt_dir, "step=10.ckpt"))["embed.weight"].st_ino == _files(last)["embed.weight"].st_ino


def _committed(ckpt_dir: str) -> list[str]:
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(n for n in os.listdir(ckpt_dir) if os.path.isfile(os.path.join(ckpt_dir, n, ".commit")))


@pytest.mark.full
def test_kill_during_incremental_saves_keeps_committed_checkpoints(tmp_path):
    rng = random.Random(9)
    directory = str(tmp_path)
    ckpt_dir = os.path.join(directory, "ckpts")
    steps = 12
    command = [sys.executable, "-m", "tests.integration._incremental_train", directory, str(steps)]
    for _ in range(2):
        before = set(_committed(ckpt_dir))
        proc = subprocess.Popen(command, cwd=ROOT, env=port_env(), start_new_session=True, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not set(_committed(ckpt_dir)) - before:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))  # a checkpoint every step: most kills land inside a save
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        committed = _committed(ckpt_dir)
        assert committed and proc.returncode == -signal.SIGKILL
        for name in committed:  # every committed checkpoint is whole, byte for byte, and loads by stock DCP
            path = os.path.join(ckpt_dir, name)
            verify_checkpoint(path)
            loaded = DCPCheckpointIO().checkpointer.load(path)
            # (our loader takes a `last` older than the newest committed checkpoint for that newer one)
            assert loaded.url == path or name == "last.ckpt"
            state = loaded.tree["state_dict"] if loaded.url == path else {}
            stock = {"state_dict": {k: torch.empty_like(v) for k, v in state.items()}}
            dcp.load(stock, checkpoint_id=path, no_dist=True)
            for key, value in state.items():
                assert torch.equal(stock["state_dict"][key], value), (name, key, stock["state_dict"][key], value)
    proc = subprocess.run(
        command, cwd=ROOT, env=port_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    final = torch.load(os.path.join(directory, "final.pt"), weights_only=True)
    assert _files(os.path.join(ckpt_dir, "last.ckpt"))["embed.weight"].st_nlink > 2  # shared with step checkpoints
    last = DCPCheckpointIO().load_checkpoint(os.path.join(ckpt_dir, "last.ckpt"))
    assert last["global_step"] == steps
    for key, value in final.items():
        assert torch.equal(last["state_dict"][key], value), key
    assert not any(n.startswith(".") for n in os.listdir(ckpt_dir))  # staging left by the kills was removed
