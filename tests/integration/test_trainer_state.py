"""A real single-process Trainer: every entry Lightning checkpoints survives, errors are raised at set-up."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_dcp import DCPCheckpointIO, DCPDDPStrategy, StateDictMismatchError
from tests._models import OtherModel, RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed


def _fit(tmp_path, *, strategy, two_optimizers: bool = False):
    seed()
    model = TinyModel(two_optimizers=two_optimizers)
    callbacks = [
        ModelCheckpoint(dirpath=str(tmp_path / "cb"), monitor="val_loss", save_top_k=1),
        EarlyStopping(monitor="val_loss", patience=5),
    ]
    trainer = make_trainer(1, strategy=strategy, max_epochs=2, callbacks=callbacks)
    trainer.fit(model, datamodule=RandomDataModule())
    return trainer, model


@pytest.mark.parametrize("two_optimizers", [False, True])
def test_every_lightning_entry_round_trips(tmp_path, two_optimizers):
    trainer, _ = _fit(tmp_path, strategy="dcp_single_device", two_optimizers=two_optimizers)
    trainer.save_checkpoint(str(tmp_path / "dcp.ckpt"))
    # The reference: the same Trainer state written by Lightning's own TorchCheckpointIO (rank-0 torch.save).
    TorchCheckpointIO().save_checkpoint(trainer._checkpoint_connector.dump_checkpoint(), str(tmp_path / "ref.ckpt"))
    reference = torch.load(str(tmp_path / "ref.ckpt"), weights_only=False)
    loaded = DCPCheckpointIO().load_checkpoint(str(tmp_path / "dcp.ckpt"))
    info = loaded.pop("lightning_dcp")
    assert info["strategy"] == "DCPSingleDeviceStrategy" and info["optimizer_layout"] == "fqn"
    # Our optimizer entries are FQN-keyed (get_optimizer_state_dict); compare the rest exactly.
    assert len(loaded.pop("optimizer_states")) == len(reference.pop("optimizer_states")) == (2 if two_optimizers else 1)
    assert set(loaded) == set(reference)
    for key in reference:
        assert_same(reference[key], loaded[key], key)
    for expected in ("loops", "callbacks", "lr_schedulers", "hyper_parameters", "RandomDataModule", "my_extra"):
        assert expected in loaded


def test_resume_restores_every_optimizer_and_scheduler(tmp_path):
    trainer, model = _fit(tmp_path, strategy="dcp_single_device", two_optimizers=True)
    trainer.save_checkpoint(str(tmp_path / "dcp.ckpt"))
    expected = (
        [opt.state_dict() for opt in trainer.optimizers],
        [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
    )
    resumed = make_trainer(1, strategy="dcp_single_device", max_epochs=2)
    resumed.fit(TinyModel(two_optimizers=True), datamodule=RandomDataModule(), ckpt_path=str(tmp_path / "dcp.ckpt"))
    assert_same(expected[0], [opt.state_dict() for opt in resumed.optimizers])
    assert_same(expected[1], [c.scheduler.state_dict() for c in resumed.lr_scheduler_configs])
    assert resumed.global_step == trainer.global_step


def test_checkpoint_of_a_different_model_fails_clearly(tmp_path):
    trainer, _ = _fit(tmp_path, strategy="dcp_single_device")
    path = str(tmp_path / "dcp.ckpt")
    trainer.save_checkpoint(path)
    before = sorted(os.listdir(path))
    other = make_trainer(1, strategy="dcp_single_device", max_epochs=1)
    with pytest.raises(StateDictMismatchError) as err:
        other.fit(OtherModel(), datamodule=RandomDataModule(), ckpt_path=path)
    assert "other.weight" in err.value.missing_keys and "head.weight" in err.value.unexpected_keys
    assert "body.0.weight" in err.value.mismatched  # saved (16, 8), expected (32, 8)
    assert path in str(err.value)
    assert sorted(os.listdir(path)) == before


def test_missing_ckpt_path_names_it(tmp_path):
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=1)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        trainer.fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path=str(tmp_path / "does-not-exist"))


def test_sharded_strategy_refuses_another_checkpoint_io_at_setup():
    with pytest.raises(TypeError, match="DCPCheckpointIO"):
        make_trainer(1, strategy="dcp_ddp", plugins=[TorchCheckpointIO()])
    # state_dict_type="full" keeps Lightning's single-file behaviour and accepts any CheckpointIO
    trainer = make_trainer(1, strategy=DCPDDPStrategy(state_dict_type="full"), plugins=[TorchCheckpointIO()])
    assert isinstance(trainer.strategy.checkpoint_io, TorchCheckpointIO)
    with pytest.raises(ValueError, match="state_dict_type"):
        DCPDDPStrategy(state_dict_type="partial")


def test_full_state_dict_type_writes_one_file(tmp_path):
    seed()
    trainer = make_trainer(1, strategy=DCPDDPStrategy(state_dict_type="full"), max_epochs=1)
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    trainer.save_checkpoint(str(tmp_path / "full.ckpt"))
    assert os.path.isfile(tmp_path / "full.ckpt")
    assert torch.load(str(tmp_path / "full.ckpt"), weights_only=True)["global_step"] == trainer.global_step


def test_single_file_checkpoint_resumes_under_sharded_strategy(tmp_path):
    # Lightning's own .ckpt (param-id optimizer layout) loads into a dcp_* strategy.
    seed()
    trainer = make_trainer(1, strategy="auto", max_epochs=1)
    trainer.fit(TinyModel(), datamodule=RandomDataModule())
    trainer.save_checkpoint(str(tmp_path / "plain.ckpt"))
    expected = trainer.optimizers[0].state_dict(), trainer.lightning_module.state_dict()
    resumed = make_trainer(1, strategy="dcp_single_device", max_epochs=1)
    resumed.fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path=str(tmp_path / "plain.ckpt"))
    assert_same(expected[0], resumed.optimizers[0].state_dict())
    assert_same(dict(expected[1]), dict(resumed.lightning_module.state_dict()))
