"""An optimizer outside torch.optim's step hooks under async saves with deferred staging (issue 40, item 4).

Deferred staging lets the background thread copy the weights after the save call returned, because every optimizer
step waits for those copies in a global pre-step hook. An optimizer whose ``step`` never runs those hooks (a
subclass that skips ``Optimizer.__init__``, so its ``step`` is never wrapped) and that writes through ``p.data``
(invisible to version counters) changed weights under the copies: checkpoints held weights from after the save.
"""

from __future__ import annotations

import os
import re
import warnings
import zlib

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from harness.ranks import spawn
from lightning_dcp import CheckpointError, DCPCheckpointIO
from lightning_dcp.engine.checkpointer import Checkpointer
from tests._trainer import load_result, make_trainer, save_result, seed

_STEPS = 8


class _HookFreeSGD(torch.optim.Optimizer):
    """SGD with decoupled weight decay that never calls ``Optimizer.__init__``: its step hooks never run."""

    def __init__(self, params, lr: float = 0.01, weight_decay: float = 0.5) -> None:  # noqa: D107
        self.param_groups = [{"params": list(params), "lr": lr, "weight_decay": weight_decay}]
        self.defaults = {"lr": lr, "weight_decay": weight_decay}
        self.state = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                p.data.mul_(1 - group["lr"] * group["weight_decay"])  # every parameter, through .data
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self):
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        for i, g in enumerate(groups):
            g["params"] = list(range(i, i + len(self.param_groups[i]["params"])))
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict) -> None:
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})


class _Model(LightningModule):
    """A 32 MiB weight the optimizer decays every step beside a tiny trained head: the step comes right after a save."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.randn(2048, 4096))
        self.head = torch.nn.Linear(8, 1)
        self.at_save: dict[int, tuple[int, int]] = {}

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.head(x).square().mean()

    def configure_optimizers(self):
        return _HookFreeSGD(self.parameters())

    def on_save_checkpoint(self, checkpoint: dict) -> None:  # the weights at the save call
        self.at_save[self.trainer.global_step] = _crc(self.big), _crc(self.head.weight)


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().contiguous().numpy().data)


def _worker(rank: int, world_size: int, tmp: str, out: str) -> None:
    """In its own process: the optimizer it finds is remembered (saves stage at the call) while the trainer lives."""
    seed()
    model = _Model()
    ckpt = ModelCheckpoint(dirpath=tmp, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(
        world_size,
        strategy="dcp_single_device",
        max_steps=_STEPS,
        callbacks=[ckpt],
        plugins=[DCPCheckpointIO(async_save=True)],  # deferred staging: the default
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(torch.randn(4 * _STEPS, 8)), batch_size=4))
    wrong = []
    for name in sorted(os.listdir(tmp)):
        step = int(re.fullmatch(r"step=(\d+)\.ckpt", name).group(1))
        assert os.path.isfile(os.path.join(tmp, name, ".commit")), name
        try:
            tree = Checkpointer().load(os.path.join(tmp, name)).tree["state_dict"]
        except CheckpointError:  # a record written while it changed fails its checksum
            wrong.append(step)
            continue
        if (_crc(tree["big"]), _crc(tree["head.weight"])) != model.at_save[step]:
            wrong.append(step)
    messages = [str(w.message) for w in caught if "step hooks" in str(w.message)]
    save_result(out, "result", rank, {"files": len(os.listdir(tmp)), "wrong": wrong, "messages": messages})


def test_every_committed_checkpoint_holds_the_weights_of_its_save_step(tmp_path):
    work = str(tmp_path / "ckpts")
    os.makedirs(work)
    spawn(_worker, 1, work, str(tmp_path))
    result = load_result(str(tmp_path), "result")
    assert result["files"] == _STEPS
    assert result["wrong"] == [], f"checkpoints of steps {result['wrong']} hold weights from after their save"
    messages = result["messages"]
    assert len(messages) == 1 and "_HookFreeSGD" in messages[0], messages  # said once, naming the optimizer


class _Scheduled(_Model):
    """AdamW under a StepLR: the scheduler wraps ``optimizer.step`` on the instance, which still runs the hooks."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)}


def _scheduled_worker(rank: int, world_size: int, tmp: str, out: str) -> None:
    seed()
    io = DCPCheckpointIO(async_save=True)
    ckpt = ModelCheckpoint(dirpath=tmp, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(world_size, strategy="dcp_single_device", max_steps=4, callbacks=[ckpt], plugins=[io])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Scheduled(), train_dataloaders=DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4))
    messages = [str(w.message) for w in caught if "step hooks" in str(w.message)]
    save_result(out, "result", rank, {"messages": messages, "deferred": io.checkpointer._async.last_deferred})


def test_an_optimizer_under_an_lr_scheduler_keeps_deferred_staging(tmp_path):
    """torch's LR schedulers shadow ``optimizer.step`` with a wrapper of the hooked method: not a bypass."""
    work = str(tmp_path / "ckpts")
    os.makedirs(work)
    spawn(_scheduled_worker, 1, work, str(tmp_path))
    result = load_result(str(tmp_path), "result")
    assert result["messages"] == []
    assert "state_dict.big" in result["deferred"], result["deferred"]  # copied after the call, behind the gate
