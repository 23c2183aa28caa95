"""The zoo's parts: a setup (one small class per ordinary training setup), its default model and data.

A setup says how to build the model, data, callbacks and Trainer arguments of one ordinary Lightning training setup;
:mod:`tests.setups._run` trains it to an epoch's end, saves, resumes in new objects and compares what the resume
restored with stock Lightning's resume of the same run (and the resumed run's end with the uninterrupted run's).
To add a setup, write a subclass of :class:`Setup` in :mod:`tests.setups.zoo` with the :func:`register` decorator.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SETUPS: dict[str, type[Setup]] = {}

FULL = os.environ.get("LIGHTNING_DCP_ZOO") == "all"
"""Run every setup (``nox -s zoo``); otherwise only the setups marked :attr:`Setup.ci` (the default test run)."""


def selected(**flags: bool) -> list[str]:
    """The names of the setups to run (:data:`FULL` or the CI slice) that have every attribute in ``flags`` set."""
    return sorted(
        name
        for name, setup in SETUPS.items()
        if (FULL or setup.ci) and all(getattr(setup, flag) == value for flag, value in flags.items())
    )


def register(cls: type[Setup]) -> type[Setup]:
    """Add ``cls`` to the zoo under its ``name``."""
    assert cls.name and cls.name not in SETUPS, cls.name
    SETUPS[cls.name] = cls
    return cls


class Setup:
    """One ordinary training setup. Override what differs from the defaults.

    Attributes:
        name: The setup's id in test names.
        epochs: Epochs of the first run; it is saved at the end of its last epoch (``ModelCheckpoint``).
        more: Epochs the resumed run trains on.
        resume_from: The checkpoint's file name in the first run's ``ModelCheckpoint`` directory (default: the one
            saved at the end of epoch ``epochs``); a callback of the setup may save it.
        ranks: World sizes the setup runs at (2 also resumes at 1 from the 2-rank checkpoint).
        find_unused: DDP with ``find_unused_parameters=True`` (stock ``ddp_find_unused_parameters_true`` against
            ``dcp_ddp_find_unused_parameters_true``).
        continues: The resumed run ends exactly where the uninterrupted run ends (both through lightning_dcp, which
            restores the RNG states stock Lightning does not). ``False`` where stock's own semantics differ from the
            uninterrupted run (rank 0's copy of state that differs between ranks).
        fabric: The setup also runs through Fabric's ``fabric.save`` / ``fabric.load`` (:mod:`tests.setups._fabric`).
        fsdp2: ... and through Fabric under FSDP2 (``DCPModelParallelStrategy``: DTensor parameters and state).
        ci: In the slice of the default test run (the whole zoo: ``nox -s zoo``, ``LIGHTNING_DCP_ZOO=all``).
    """

    name = ""
    epochs = 2
    more = 1
    resume_from: str | None = None
    ranks: tuple[int, ...] = (1, 2)
    find_unused = False
    continues = True
    fabric = False
    fsdp2 = False
    ci = False

    def continues_at(self, world_size: int) -> bool:
        """Whether the resumed run at ``world_size`` ends where the uninterrupted one does (:attr:`continues`)."""
        return self.continues

    def model(self, resumed: bool) -> LightningModule:
        """The LightningModule, new for every run; ``resumed`` is true for the run given ``ckpt_path``."""
        return ZooModel()

    def data(self) -> LightningDataModule:
        return ZooData()

    def callbacks(self, resumed: bool) -> list[Any]:
        return []

    def trainer_args(self) -> dict[str, Any]:
        return {}

    def extra(self, model: LightningModule) -> Any:
        """Further state of the model to compare (besides its state dict, buffers and optimizers)."""
        return None


class ZooData(LightningDataModule):
    """Fixed random regression data (8 features, 2 targets), with a counter as datamodule state."""

    def __init__(self, n: int = 32, batch_size: int = 4, shuffle: bool = True) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = torch.randn(n, 2, generator=generator)
        self.batch_size, self.shuffle = batch_size, shuffle
        self.setups = 0

    def setup(self, stage: str) -> None:
        self.setups += 1

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:8], self.y[:8]), batch_size=self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {"setups": self.setups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.setups = state_dict["setups"]


class ZooModel(LightningModule):
    """A small MLP regressor (``body`` then ``head``) with AdamW; setups override the parts they change."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)
