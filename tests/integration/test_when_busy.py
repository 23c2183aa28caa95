"""Saves requested faster than the disk takes them (``when_busy``): a real Trainer saving a large state every step."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import DCPCheckpointIO
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.storage.location import Location
from tests._trainer import make_trainer, seed

_STEPS = 6


class _Big(LightningModule):
    """A 128 MiB buffer that every forward pass changes (copied at each save call, then written in the background)
    beside a tiny model: a step takes milliseconds, a save's write much longer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("big", torch.zeros(8192, 4096))
        self.head = torch.nn.Linear(8, 1)
        self.at_save: dict[int, tuple[list[float], list[float]]] = {}

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.big[batch_idx % 8192].add_(1.0)  # a running statistic of sorts
        return self.head(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict) -> None:  # the state at the save call (each save's truth)
        self.at_save[self.trainer.global_step] = _fingerprint(self.big.detach(), self.head.weight.detach())


def _fingerprint(big: torch.Tensor, head: torch.Tensor) -> tuple[list[float], list[float]]:
    return big[:_STEPS].sum(dim=1).tolist(), head.flatten().tolist()  # the rows training_step changes


def _fit(tmp: str, when_busy: str, **checkpoint: object) -> tuple[_Big, DCPCheckpointIO, list[str]]:
    seed()
    model = _Big()
    io = DCPCheckpointIO(async_save=True, when_busy=when_busy)
    ckpt = ModelCheckpoint(dirpath=tmp, filename="{step}", every_n_train_steps=1, **checkpoint)
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=_STEPS, callbacks=[ckpt], plugins=[io])
    data = DataLoader(TensorDataset(torch.randn(4 * _STEPS, 8)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=data)
    return model, io, [str(w.message) for w in caught if "when_busy" in str(w.message)]


def _committed_steps(tmp: str) -> dict[int, str]:
    found = {}
    for _, location in committed_checkpoints(Location(tmp)):
        match = re.fullmatch(r"step=(\d+)\.ckpt", location.name)
        if match:
            found[int(match.group(1))] = location.path
    return found


def _check_contents(model: _Big, committed: dict[int, str]) -> None:
    for step, path in committed.items():
        tree = Checkpointer().load(path).tree["state_dict"]
        assert _fingerprint(tree["big"], tree["head.weight"]) == model.at_save[step], step


def test_skip_returns_at_once_warns_per_step_and_commits_the_others(tmp_path):
    model, io, messages = _fit(str(tmp_path), "skip", save_top_k=-1)
    skipped = [step for step, _ in io.checkpointer.skipped]
    committed = _committed_steps(str(tmp_path))
    assert skipped, "every save found the previous ~200 MiB write done: the state is too small to test skipping"
    assert sorted([*skipped, *committed]) == list(range(1, _STEPS + 1))  # every requested save: written or skipped
    assert 1 in committed and not set(skipped) & set(committed)
    assert len(messages) == len(skipped)
    for step, message in zip(skipped, messages, strict=True):
        assert f"skipped the checkpoint of step {step} to " in message
        assert f"step={step}.ckpt" in message and "still being written" in message
    for step in skipped:  # nothing written for a skipped save
        assert not os.path.exists(tmp_path / f"step={step}.ckpt")
    _check_contents(model, committed)


def test_wait_commits_every_requested_save(tmp_path):
    model, io, messages = _fit(str(tmp_path), "wait", save_top_k=-1)
    assert io.checkpointer.skipped == [] and messages == []
    committed = _committed_steps(str(tmp_path))
    assert sorted(committed) == list(range(1, _STEPS + 1))
    _check_contents(model, committed)


def test_skip_never_lets_top_k_pruning_remove_the_last_committed_checkpoint(tmp_path):
    model, io, _ = _fit(str(tmp_path), "skip", save_top_k=1, monitor=None)
    assert io.checkpointer.skipped
    committed = _committed_steps(str(tmp_path))
    newest = max(step for step in range(1, _STEPS + 1) if step not in {s for s, _ in io.checkpointer.skipped})
    assert newest in committed  # the newest save that ran survives pruning requested after skipped saves
    _check_contents(model, committed)


def test_when_busy_is_checked():
    with pytest.raises(ValueError, match="when_busy"):
        DCPCheckpointIO(async_save=True, when_busy="drop")
    assert DCPCheckpointIO(async_save=True).checkpointer.when_busy == "wait"


def test_fabric_strategies_take_when_busy_and_skip_a_save_while_one_is_written(tmp_path):
    from lightning.fabric import Fabric

    from lightning_dcp.fabric import DCPSingleDeviceStrategy

    with pytest.raises(ValueError, match="when_busy"):
        DCPSingleDeviceStrategy(async_save=True, when_busy="drop")
    strategy = DCPSingleDeviceStrategy(device="cpu", async_save=True, when_busy="skip")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    big = torch.zeros(16384, 4096)  # 256 MiB: its write (and fsync) outlasts the next call by far
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.save(str(tmp_path / "a"), {"big": big, "step": 1})
        big.add_(1.0)
        fabric.save(str(tmp_path / "b"), {"big": big, "step": 2})
        strategy.wait_for_save()
    skipped = strategy.checkpointer.skipped
    messages = [str(w.message) for w in caught if "when_busy" in str(w.message)]
    committed = sorted(location.name for _, location in committed_checkpoints(Location(str(tmp_path))))
    assert skipped == [(2, str(tmp_path / "b"))]  # the step read from the saved state's "step"
    assert committed == ["a"] and len(messages) == 1 and "step 2" in messages[0]
    assert Checkpointer().load(str(tmp_path / "a")).tree["big"].sum().item() == 0.0
