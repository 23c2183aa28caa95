"""A ``dcp_ddp`` resume skips DDP's broadcast of the weights it restores, and still starts every rank alike.

2 real gloo processes. Each rank builds its model from a seed of its own, and a non-persistent buffer (not in the
checkpoint) of its own, so that anything left unsynchronised shows. ``configure_optimizers`` runs after DDP wraps
the model and before the restore: there the ranks' weights tell whether DDP broadcast them.
"""

from __future__ import annotations

import os

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from lightning_dcp import MemoryCheckpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import load_result, make_trainer, save_result


class RankSeededModel(TinyModel):
    """TinyModel initialised differently on each rank, with a non-persistent buffer of the rank's own."""

    def __init__(self, rank: int, strict: bool = True) -> None:
        torch.manual_seed(100 + rank)
        super().__init__()
        self.register_buffer("scale", torch.full((3,), float(rank + 1)), persistent=False)
        self.strict_loading = strict
        self.at_wrap: list[float] = []

    def configure_optimizers(self):
        self.at_wrap = [p.detach().sum().item() for p in self.parameters()]  # after DDP's wrap, before the restore
        return super().configure_optimizers()


class AtStart(Callback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, module) -> None:
        self.params = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.params["scale"] = module.scale.clone()


def _worker(rank: int, world_size: int, tmp: str) -> None:
    ckpts = os.path.join(tmp, "ckpts")
    torch.manual_seed(0)
    first = make_trainer(world_size, max_steps=4, callbacks=[ModelCheckpoint(dirpath=ckpts, save_last=True)])
    first.fit(RankSeededModel(0), datamodule=RandomDataModule())  # the same weights on every rank: rank 0's seed
    saved = {k: v.detach().clone() for k, v in first.lightning_module.state_dict().items()}
    save_result(tmp, "saved", rank, saved)

    for name, strict in (("strict", True), ("not_strict", False)):
        model, start = RankSeededModel(rank, strict=strict), AtStart()
        trainer = make_trainer(world_size, max_steps=5, callbacks=[start])
        trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=os.path.join(ckpts, "last.ckpt"))
        save_result(tmp, name, rank, {"at_wrap": model.at_wrap, "at_start": start.params})

    # nothing committed yet: ckpt_path="last" of the memory tier restores nothing, so everything is broadcast
    model, start = RankSeededModel(rank), AtStart()
    fresh = os.path.join(tmp, "fresh")  # empty: not the working directory's `checkpoints/`, which may hold anything
    memory = MemoryCheckpoint(os.path.join(tmp, "area"), every_n_train_steps=100, replicas=0, dirpath=fresh)
    trainer = make_trainer(world_size, max_steps=1, callbacks=[memory, start])
    trainer.fit(model, datamodule=RandomDataModule(), ckpt_path="last")
    save_result(tmp, "fresh", rank, {"at_wrap": model.at_wrap, "at_start": start.params})


def test_a_resume_broadcasts_only_what_the_checkpoint_did_not_write(tmp_path):
    tmp = str(tmp_path)
    spawn(_worker, 2, tmp)
    saved = load_result(tmp, "saved", 0)
    assert all(torch.equal(saved[k], load_result(tmp, "saved", 1)[k]) for k in saved)
    strict = [load_result(tmp, "strict", rank) for rank in range(2)]
    # DDP did not broadcast at wrapping: each rank still held its own initial weights
    assert strict[0]["at_wrap"] != strict[1]["at_wrap"]
    for rank in range(2):
        at_start = strict[rank]["at_start"]
        for key, value in saved.items():  # the restore wrote every entry of the state_dict, on every rank
            assert torch.equal(at_start[key], value), key
        assert torch.equal(at_start["scale"], torch.full((3,), 1.0))  # rank 0's non-persistent buffer, broadcast

    # strict_loading=False: DDP's own broadcast at wrapping, as in Lightning
    loose = [load_result(tmp, "not_strict", rank) for rank in range(2)]
    assert loose[0]["at_wrap"] == loose[1]["at_wrap"]
    for rank in range(2):
        assert all(torch.equal(loose[rank]["at_start"][k], v) for k, v in saved.items())

    # nothing to restore: every weight broadcast after the (skipped) wrap-time sync, as DDP would have
    fresh = [load_result(tmp, "fresh", rank) for rank in range(2)]
    assert fresh[0]["at_wrap"] != fresh[1]["at_wrap"]
    for key, value in fresh[0]["at_start"].items():
        assert torch.equal(fresh[1]["at_start"][key], value), key
    assert torch.equal(fresh[1]["at_start"]["scale"], torch.full((3,), 1.0))
