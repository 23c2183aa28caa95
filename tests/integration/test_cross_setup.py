"""A checkpoint written by one setup resumes under another: ``DCPCheckpointIO`` under Lightning's stock strategy
(optimizer state keyed by parameter ids) and the ``dcp_single_device`` strategy (keyed by FQN), with SGD + momentum,
Adam, and plain SGD (whose state is empty: DCP stores nothing for it). Each resume continues exactly as the
uninterrupted run; each checkpoint consolidates into a ``.ckpt`` whose optimizer state loads into a fresh optimizer."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import DCPCheckpointIO, consolidate
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed, snapshot

SETUPS = {
    "plugin": {"strategy": "auto", "plugins": [DCPCheckpointIO]},
    "dcp": {"strategy": "dcp_single_device", "plugins": []},
}
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd_empty_state": lambda params: torch.optim.SGD(params, lr=0.05),
}


class OrderedData(RandomDataModule):
    """No shuffling: a stock strategy saves no RNG states, and this test is about optimizer layouts, not RNG."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.hparams.batch_size)


class OptimizerModel(TinyModel):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer

    def configure_optimizers(self):
        return OPTIMIZERS[self.optimizer_name](self.parameters())


def _trainer(setup: str, max_steps: int):
    kwargs = SETUPS[setup]
    return make_trainer(
        1, strategy=kwargs["strategy"], plugins=[p() for p in kwargs["plugins"]], max_epochs=-1, max_steps=max_steps
    )


def _fit(setup: str, optimizer: str, max_steps: int, ckpt_path: str | None = None):
    seed()
    trainer = _trainer(setup, max_steps)
    trainer.fit(OptimizerModel(optimizer), datamodule=OrderedData(n=16), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_checkpoints_cross_setups_and_consolidate(tmp_path, optimizer):
    expected = snapshot(_fit("dcp", optimizer, max_steps=8))  # 4 steps per epoch: saves at an epoch boundary
    for writer in SETUPS:
        path = str(tmp_path / f"{writer}.ckpt")
        _fit(writer, optimizer, max_steps=4).save_checkpoint(path)
        assert os.path.isfile(os.path.join(path, ".commit"))
        for reader in SETUPS:
            got = snapshot(_fit(reader, optimizer, max_steps=8, ckpt_path=path))
            for key in ("params", "optimizers", "global_step"):
                assert_same(expected[key], got[key], f"{writer}->{reader}:{key}")

        single = consolidate(path, dst=str(tmp_path / f"{writer}.consolidated"))
        checkpoint = torch.load(single, weights_only=True)
        model = OptimizerModel(optimizer)
        model.load_state_dict(checkpoint["state_dict"])
        fresh = OPTIMIZERS[optimizer](model.parameters())
        fresh.load_state_dict(checkpoint["optimizer_states"][0])  # optimizer.state_dict()'s integer-id layout
        assert len(fresh.state) == (0 if optimizer == "sgd_empty_state" else len(list(model.parameters())))
