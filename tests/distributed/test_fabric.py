"""Fabric's ``dcp_*`` strategies on real gloo processes: DDP and FSDP2 saves, exact resumes, resharding 2 -> 1, 3.

Two spawns: saves at 2 ranks (DDP with an async save and a bit-identical resume in the same processes; FSDP2), then
loads of both checkpoints at 3 ranks under both strategies; then at 1 process (``dcp_single_device``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import lightning_dcp  # noqa: F401  (registers the dcp_* names in Fabric's registry)
from harness.ranks import spawn
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.fabric import DCPDDPStrategy
from tests._trainer import _clone, assert_same, load_result, save_result

STEPS = 3


def _net() -> nn.Module:
    # hidden=50: uneven FSDP2 shards at 3 ranks; dropout: training consumes the RNG every step
    return nn.Sequential(nn.Linear(6, 50), nn.Tanh(), nn.Dropout(0.3), nn.Linear(50, 2))


def _fabric(world_size: int, strategy: Any) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, seed: int = 7):
    fabric.seed_everything(seed, verbose=False)
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    return model, optimizer


def _train(fabric: Fabric, model, optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model, optimizer) -> dict[str, Any]:
    """Model and optimizer state as full CPU tensors (DTensors gathered). Collective."""
    options = StateDictOptions(full_state_dict=True)
    return {
        "model": _clone(get_model_state_dict(model.module, options=options)),
        "optimizer": _clone(get_optimizer_state_dict(model.module, optimizer.optimizer, options=options)),
    }


def _save_worker(rank: int, world_size: int, tmp: str) -> None:
    """DDP (async save, then a bit-identical resume in the same processes) and FSDP2 saves, in one process group."""
    fabric = _fabric(world_size, DCPDDPStrategy(async_save=True))
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, STEPS)
    fabric.save(os.path.join(tmp, "ddp"), {"model": model, "optimizer": optimizer, "step": STEPS})
    saved = _full(model, optimizer)  # the staged copy is what gets written, whatever training does next
    save_result(tmp, "ddp_saved", rank, saved)
    reference = {"losses": _train(fabric, model, optimizer, STEPS), **_full(model, optimizer), "draw": torch.rand(3)}

    model, optimizer = _setup(fabric, seed=99)  # fresh objects, another seed: everything must come from the file
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert fabric.load(os.path.join(tmp, "ddp"), state) == {}
    assert state["step"] == STEPS
    assert_same(_full(model, optimizer), saved, "loaded")
    resumed = {"losses": _train(fabric, model, optimizer, STEPS), **_full(model, optimizer), "draw": torch.rand(3)}
    assert_same(resumed, reference, "resumed")  # bit-identical: weights, optimizer, losses, RNG streams
    fabric.strategy.wait_for_save()

    fabric = _fabric(world_size, "dcp_model_parallel")
    model, optimizer = _setup(fabric)
    assert isinstance(model.module[0].weight, DTensor)
    _train(fabric, model, optimizer, STEPS)
    fabric.save(os.path.join(tmp, "fsdp2"), {"model": model, "optimizer": optimizer, "step": STEPS})
    save_result(tmp, "fsdp2_saved", rank, _full(model, optimizer))


def _reshard_worker(rank: int, world_size: int, tmp: str) -> None:
    """Load both checkpoints under both strategies at this world size (one process group, two Fabric objects)."""
    for strategy in ("dcp_ddp", "dcp_model_parallel"):
        fabric = _fabric(world_size, strategy)
        for name in ("ddp", "fsdp2"):
            model, optimizer = _setup(fabric, seed=99)
            state = {"model": model, "optimizer": optimizer, "step": 0}
            fabric.load(os.path.join(tmp, name), state)
            assert state["step"] == STEPS, (strategy, name)
            assert_same(_full(model, optimizer), load_result(tmp, f"{name}_saved"), f"{name} under {strategy}")
        _train(fabric, model, optimizer, 1)  # training goes on from the loaded (resharded) state


def test_fabric_ddp_and_fsdp2_resume_and_reshard(tmp_path):
    tmp = str(tmp_path)
    spawn(_save_worker, 2, tmp)
    for name in ("ddp", "fsdp2"):
        files = sorted(os.listdir(tmp_path / name))
        assert files == [".commit", ".metadata", "__0_0.distcp", "__1_0.distcp"], files
    # DDP: each replicated tensor is written once, and the tensors are spread over both ranks' files (DCP's dedup)
    metadata = read_metadata(Location(str(tmp_path / "ddp")))
    tensors = [k for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)]
    writers = {k: [i.relative_path for x, i in metadata.storage_data.items() if x.fqn == k] for k in tensors}
    assert all(len(files) == 1 for files in writers.values()), writers
    assert sorted({files[0] for files in writers.values()}) == ["__0_0.distcp", "__1_0.distcp"]
    spawn(_reshard_worker, 3, tmp)
    # one process, no process group (dcp_single_device): both checkpoints load whole
    fabric = Fabric(accelerator="cpu", devices=1, strategy="dcp_single_device")
    for name in ("ddp", "fsdp2"):
        model, optimizer = _setup(fabric, seed=99)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        assert fabric.load(str(tmp_path / name), state) == {} and state["step"] == STEPS
        assert_same(_full(model, optimizer), load_result(tmp, f"{name}_saved"), f"{name} at 1 process")
