"""A LightningModule shaped like the lightning-hydra-template's, built from a Hydra config as its users build it.

The template's module takes ``net`` (here a config node: the network is built inside), ``optimizer`` and
``scheduler`` as ``functools.partial`` (Hydra's ``_partial_: true``), calls ``self.save_hyperparameters(logger=False)``
and builds both in ``configure_optimizers`` with a ``ReduceLROnPlateau`` monitored on ``val/loss``. ``ConfigModule``
is the other common habit: the whole composed config handed over and saved as the hyperparameters
(``hparams_type`` is then ``DictConfig``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from hydra.utils import instantiate
from lightning.pytorch import LightningModule
from omegaconf import DictConfig, OmegaConf
from torch import nn

CONFIG = {
    "data": {"dim": 8, "width": 16},
    "model": {
        "_target_": "tests._hydra.TemplateModule",
        "net": {"input_size": "${data.dim}", "hidden": "${data.width}", "output_size": 2},
        "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.01, "weight_decay": 0.0},
        "scheduler": {
            "_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau",
            "_partial_": True,
            "mode": "min",
            "factor": 0.5,
            "patience": 0,
        },
        "compile": False,
    },
}


def compose(*, scheduler: bool = True) -> DictConfig:
    """The config as Hydra composes it (interpolations unresolved, struct mode on)."""
    cfg = OmegaConf.create(CONFIG)
    if not scheduler:
        cfg.model.scheduler = None
    OmegaConf.set_struct(cfg, True)
    return cfg


def build(*, scheduler: bool = True) -> TemplateModule:
    """``hydra.utils.instantiate(cfg.model)``, as the template's ``train.py`` does."""
    return instantiate(compose(scheduler=scheduler).model)


def _network(net: Any) -> nn.Module:
    return nn.Sequential(nn.Linear(net.input_size, net.hidden), nn.Tanh(), nn.Linear(net.hidden, net.output_size))


class _Regression(LightningModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", nn.functional.mse_loss(self.net(x), y))


class TemplateModule(_Regression):
    def __init__(
        self,
        net: DictConfig,
        optimizer: functools.partial,
        scheduler: functools.partial | None,
        compile: bool,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.net = _network(net)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = self.hparams.optimizer(params=self.trainer.model.parameters())
        if self.hparams.scheduler is None:
            return {"optimizer": optimizer}
        scheduler = self.hparams.scheduler(optimizer=optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch", "frequency": 1},
        }


class ConfigModule(_Regression):
    def __init__(self, cfg: DictConfig) -> None:
        super().__init__()
        self.save_hyperparameters(cfg)
        self.net = _network(cfg.model.net)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def assert_template_hparams(hparams: Any, *, scheduler: bool) -> None:
    """What ``TemplateModule``'s hyperparameters must be after a save and a load: the same types and values."""
    partial_type = type(instantiate(CONFIG["model"]["optimizer"]))  # Hydra >= 1.3.8: its own partial subclass
    assert type(hparams["net"]) is DictConfig and hparams["net"].hidden == 16
    assert type(hparams["optimizer"]) is partial_type and hparams["optimizer"].func is torch.optim.AdamW
    assert hparams["optimizer"].keywords == {"lr": 0.01, "weight_decay": 0.0}
    assert vars(hparams["optimizer"]) == vars(instantiate(compose().model.optimizer))
    if scheduler:
        assert type(hparams["scheduler"]) is partial_type
        assert hparams["scheduler"].func is torch.optim.lr_scheduler.ReduceLROnPlateau
        assert hparams["scheduler"].keywords == {"mode": "min", "factor": 0.5, "patience": 0}
    else:
        assert hparams["scheduler"] is None
    assert hparams["compile"] is False


def assert_config_hparams(hparams: Any, *, flags: bool = True) -> None:
    """``ConfigModule``'s hyperparameters: the composed config itself, interpolations unresolved, struct kept.

    ``load_from_checkpoint`` hands the module ``DictConfig(dict(saved))`` (Lightning's ``_convert_loaded_hparams``),
    which keeps the content and drops the root's flags whatever the checkpoint held: check flags only on what the
    checkpoint itself gives.
    """
    assert type(hparams) is DictConfig
    assert OmegaConf.to_container(hparams, resolve=False) == OmegaConf.to_container(compose(), resolve=False)
    assert hparams.model.net._get_node("hidden")._value() == "${data.width}" and hparams.model.net.hidden == 16
    assert OmegaConf.is_struct(hparams) or not flags
