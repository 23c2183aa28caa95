"""Shared Trainer set-up and state snapshots for the distributed and integration tests."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import lightning_dcp  # noqa: F401  (registers the dcp_* strategy names)
from harness.trainer import make_trainer  # noqa: F401  (the tests import it from here)


def seed(value: int = 7) -> None:
    seed_everything(value, verbose=False)


def snapshot(trainer: Trainer) -> dict[str, Any]:
    """Everything that must survive a resume, as full CPU values (FQN-keyed; DTensors gathered).

    Collective: call on all ranks (gathering DTensor shards is a collective).
    """
    model = trainer.lightning_module
    options = StateDictOptions(full_state_dict=True)
    return {
        "params": _clone(get_model_state_dict(model, options=options)),
        "optimizers": [_clone(get_optimizer_state_dict(model, opt, options=options)) for opt in trainer.optimizers],
        "lrs": [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers],
        "schedulers": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "losses": list(getattr(model, "losses", [])),
    }


class StateAtStart(Callback):
    """Record :func:`snapshot` in ``on_train_start``: the state a resume restored, before any step changes it."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.state = to_cpu(snapshot(trainer))


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor copied to CPU memory (nested dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def save_result(directory: str, name: str, rank: int, value: Any) -> None:
    torch.save(value, os.path.join(directory, f"{name}.rank{rank}.pt"))


def load_result(directory: str, name: str, rank: int = 0) -> Any:
    return torch.load(os.path.join(directory, f"{name}.rank{rank}.pt"), weights_only=False)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact (bitwise for tensors) equality of nested values, naming the first differing path."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
