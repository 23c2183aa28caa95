"""Raw or wrong errors at the doors (issue 21.9), each through the user's path: every one is now a ``CheckpointError``
subclass (or Lightning's own type where users catch that) naming the path and a fix that works."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from lightning.fabric import Fabric

from lightning_dcp import (
    CheckpointNotFoundError,
    DCPCheckpointIO,
    NotACheckpointError,
    StorageAccessError,
)
from lightning_dcp.fabric import DCPSingleDeviceStrategy
from lightning_dcp.upgrade import main as upgrade_main
from tests._crafting import edit_commit
from tests._models import Payload, RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


def _fabric() -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DCPSingleDeviceStrategy())
    fabric.launch()
    return fabric


def test_fabric_load_of_a_file_whose_entry_is_no_state_dict(tmp_path):
    path = str(tmp_path / "five.pt")
    torch.save({"model": 5}, path)
    with pytest.raises(NotACheckpointError, match=r"five\.pt.*holds a int under 'model'.*state dict"):
        _fabric().load(path, {"model": torch.nn.Linear(2, 2)})
    torch.save([1, 2], path)
    with pytest.raises(NotACheckpointError, match=r"holds a list, not a checkpoint dict"):
        _fabric().load(path, {"model": torch.nn.Linear(2, 2)})


def test_trainer_loaders_refuse_a_fabric_checkpoint_naming_the_fix(tmp_path):
    fabric = _fabric()
    model = torch.nn.Linear(8, 2)
    path = str(tmp_path / "fabric.ckpt")
    fabric.save(path, {"model": model, "step": 3})
    fix = r"Fabric checkpoint.*load_model_weights\(model, path, key='model'\)"
    with pytest.raises(NotACheckpointError, match=fix):
        TinyModel.load_from_checkpoint(path)
    with pytest.raises(NotACheckpointError, match=fix):
        DCPCheckpointIO().load_checkpoint(path)
    seed()
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=2)
    with pytest.raises(NotACheckpointError, match=r"holds no Trainer model state.*\['model'\].*fabric\.load"):
        trainer.fit(TinyModel(dim=8), datamodule=RandomDataModule(), ckpt_path=path)


def test_upgrade_names_each_unreadable_file_and_goes_on(tmp_path, capsys):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / "a_garbage.ckpt").write_bytes(b"\x80\x04garbage")
    torch.save({"state_dict": {}, "pytorch-lightning_version": "1.9.0", "epoch": 0, "global_step": 0},
               folder / "b_old.ckpt")  # fmt: skip
    crafted = folder / "c_crafted.ckpt"
    marker = tmp_path / "pwned"
    crafted.write_bytes(pickle.dumps(Payload(str(marker))))
    assert upgrade_main([str(folder)]) == 1
    out = capsys.readouterr().out
    assert "failed:" in out and "a_garbage.ckpt" in out and "c_crafted.ckpt" in out
    assert "lightning:" in out and "b_old.ckpt" in out  # the readable one was upgraded after the failure
    assert not marker.exists()
    assert upgrade_main([str(crafted)]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_refused_metadata_names_the_checkpoint(tmp_path):
    path = str(tmp_path / "step=1.ckpt")
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, path)
    marker = str(tmp_path / "pwned")
    crafted = pickle.dumps(Payload(marker))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(crafted)
    from lightning_dcp.engine.format.marker import checksum

    edit_commit(path, lambda m: {**m, "metadata": {"size": len(crafted), "checksum": checksum(crafted)}})
    with pytest.raises(NotACheckpointError, match=r"step=1\.ckpt/\.metadata.*refusing") as err:
        DCPCheckpointIO().load_checkpoint(path)
    assert "refers to io.open" in str(err.value)  # what Payload.__reduce__ names
    assert not os.path.exists(marker)


def test_load_from_checkpoint_of_a_missing_path_is_lightnings_message(tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(CheckpointNotFoundError, match=r"^Checkpoint file not found: .*nope\.ckpt") as err:
        TinyModel.load_from_checkpoint(missing)
    assert isinstance(err.value, FileNotFoundError)


_AS_NOBODY = """
import json, os, sys
from lightning_dcp import DCPCheckpointIO, verify_checkpoint
DCPCheckpointIO().load_checkpoint(sys.argv[4])  # every module a load imports, while the interpreter's files are
verify_checkpoint(sys.argv[4])                   # still readable (they live under /root here)
os.setgid(65534); os.setuid(65534)
out = {}
for label, call in [("load", lambda: DCPCheckpointIO().load_checkpoint(sys.argv[1])),
                    ("verify", lambda: verify_checkpoint(sys.argv[2])),
                    ("list", lambda: DCPCheckpointIO().load_checkpoint(sys.argv[3] + "/last.ckpt"))]:
    try:
        call()
        out[label] = "ok"
    except Exception as err:
        out[label] = [type(err).__name__, isinstance(err, PermissionError), str(err)]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops privileges to 'nobody' (root can read anything)")
def test_local_permission_errors_say_permission_denied():
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="ldcp-perm-"))  # pytest's own tmp dirs are closed to others
    try:
        _permission_cases(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _permission_cases(tmp_path: pathlib.Path) -> None:
    base = tmp_path / "perm"
    base.mkdir()
    io = DCPCheckpointIO()
    for name in ("a.ckpt", "b.ckpt"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, str(base / name))
    closed = tmp_path / "closed"
    closed.mkdir()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, str(tmp_path / "readable.ckpt"))
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": 1}, str(closed / "c.ckpt"))
    for root, _dirs, files in os.walk(tmp_path):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    os.chmod(base / "a.ckpt" / ".metadata", 0)
    os.chmod(base / "b.ckpt" / "__0_0.distcp", 0)
    os.chmod(closed, 0o311)  # may be entered, not listed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, str(base / "a.ckpt"), str(base / "b.ckpt"), str(closed),
         str(tmp_path / "readable.ckpt")],
        env=env, capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for label, path in (("load", "a.ckpt/.metadata"), ("verify", "b.ckpt/__0_0.distcp"), ("list", "closed")):
        kind, is_permission, message = result[label]
        assert kind == StorageAccessError.__name__ and is_permission, result
        assert message.startswith("Permission denied") or "Permission denied" in message, message
        assert path in message and "credentials" not in message and "corrupt" not in message, message
