"""Saving onto a filesystem mounted read-only fails with ``StorageAccessError`` naming the path and the fix (issue 51).

On 7471de6 a save to a new name there raised a bare ``OSError`` (``EROFS``, from creating the directory) and a save
over an existing checkpoint a plain ``CheckpointError`` with no fix. The mount is real: a tmpfs mounted in a private
mount namespace (``unshare --mount --map-root-user``, no root needed where user namespaces are allowed), remounted
read-only between the runs. The checkpoint saved before stays intact and loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

_CHILD = """
import json, os, subprocess, sys

import torch

from lightning_dcp import CheckpointError, DCPCheckpointIO, DCPModelCheckpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed

mount, out = sys.argv[1], {}
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mount], check=True)


def trainer(steps):
    callback = DCPModelCheckpoint(mount, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last="link")
    return make_trainer(1, strategy="dcp_single_device", max_steps=steps, callbacks=[callback])


io = DCPCheckpointIO()
saved = {"w": torch.arange(4.0)}
io.save_checkpoint({"state_dict": saved, "global_step": 2}, os.path.join(mount, "step=2.ckpt"))
out["before"] = sorted(os.listdir(mount))
subprocess.run(["mount", "-o", "remount,ro", mount], check=True)

errors = {}
state = {"state_dict": {"w": torch.zeros(4)}, "global_step": 9}
for name in ("new.ckpt", "step=2.ckpt"):  # a new name; over the existing checkpoint
    try:
        io.save_checkpoint(state, os.path.join(mount, name))
    except BaseException as err:
        errors[name] = [[c.__name__ for c in type(err).__mro__], str(err)]
try:  # a fit into that directory: its first save meets the read-only mount
    seed()
    trainer(2).fit(TinyModel(), datamodule=RandomDataModule(n=16))
except BaseException as err:
    errors["fit"] = [[c.__name__ for c in type(err).__mro__], str(err)]
out["errors"] = errors
out["after"] = sorted(os.listdir(mount))
loaded = io.load_checkpoint(os.path.join(mount, "step=2.ckpt"))
out["intact"] = all(torch.equal(loaded["state_dict"][k], v) for k, v in saved.items())
out["step"] = loaded["global_step"]
print("RESULT " + json.dumps(out))
sys.stdout.flush()
os._exit(0)
"""


def test_a_save_onto_a_read_only_mount_names_the_path_and_the_fix(tmp_path):
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("`unshare` (util-linux) is needed to mount a private read-only tmpfs")
    probe = subprocess.run([unshare, "--mount", "--map-root-user", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"user and mount namespaces are not available here: {probe.stderr.decode()[-200:]}")
    mount = tmp_path / "mnt"
    mount.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [unshare, "--mount", "--map-root-user", sys.executable, "-c", _CHILD, str(mount)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["before"] == out["after"] == ["step=2.ckpt"]  # nothing written, nothing lost
    assert out["intact"] and out["step"] == 2
    assert set(out["errors"]) == {"new.ckpt", "step=2.ckpt", "fit"}
    for what, (mro, message) in out["errors"].items():
        assert mro[:3] == ["StorageAccessError", "CheckpointError", "PermissionError"], (what, mro, message)
        assert f"Saving the checkpoint to '{mount}/" in message, (what, message)
        assert "mounted read-only" in message and "Save to a writable directory" in message, (what, message)
        assert "earlier checkpoints are intact" in message, (what, message)
    assert f"'{mount}/step=2-v1.ckpt'" in out["errors"]["fit"][1]  # Lightning's name beside the existing one
