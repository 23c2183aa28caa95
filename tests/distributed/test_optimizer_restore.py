"""``Trainer.fit(ckpt_path=...)`` restores each optimizer as stock Lightning does, without running an optimizer step.

DCP's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` step an optimizer that holds no state (zero
gradients) to create the tensors a load fills; a fresh process resuming holds no state. Here the optimizers' state
after a resume must be exactly the ``optimizer.state_dict()`` recorded at the save (what stock Lightning's
``optimizer.load_state_dict`` of its saved file restores), no optimizer step may run between ``setup`` and
``on_train_start``, and the next step must update the weights bit for bit as an optimizer given the saved state by
``load_state_dict`` does. AdamW and SGD with momentum (``TinyModel(two_optimizers=True)``), a save after 3 steps
and a save before the first step (no state yet), at 2 ranks and at 1 rank from the 2-rank save; FSDP2 (DTensor
state) through ``ModelParallelStrategy``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from harness.ranks import spawn
from lightning_dcp import DCPModelParallelStrategy
from tests._models import FSDP2Model, RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, to_cpu

STEPS = 3


class _SaveAt(Callback):
    """Save at ``on_train_start`` (before any step: optimizers hold no state) and after ``STEPS`` batches."""

    def __init__(self, tmp: str, rank: int) -> None:
        self.tmp, self.rank = tmp, rank

    def _save(self, trainer: Trainer, name: str) -> None:
        states = [_local(opt.state_dict()) for opt in trainer.optimizers]
        trainer.save_checkpoint(os.path.join(self.tmp, name))
        after = [_local(opt.state_dict()) for opt in trainer.optimizers]
        assert_same(after, states, f"{name}: the save changed the optimizers")
        save_result(self.tmp, name, self.rank, states)

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self._save(trainer, "fresh")

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == STEPS - 1:
            self._save(trainer, "trained")


class _AtStart(Callback):
    """At ``on_train_start`` of a resume: the optimizers' state dicts, the optimizer steps run since ``setup``, and
    whether each optimizer's next step matches a stock restore of ``saved`` (:func:`_next_step_matches`)."""

    def __init__(self, saved: list[dict] | None = None) -> None:
        self.saved = saved
        self.steps = 0
        self.states: list[dict] | None = None
        self.steps_at_start: int | None = None
        self.next_step: bool | None = None
        self._hook: Any = None

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        self._hook = register_optimizer_step_pre_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1

    def on_train_start(self, trainer: Trainer, pl_module: Any) -> None:
        self.steps_at_start = self.steps
        self._hook.remove()
        self.states = [_local(opt.state_dict()) for opt in trainer.optimizers]
        if self.saved is not None:
            self.next_step = all(_next_step_matches(o, s) for o, s in zip(trainer.optimizers, self.saved, strict=True))


def _local(state: Any) -> Any:
    """A deep CPU copy of ``state`` with each DTensor as this rank's shard."""
    if isinstance(state, DTensor):
        state = state.to_local()
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local(v) for v in state)
    return to_cpu(copy.deepcopy(state))


def _next_step_matches(optimizer: torch.optim.Optimizer, saved: dict) -> bool:
    """Whether the restored ``optimizer``'s next step updates its weights exactly as stock Lightning's restore would.

    Stock Lightning's restore: a new optimizer of the same class over copies of the weights, given the ``saved``
    ``optimizer.state_dict()`` by ``load_state_dict``. Both step once on the same gradients (the restored one on
    the model's own weights: the fit goes on from there, which the test no longer looks at).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    groups, start = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": copies[start : start + n]})
        start += n
    reference = type(optimizer)(groups)
    reference.load_state_dict(copy.deepcopy(saved))
    generator = torch.Generator().manual_seed(5)
    for a, b in zip(params, copies, strict=True):
        grad = torch.randn(a.shape, generator=generator)
        a.grad, b.grad = grad.clone(), grad.clone()
    optimizer.step()
    reference.step()
    return all(torch.equal(a.detach(), b.detach()) for a, b in zip(params, copies, strict=True))


def _save_worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    model = TinyModel(two_optimizers=True)
    trainer = make_trainer(world_size, max_epochs=1, limit_train_batches=STEPS + 1, callbacks=[_SaveAt(tmp, rank)])
    trainer.fit(model, datamodule=RandomDataModule())


def _resume_worker(rank: int, world_size: int, tmp: str, tag: str) -> None:
    out = {}
    for name in ("fresh", "trained"):
        seed(99)  # another seed: everything must come from the checkpoint
        probe = _AtStart(load_result(tmp, name, 0))
        trainer = make_trainer(world_size, max_epochs=1, limit_train_batches=STEPS + 1, callbacks=[probe])
        trainer.fit(TinyModel(two_optimizers=True), datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp, name))
        out[name] = {"states": probe.states, "steps": probe.steps_at_start, "next_step": probe.next_step}
    save_result(tmp, tag, rank, out)


def test_trainer_resume_restores_optimizers_as_saved_without_a_step(tmp_path):
    tmp = str(tmp_path)
    spawn(_save_worker, 2, tmp)
    spawn(_resume_worker, 2, tmp, "ws2")
    spawn(_resume_worker, 1, tmp, "ws1")  # 2 -> 1: DDP replicas are equal, rank 0's record is everyone's
    for tag, ranks in (("ws2", 2), ("ws1", 1)):
        for rank in range(ranks):
            resumed = load_result(tmp, tag, rank)
            for name in ("fresh", "trained"):
                saved = load_result(tmp, name, rank)
                assert resumed[name]["steps"] == 0, (tag, name, "an optimizer step ran during the restore")
                assert_same(resumed[name]["states"], saved, f"{tag}/{name}")
                assert resumed[name]["next_step"], (tag, name)
            fresh = load_result(tmp, "fresh", rank)
            assert all(state["state"] == {} for state in fresh)  # a save before the first step holds no state
            trained = load_result(tmp, "trained", rank)
            assert trained[0]["state"][0]["step"] == STEPS and "momentum_buffer" in trained[1]["state"][0]


def _fsdp2_worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    strategy = DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = make_trainer(
        world_size, strategy=strategy, max_epochs=1, limit_train_batches=STEPS + 1, callbacks=[_SaveAt(tmp, rank)]
    )
    trainer.fit(FSDP2Model(hidden=50), datamodule=RandomDataModule())
    for name in ("fresh", "trained"):
        seed(99)
        probe = _AtStart()
        strategy = DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        trainer = make_trainer(
            world_size, strategy=strategy, max_epochs=1, limit_train_batches=STEPS + 1, callbacks=[probe]
        )
        model = FSDP2Model(hidden=50)
        trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp, name))
        assert probe.steps_at_start == 0, name
        assert_same(probe.states, load_result(tmp, name, rank), name)  # this rank's shards, as saved
        if name == "trained":
            exp_avg = trainer.optimizers[0].state[model.body[0].weight]["exp_avg"]
            weight = model.body[0].weight
            assert isinstance(exp_avg, DTensor) and exp_avg.placements == weight.placements
            assert exp_avg.to_local().shape == weight.to_local().shape


def test_fsdp2_resume_restores_dtensor_optimizer_state_without_a_step(tmp_path):
    spawn(_fsdp2_worker, 2, str(tmp_path))


def test_fabric_load_restores_fresh_optimizers_as_saved_without_a_step(tmp_path):
    """``fabric.load`` into fresh AdamW and SGD-with-momentum optimizers, saved before and after their first step."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_single_device")

    def setup(seed_value: int):
        fabric.seed_everything(seed_value, verbose=False)
        net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        adamw = torch.optim.AdamW(net[0].parameters(), lr=0.01)
        sgd = torch.optim.SGD(net[2].parameters(), lr=0.1, momentum=0.9)
        return fabric.setup_module(net), *fabric.setup_optimizers(adamw, sgd)

    model, adamw, sgd = setup(7)
    steps_run: list[int] = []
    for name, steps in (("fresh", 0), ("trained", STEPS)):
        for _ in range(steps):
            fabric.backward(model(torch.randn(4, 6)).square().mean())
            adamw.step(), sgd.step(), adamw.zero_grad(), sgd.zero_grad()
        saved = [copy.deepcopy(opt.state_dict()) for opt in (adamw, sgd)]
        fabric.save(str(tmp_path / name), {"model": model, "adamw": adamw, "sgd": sgd})
        assert_same([opt.state_dict() for opt in (adamw, sgd)], saved, f"{name}: the save changed the optimizers")

        steps_run.clear()
        hook = register_optimizer_step_pre_hook(lambda *args: steps_run.append(1))
        new_model, new_adamw, new_sgd = setup(99)
        fabric.load(str(tmp_path / name), {"model": new_model, "adamw": new_adamw, "sgd": new_sgd})
        hook.remove()
        assert steps_run == [], name
        assert_same([opt.state_dict() for opt in (new_adamw, new_sgd)], saved, name)
        assert all(_next_step_matches(o.optimizer, s) for o, s in zip((new_adamw, new_sgd), saved, strict=True))


class _PerRankMomentum(torch.optim.Optimizer):
    """A third-party optimizer that keeps a sharded parameter's state as a plain tensor of this rank's shard."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p.to_local()))
                    buf.add_(p.grad.to_local())
                    p.to_local().add_(buf, alpha=-group["lr"])


def _per_rank_worker(rank: int, world_size: int, tmp: str) -> None:
    import warnings

    import pytest
    from lightning.fabric import Fabric

    from lightning_dcp import CheckpointError

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="dcp_model_parallel")
    fabric.launch()

    def setup() -> tuple[Any, Any]:
        model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
        return model, fabric.setup_optimizers(_PerRankMomentum(model.parameters()))

    model, optimizer = setup()
    fabric.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
    path = os.path.join(tmp, "per_rank")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fabric.save(path, {"model": model, "optimizer": optimizer})
    assert any("plain tensor of this rank's shard" in str(w.message) for w in seen), [str(w.message) for w in seen]
    model, optimizer = setup()
    with pytest.raises(CheckpointError, match="'buf' of the sharded parameter '0.weight'.*cannot be restored"):
        fabric.load(path, {"model": model, "optimizer": optimizer})


def test_state_no_checkpoint_can_reshard_is_named_at_the_save_and_refused_at_the_resume(tmp_path):
    """A sharded parameter's per-rank plain-tensor state: the save warns naming it, the resume names the fix."""
    spawn(_per_rank_worker, 2, str(tmp_path))
