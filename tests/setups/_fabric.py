"""The zoo through Fabric: the setups flagged ``fabric`` in a plain training loop, ``fabric.save`` / ``fabric.load``.

Per setup and world size, on every rank: stock Fabric (``SingleDeviceStrategy`` / ``DDPStrategy``, a ``torch.save``
file) and lightning_dcp (``dcp_single_device`` / ``DCPDDPStrategy``) each train ``epochs + more`` epochs, saving
``{"model", "opt<i>", "sched<i>", "epoch"}`` after ``epochs``; each then loads that save into new objects (what was
loaded is recorded) and trains on. ``"fsdp2"`` runs ours only under ``DCPModelParallelStrategy`` (FSDP2 over every
rank; DTensor state), whose reference is the state right after the save. ``"reshard"`` loads the 2-rank saves (DDP
and FSDP2) at one rank. Every state is recorded as full CPU tensors (DTensors gathered).
"""

from __future__ import annotations

import copy
import os
import traceback
from typing import Any

import torch
from lightning.fabric import Fabric, seed_everything
from lightning.fabric.strategies import DDPStrategy
from lightning.pytorch import LightningModule
from torch.distributed.tensor import DTensor

from lightning_dcp.fabric import DCPDDPStrategy, DCPModelParallelStrategy
from tests.setups import zoo
from tests.setups._base import SETUPS, Setup

__all__ = ["run_fabric_zoo"]

SEED, RESUME_SEED = 7, 99


def _optimizers_of(model: Any) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """The optimizers and lr schedulers ``configure_optimizers`` returns, in any of Lightning's forms."""
    configured = model.configure_optimizers()
    schedulers: list[Any] = []
    if isinstance(configured, dict):
        scheduler = configured.get("lr_scheduler")
        configured, schedulers = [configured["optimizer"]], [scheduler] if scheduler is not None else []
    elif isinstance(configured, tuple) and len(configured) == 2 and isinstance(configured[1], list):
        configured, schedulers = configured
    optimizers = [configured] if isinstance(configured, torch.optim.Optimizer) else list(configured)
    return optimizers, [s["scheduler"] if isinstance(s, dict) else s for s in schedulers]


def _full(value: Any) -> Any:
    """A deep CPU copy with each DTensor gathered whole. Collective where it holds DTensors."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_full(v) for v in value)
    return copy.deepcopy(value)


class _Run:
    """One setup's model, optimizers and schedulers under one Fabric, and its training loop."""

    def __init__(self, fabric: Fabric, setup: Setup, *, resumed: bool) -> None:
        seed_everything(RESUME_SEED if resumed else SEED, verbose=False)
        self.fabric, self.setup = fabric, setup
        module = setup.model(resumed)
        self.model = fabric.setup_module(module)  # first: FSDP2 shards it, the optimizers then hold DTensors
        optimizers, self.schedulers = _optimizers_of(module)
        self.optimizers = list(fabric.setup_optimizers(*optimizers)) if len(optimizers) > 1 else []
        if len(optimizers) == 1:
            self.optimizers = [fabric.setup_optimizers(optimizers[0])]
        self.module = module
        seed_everything(SEED, verbose=False)  # the run's seed, as a user's script sets it (the sampler's seed is it)
        self.loader = fabric.setup_dataloaders(setup.data().train_dataloader())

    def state(self, epoch: int) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model, "epoch": epoch}
        state.update({f"opt{i}": optimizer for i, optimizer in enumerate(self.optimizers)})
        state.update({f"sched{i}": scheduler for i, scheduler in enumerate(self.schedulers)})
        return state

    def record(self) -> dict[str, Any]:
        return {
            "model": _full(self.module.state_dict()),
            "optimizers": [_full(optimizer.state_dict()) for optimizer in self.optimizers],
            "schedulers": [_full(scheduler.state_dict()) for scheduler in self.schedulers],
        }

    def train(self, epochs: range) -> None:
        for epoch in epochs:
            self.loader._num_iter_calls = epoch  # Fabric sets the sampler's epoch from its count of iterations
            for index, (x, y) in enumerate(self.loader):
                self.step(x, y)
                if type(self.module).on_train_batch_end is not LightningModule.on_train_batch_end:
                    self.module.on_train_batch_end(None, (x, y), index)  # the setup's own (an EMA update)
            for scheduler in self.schedulers:
                if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    scheduler.step()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        def closure() -> torch.Tensor:
            for optimizer in self.optimizers:
                optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.fabric.backward(loss)
            return loss

        if any(isinstance(o.optimizer, torch.optim.LBFGS) for o in self.optimizers):
            for optimizer in self.optimizers:
                optimizer.step(closure)
            return
        closure()
        for optimizer in self.optimizers:
            optimizer.step()


def _fabric(world_size: int, strategy: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return fabric


def _strategies(setup: Setup, world_size: int, kind: str) -> tuple[Any, Any]:
    if kind == "fsdp2":
        return None, (lambda: DCPModelParallelStrategy()) if world_size > 1 else (lambda: "dcp_single_device")
    if world_size == 1:
        return (lambda: "auto"), (lambda: "dcp_single_device")
    unused = {"find_unused_parameters": True} if setup.find_unused else {}
    return (lambda: DDPStrategy(**unused)), (lambda: DCPDDPStrategy(**unused))


def _path(root: str, name: str, kind: str, world_size: int, which: str) -> str:
    return os.path.join(root, "fabric", name, f"{kind}-ws{world_size}", which + (".pt" if which == "stock" else ""))


def _one(setup: Setup, root: str, world_size: int, kind: str, saved_at: int, resume_only: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stock, ours = _strategies(setup, world_size, kind)
    for which, make in (("stock", stock), ("ours", ours)):
        if make is None:
            continue
        fabric = _fabric(world_size, make())
        path = _path(root, setup.name, kind, saved_at, which)
        if not resume_only:
            run = _Run(fabric, setup, resumed=False)
            run.train(range(setup.epochs))
            fabric.save(path, run.state(setup.epochs))
            out[f"{which}_saved"] = run.record()
            run.train(range(setup.epochs, setup.epochs + setup.more))
            out[f"{which}_full"] = run.record()
        if hasattr(fabric.strategy, "wait_for_save"):
            fabric.strategy.wait_for_save()
        run = _Run(fabric, setup, resumed=True)
        state = run.state(0)
        fabric.load(path, state)
        assert state["epoch"] == setup.epochs, state["epoch"]
        out[which] = run.record()
        run.train(range(setup.epochs, setup.epochs + setup.more))
        out[f"{which}_final"] = run.record()
    return out


def run_fabric_zoo(rank: int, world_size: int, root: str, names: dict[str, list[str]]) -> None:
    """Run the named setups of each kind through Fabric (see the module docstring); record this rank's results.

    ``names``: per kind, the setups: ``"ddp"`` (stock against ours at ``world_size``: single device at 1),
    ``"fsdp2"`` (ours under FSDP2), ``"reshard"`` (at ``world_size``, the 2-rank ``"ddp"`` and ``"fsdp2"`` saves).
    Every kind runs in this one process group.
    """
    assert zoo.__name__  # the setups are registered by importing the zoo
    for kind, chosen in names.items():
        results: dict[str, Any] = {}
        for name in chosen:
            setup = SETUPS[name]()
            try:
                if kind == "reshard":
                    results[name] = {
                        "ddp": _one(setup, root, world_size, "ddp", 2, True),
                        "fsdp2": _one(setup, root, world_size, "fsdp2", 2, True) if setup.fsdp2 else None,
                    }
                else:
                    results[name] = _one(setup, root, world_size, kind, world_size, False)
            except BaseException:  # noqa: BLE001 - recorded and reported by the test, per setup
                results[name] = {"error": traceback.format_exc()}
        torch.save(results, os.path.join(root, f"fabric-{kind}-ws{world_size}-rank{rank}.pt"))


def load_fabric_results(root: str, kind: str, world_size: int, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(root, f"fabric-{kind}-ws{world_size}-rank{rank}.pt"), weights_only=False)
