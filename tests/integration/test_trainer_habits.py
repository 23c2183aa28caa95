"""A real Trainer, one process: what ``on_fit_start`` sees on resume, a missing ``ckpt_path``, bad ``storage_options``;
under the DCP strategies and, for comparison, under Lightning's stock strategy with ``DCPCheckpointIO``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dcp import DCPCheckpointIO
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed

SETUPS = {
    "dcp_single_device": {"strategy": "dcp_single_device"},
    "stock + plugin": {"strategy": "auto", "plugins": [DCPCheckpointIO]},
}


def _trainer(setup: str, **kwargs):
    options = dict(SETUPS[setup])
    if "plugins" in options:
        options["plugins"] = [cls() for cls in options["plugins"]]
    return make_trainer(1, **options, **kwargs)


class Counter(Callback):
    """Counts training batches (saved in checkpoints) and records what it and the model hold at ``on_fit_start``."""

    def __init__(self) -> None:
        self.batches = 0
        self.at_fit_start: tuple[int, torch.Tensor] | None = None

    def on_train_batch_end(self, *args) -> None:
        self.batches += 1

    def on_fit_start(self, trainer, pl_module) -> None:
        self.at_fit_start = (self.batches, pl_module.head.weight.detach().clone())

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict) -> None:
        self.batches = state_dict["batches"]


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_on_fit_start_sees_restored_state(setup, tmp_path, monkeypatch):
    loads = []
    original = DCPCheckpointIO.load_checkpoint
    monkeypatch.setattr(DCPCheckpointIO, "load_checkpoint", lambda *a, **k: loads.append(1) or original(*a, **k))
    seed()
    counter, model = Counter(), TinyModel()
    trainer = _trainer(setup, max_epochs=1, callbacks=[counter])
    trainer.fit(model, datamodule=RandomDataModule())
    trainer.save_checkpoint(str(tmp_path / "a.ckpt"))
    saved_head = model.head.weight.detach().clone()
    assert counter.batches == 16

    resumed, fresh = Counter(), TinyModel()
    trainer = _trainer(setup, max_epochs=2, callbacks=[resumed])
    trainer.fit(fresh, datamodule=RandomDataModule(), ckpt_path=str(tmp_path / "a.ckpt"))
    batches, head = resumed.at_fit_start
    assert batches == 16 and torch.equal(head, saved_head)  # restored before on_fit_start, as Lightning's stock order
    assert resumed.batches == 32 and trainer.global_step == 32  # training went on from there
    assert len(loads) == 1  # read once (Lightning's own restore after on_fit_start was skipped)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_missing_ckpt_path_and_bad_storage_options(setup, tmp_path):
    missing = str(tmp_path / "nope.ckpt")
    with pytest.raises(FileNotFoundError) as stock:
        make_trainer(1, strategy="auto", max_epochs=1).fit(TinyModel(), RandomDataModule(), ckpt_path=missing)
    with pytest.raises(FileNotFoundError) as ours:
        _trainer(setup, max_epochs=1).fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path=missing)
    assert str(ours.value) == str(stock.value) == f"Checkpoint file not found: {missing}"

    trainer = _trainer(setup, max_epochs=1, limit_train_batches=1)
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    with pytest.raises(TypeError, match="`storage_options` must be a dict of fsspec filesystem options"):
        trainer.save_checkpoint(str(tmp_path / "a.ckpt"), storage_options="anon=true")
    assert not (tmp_path / "a.ckpt").exists()
