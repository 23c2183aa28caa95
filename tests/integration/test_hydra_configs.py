"""Hydra users' checkpoints (issue 22): lightning-hydra-template-shaped modules save, resume with ``ckpt_path`` and
come back with their hyperparameter types through ``load_from_checkpoint``, under a ``dcp_*`` strategy and under the
plugin with Lightning's stock strategy; a stock single-file checkpoint with such hparams loads through our hooks;
Fabric keeps the same types. (The 2-rank ``dcp_ddp`` run is tests/distributed/test_hydra_ddp.py.)"""

from __future__ import annotations

import copy
import functools
import io
import os

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lightning_dcp import CheckpointError, DCPCheckpointIO
from tests._hydra import (
    ConfigModule,
    TemplateModule,
    assert_config_hparams,
    assert_template_hparams,
    build,
    compose,
)
from tests._models import RandomDataModule
from tests._trainer import StateAtStart, make_trainer, seed

SETUPS = {  # (trainer options, module, with a scheduler partial)
    "plugin+stock-strategy/template+scheduler": ({"strategy": "auto", "plugins": "plugin"}, "template", True),
    "dcp_single_device/template": ({"strategy": "dcp_single_device"}, "template", False),
    "dcp_single_device/whole-config": ({"strategy": "dcp_single_device"}, "config", False),
}


class SeenAtLoad(Callback):
    """The hyperparameters of the checkpoint a resume loads (Lightning hands callbacks the whole dict)."""

    def __init__(self) -> None:
        self.hparams = None

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.hparams = (checkpoint["hyper_parameters"], checkpoint.get("hparams_type"))


class SchedulerAtSave(Callback):
    """The lr scheduler states each save wrote (the last one is what ``ckpt_path="last"`` restores)."""

    def __init__(self) -> None:
        self.states = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.states.append(copy.deepcopy(checkpoint["lr_schedulers"]))


def _trainer(options: dict, tmp_path, **kwargs):
    options = dict(options)
    if options.get("plugins") == "plugin":
        options["plugins"] = [DCPCheckpointIO()]
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path), save_last=True)
    return make_trainer(1, callbacks=[checkpoint, *kwargs.pop("callbacks", [])], **options, **kwargs)


def _module(kind: str, scheduler: bool):
    return build(scheduler=scheduler) if kind == "template" else ConfigModule(compose())


def _check(kind: str, hparams, scheduler: bool, *, flags: bool = True) -> None:
    if kind == "template":
        assert_template_hparams(hparams, scheduler=scheduler)
    else:
        assert_config_hparams(hparams, flags=flags)


@pytest.mark.parametrize("setup", SETUPS)
def test_hydra_module_saves_resumes_and_loads_with_its_types(setup, tmp_path):
    options, kind, scheduler = SETUPS[setup]
    seed()
    data = RandomDataModule()
    saves = SchedulerAtSave()
    limits = {"limit_train_batches": 3, "limit_val_batches": 2}
    trainer = _trainer(options, tmp_path, max_epochs=2, callbacks=[saves], **limits)
    model = _module(kind, scheduler)
    trainer.fit(model, datamodule=data)
    last = os.path.join(tmp_path, "last.ckpt")
    assert os.path.isdir(last) and trainer.global_step == 6

    seen, start = SeenAtLoad(), StateAtStart()
    resumed = _trainer(options, tmp_path, max_epochs=3, callbacks=[seen, start], **limits)
    resumed.fit(_module(kind, scheduler), datamodule=RandomDataModule(), ckpt_path="last")
    assert start.state["global_step"] == 6 and resumed.global_step == 9
    hparams, hparams_type = seen.hparams
    _check(kind, hparams, scheduler)
    assert hparams_type is (DictConfig if kind == "config" else None)
    if scheduler:  # ReduceLROnPlateau's state as the last save wrote it (it had seen the first epoch's val/loss)
        assert start.state["schedulers"] == saves.states[-1] and saves.states[-1][0]["best"] < float("inf")

    loaded = type(model).load_from_checkpoint(last)  # Lightning rebuilds a whole-config hparams as DictConfig(dict)
    _check(kind, loaded.hparams, scheduler, flags=False)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, resumed.lightning_module.state_dict()[name].cpu()), name


def test_a_stock_single_file_with_hydra_hparams_loads_through_the_hooks(tmp_path):
    """Stock Lightning writes DictConfig and partials pickled as they are; torch >= 2.6 refuses them by default."""
    seed()
    stock = make_trainer(1, strategy="auto", max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    module = build()
    stock.fit(module, datamodule=RandomDataModule())
    path = str(tmp_path / "stock.ckpt")
    stock.save_checkpoint(path)
    assert os.path.isfile(path)

    assert_template_hparams(TemplateModule.load_from_checkpoint(path).hparams, scheduler=True)
    config_path = str(tmp_path / "config.ckpt")
    stock.save_checkpoint(config_path)  # and one with the whole config as hparams (hparams_type DictConfig)
    checkpoint = torch.load(config_path, weights_only=False)
    checkpoint.update(hyper_parameters=compose(), hparams_type=DictConfig, hparams_name="cfg")  # same network
    torch.save(checkpoint, config_path)
    assert_config_hparams(ConfigModule.load_from_checkpoint(config_path).hparams, flags=False)

    seen = SeenAtLoad()  # resuming the stock file under the plugin (its loader reads single files too)
    resumed = _trainer(
        {"strategy": "auto", "plugins": "plugin"}, tmp_path, max_epochs=2, limit_train_batches=2, callbacks=[seen]
    )
    resumed.fit(build(), datamodule=RandomDataModule(), ckpt_path=path)
    assert resumed.global_step == 4
    assert_template_hparams(seen.hparams[0], scheduler=True)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    checkpoint["hyper_parameters"] = {"net": Evil()}
    crafted = str(tmp_path / "crafted.ckpt")
    torch.save(checkpoint, crafted)
    with pytest.raises(CheckpointError, match="system"):
        ConfigModule.load_from_checkpoint(crafted)
    assert not os.path.exists("pwned")


def test_fabric_save_and_load_keep_the_types(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_single_device")
    cfg = compose()
    model = fabric.setup_module(torch.nn.Linear(8, 2))
    factory = functools.partial(torch.optim.AdamW, lr=0.01)
    optimizer = fabric.setup_optimizers(factory(model.parameters()))
    scheduler_factory = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2)
    state = {"model": model, "optimizer": optimizer, "cfg": cfg, "hparams": {"optimizer": factory, "sub": cfg.model}}
    state["scheduler_factory"] = scheduler_factory
    fabric.save(str(tmp_path / "ckpt"), state)

    fresh = {"model": model, "optimizer": optimizer, "cfg": None, "hparams": None, "scheduler_factory": None}
    assert fabric.load(str(tmp_path / "ckpt"), fresh) == {}
    # fabric.save rebuilds every Mapping of the state (apply_to_collection) before the strategy sees it: a config
    # arrives resolved and without flags, and comes back exactly so
    assert type(fresh["cfg"]) is DictConfig and fresh["cfg"].model.net._get_node("hidden")._value() == 16
    assert OmegaConf.to_container(fresh["cfg"]) == OmegaConf.to_container(cfg, resolve=True)
    assert fresh["hparams"]["optimizer"].func is torch.optim.AdamW and fresh["hparams"]["sub"].net.hidden == 16
    assert fresh["scheduler_factory"].func is torch.optim.lr_scheduler.StepLR
    whole = fabric.load(str(tmp_path / "ckpt"))
    assert type(whole["cfg"]) is DictConfig and whole["hparams"]["optimizer"].keywords == {"lr": 0.01}
    buffer = io.BytesIO()
    torch.save({"cfg": cfg, "factory": factory}, buffer)  # Fabric's own single-file format, read by these strategies
    (tmp_path / "stock.pt").write_bytes(buffer.getvalue())
    assert fabric.load(str(tmp_path / "stock.pt"))["factory"].func is torch.optim.AdamW
