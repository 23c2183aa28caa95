"""A broken ``last.ckpt`` falls back to the newest committed checkpoint in every form a user reads it (issue 21.6).

The link or pointer names a checkpoint that was removed (a pruning cut short, a user's ``rm``); each of the eight
load forms reads the newest committed checkpoint beside it instead, with a warning naming both: the Trainer's
``fit(ckpt_path=...)``, ``Model.load_from_checkpoint``, ``lightning_dcp.load_checkpoint``, ``DCPCheckpointIO``,
Fabric's ``fabric.load`` and the ``verify`` / ``inspect`` / ``consolidate`` CLIs. On a local disk (a symlink and a
pointer file) and on S3 (a pointer object).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from lightning.fabric import Fabric

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, load_checkpoint
from lightning_dcp.consolidate import main as consolidate_main
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.fabric import DCPSingleDeviceStrategy
from lightning_dcp.inspect import main as inspect_main
from lightning_dcp.verify import main as verify_main
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed

_WARNING = r"designates .*step=4\.ckpt.*missing or was never committed.*step=2\.ckpt"


def _train(dirpath: str, options: dict) -> dict[str, torch.Tensor]:
    """Save steps 2 and 4 with ``save_last="link"``; return the weights at step 2."""
    seed()
    model = TinyModel()

    class KeepStep2(DCPModelCheckpoint):
        def on_train_batch_end(self, trainer, *args, **kwargs):
            super().on_train_batch_end(trainer, *args, **kwargs)
            if trainer.global_step == 2:
                self.step2 = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}

    callback = KeepStep2(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last="link")
    trainer = make_trainer(
        1, strategy="dcp_single_device", max_epochs=-1, max_steps=4, callbacks=[callback],
        plugins=[DCPCheckpointIO(storage_options=options)],
    )  # fmt: skip
    trainer.fit(model, datamodule=RandomDataModule(n=16))
    return callback.step2


def _break_last(dirpath: str, options: dict) -> None:
    Location(dirpath + "/step=4.ckpt", storage_options=options).remove()  # last.ckpt now designates nothing


def _all_forms(dirpath: str, options: dict, step2: dict, tmp_path, capsys) -> None:
    last = dirpath + "/last.ckpt"
    opts = ["--storage-options", json.dumps(options)] if options else []
    with pytest.warns(UserWarning, match=_WARNING):
        loaded = TinyModel.load_from_checkpoint(last, storage_options=options or None)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in step2.items())
    with pytest.warns(UserWarning, match=_WARNING):
        assert load_checkpoint(last, storage_options=options)["global_step"] == 2
    with pytest.warns(UserWarning, match=_WARNING):
        assert DCPCheckpointIO(storage_options=options).load_checkpoint(last)["global_step"] == 2
    with pytest.warns(UserWarning, match=_WARNING):
        assert verify_main([last, *opts]) == 0
    with pytest.warns(UserWarning, match=_WARNING):
        assert inspect_main([last, *opts]) == 0
    assert "global step 2" in capsys.readouterr().out
    out = str(tmp_path / "consolidated.ckpt")
    with pytest.warns(UserWarning, match=_WARNING):
        assert consolidate_main([last, "--output", out, *opts]) == 0
    assert torch.load(out, weights_only=True)["global_step"] == 2
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DCPSingleDeviceStrategy(storage_options=options))
    fabric.launch()
    model = TinyModel()
    with pytest.warns(UserWarning, match=_WARNING):
        remainder = fabric.load(last, {"state_dict": model})
    assert remainder["global_step"] == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in step2.items())
    # The Trainer resumes from it too (the warning is the loader's).
    seed()
    resumed = TinyModel()
    trainer = make_trainer(
        1, strategy="dcp_single_device", max_epochs=-1, max_steps=6,
        plugins=[DCPCheckpointIO(storage_options=options)],
    )  # fmt: skip
    with pytest.warns(UserWarning, match=_WARNING):
        trainer.fit(resumed, datamodule=RandomDataModule(n=16), ckpt_path=last)
    assert trainer.global_step == 6


@pytest.mark.parametrize("kind", ["symlink", "pointer"])
def test_broken_last_falls_back_in_every_load_form_locally(tmp_path, capsys, kind):
    dirpath = str(tmp_path / "run")
    step2 = _train(dirpath, {})
    last = os.path.join(dirpath, "last.ckpt")
    assert os.path.islink(last)
    if kind == "pointer":  # where symlinks cannot be made, last.ckpt is a pointer file
        os.unlink(last)
        Location(last).write_pointer(Location(os.path.join(dirpath, "step=4.ckpt")))
    _break_last(dirpath, {})
    _all_forms(dirpath, {}, step2, tmp_path, capsys)


@pytest.mark.s3
def test_broken_last_falls_back_in_every_load_form_on_s3(s3_bucket, tmp_path, capsys):
    url, options = s3_bucket
    dirpath = f"{url}/run"
    step2 = _train(dirpath, options)
    assert Location(dirpath + "/last.ckpt", storage_options=options).read_pointer() == "step=4.ckpt"
    _break_last(dirpath, options)
    _all_forms(dirpath, options, step2, tmp_path, capsys)
