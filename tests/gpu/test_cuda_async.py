"""Async saves while training on CUDA over NCCL: no background collective on NCCL, pinned staging, exact resumes.

The Trainer's process group is NCCL; the background part of ``dcp.async_save`` never uses it: across ranks it runs
over the plugin's own gloo group (lightning_dcp/engine/save/async_save.py), and at world size 1 (this tier's one GPU) it
issues no collective at all, so no side group exists. Staging copies into pinned host buffers (engine/save/staging.py).
All five scenarios run in one worker (tests/gpu/_cuda.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, DCPFSDPStrategy, DCPModelParallelStrategy
from lightning_dcp.engine.format.marker import COMMIT_FILE
from tests._models import MixedDtypeFSDP2Model, MixedDtypeModel, RandomDataModule, TinyModel
from tests._scenarios import check_mixed_state, mixed_state_runs
from tests._trainer import assert_same, make_trainer, seed, snapshot, to_cpu
from tests.gpu._cuda import GPU, scenarios_fixture

pytestmark = GPU

RESUME_KINDS = ("ddp", "fsdp2", "fsdp1")
PROBE_KINDS = ("ddp", "fsdp2")


def _strategy(kind: str):
    if kind == "ddp":
        return "dcp_ddp"
    if kind == "fsdp1":
        return DCPFSDPStrategy()
    return DCPModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)


def _model(kind: str, **kwargs):
    # FSDP1 flattens each wrapped module into one tensor, which needs one dtype: its state stays fp32.
    return {"ddp": MixedDtypeModel, "fsdp2": MixedDtypeFSDP2Model, "fsdp1": TinyModel}[kind](**kwargs)


def _resume_worker(rank: int, world_size: int, tmp: str, kind: str) -> dict:
    results = mixed_state_runs(
        tmp,
        accelerator="cuda",
        strategy=lambda: _strategy(kind),
        model=lambda: _model(kind),
        precision="32-true",
        deterministic=True,
    )
    results["backend"] = dist.get_backend()
    return results


@pytest.mark.parametrize("kind", RESUME_KINDS)
def test_async_saves_over_nccl_resume_like_sync_saves(outcomes, kind):
    results = outcomes(f"resume-{kind}")
    assert results.pop("backend") == "nccl"
    check_mixed_state(results, bf16_param=None if kind == "fsdp1" else "gate")


class _InFlightProbe(Callback):
    """At the end of the first epoch, on the GPU: two async saves back to back, checked as they happen."""

    def __init__(self, tmp: str, io: DCPCheckpointIO) -> None:
        self.tmp, self.io, self.seen = tmp, io, {}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        saves = self.io.checkpointer._async
        one, two = os.path.join(self.tmp, "one.ckpt"), os.path.join(self.tmp, "two.ckpt")
        seen = self.seen
        seen["before"] = to_cpu(snapshot(trainer)["params"])
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.save_checkpoint(one)
        seen["gpu_peak_added"] = torch.cuda.max_memory_allocated() - start
        seen["staged_bytes"] = saves.stager.nbytes
        seen["pinned"] = [b.device.type == "cpu" and b.is_pinned() for b in saves.stager._buffers.values()]
        seen["in_flight_one"] = saves.in_flight.url
        seen["world_size"] = trainer.world_size
        seen["side_group"] = None if saves._group is None else dist.get_backend(saves._group)
        seen["stall_s"] = self.io.last_save_seconds
        self.io.checkpointer.wait_for_staging()  # code outside an optimizer step waits for the (queued) GPU copies
        with torch.no_grad():  # the next training step starts while the first save is written
            for param in pl_module.parameters():
                param.add_(1000.0)
        seen["after"] = to_cpu(snapshot(trainer)["params"])
        trainer.save_checkpoint(two)  # waits for the first save: never two in flight
        seen["one_committed_when_two_staged"] = os.path.isfile(os.path.join(one, COMMIT_FILE))
        seen["in_flight_two"] = saves.in_flight.url
        self.io.wait(collective=True)
        seen["one"] = DCPCheckpointIO().load_checkpoint(one)["state_dict"]
        seen["two"] = DCPCheckpointIO().load_checkpoint(two)["state_dict"]
        seen["backend"] = dist.get_backend()


def _probe_worker(rank: int, world_size: int, tmp: str, kind: str) -> dict:
    seed()
    io = DCPCheckpointIO(async_save=True)
    probe = _InFlightProbe(tmp, io)
    trainer = make_trainer(
        1,
        strategy=_strategy(kind),
        accelerator="cuda",
        max_epochs=1,
        limit_train_batches=4,
        plugins=[io],
        callbacks=[probe],
    )
    trainer.fit(_model(kind, hidden=1024), datamodule=RandomDataModule())  # ~13 MB of state to stage
    return probe.seen


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_async_staging_is_pinned_one_in_flight_and_never_torn(outcomes, kind):
    seen = outcomes(f"probe-{kind}")
    assert seen["backend"] == "nccl"
    # Background collectives never run on the NCCL training group: over gloo across ranks, none at world size 1.
    assert seen["side_group"] == ("gloo" if seen["world_size"] > 1 else None), seen["side_group"]
    assert seen["pinned"] and all(seen["pinned"]), "staging buffers must be pinned host memory"
    assert seen["staged_bytes"] > 12e6
    # Staging copies into host memory: the GPU holds no second copy of the state while the save is written.
    assert seen["gpu_peak_added"] < 0.1 * seen["staged_bytes"], seen["gpu_peak_added"]
    assert seen["in_flight_one"].endswith("one.ckpt") and seen["in_flight_two"].endswith("two.ckpt")
    assert seen["one_committed_when_two_staged"]
    assert seen["stall_s"] is not None and seen["stall_s"] > 0
    assert_same(seen["before"], seen["one"], "one")  # the change made while it was written is not in it
    assert_same(seen["after"], seen["two"], "two")
    assert seen["one"]["gate"].dtype == torch.bfloat16 and seen["one"]["body.0.weight"].dtype == torch.float32


outcomes = scenarios_fixture(
    [(f"resume-{kind}", _resume_worker, (kind,)) for kind in RESUME_KINDS]
    + [(f"probe-{kind}", _probe_worker, (kind,)) for kind in PROBE_KINDS],
    timeout=180,
)
