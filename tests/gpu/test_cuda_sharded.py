"""FSDP1 (``dcp_fsdp``) and FSDP2 (``dcp_model_parallel``) on one GPU over NCCL, and their checkpoints across devices.

A checkpoint written on the GPU at world size 1 resumes on CPU/gloo at world size 2 (FSDP2; FSDP1 refuses CPU), and
one written on CPU/gloo at world size 2 resumes on the GPU with either FSDP: the state a resume restores equals the
state that was saved, exactly.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from lightning_dcp import DCPFSDPStrategy, DCPModelParallelStrategy
from tests._models import FSDP2Model, RandomDataModule, TinyModel
from tests._trainer import StateAtStart, assert_same, load_result, make_trainer, save_result, seed, snapshot, to_cpu
from tests.gpu._cuda import GPU, GPU_ENV

pytestmark = GPU

STEPS = 8  # per epoch
KINDS = ("fsdp1", "fsdp2")
RESTORED = ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch")


def _strategy(kind: str, world_size: int):
    if kind == "fsdp1":
        return DCPFSDPStrategy()
    return DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)


def _model(kind: str):
    return TinyModel(hidden=50) if kind == "fsdp1" else FSDP2Model(hidden=50)


def _fit(kind: str, world_size: int, accelerator: str, *, max_epochs: int, callbacks: list, ckpt_path=None):
    trainer = make_trainer(
        world_size,
        strategy=_strategy(kind, world_size),
        accelerator=accelerator,
        max_epochs=max_epochs,
        limit_train_batches=STEPS,
        callbacks=callbacks,
    )
    trainer.fit(_model(kind), datamodule=RandomDataModule(), ckpt_path=ckpt_path)
    return trainer


def _save_callbacks(tmp: str, name: str) -> list:
    return [ModelCheckpoint(dirpath=os.path.join(tmp, name), save_last=True, save_top_k=0)]


def _cpu_save_worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    trainer = _fit("fsdp2", world_size, "cpu", max_epochs=1, callbacks=_save_callbacks(tmp, "cpu"))
    save_result(tmp, "cpu-saved", rank, to_cpu(snapshot(trainer)))


def _gpu_worker(rank: int, world_size: int, tmp: str) -> None:
    for kind in KINDS:
        seed()
        trainer = _fit(kind, 1, "cuda", max_epochs=1, callbacks=_save_callbacks(tmp, kind))
        assert dist.get_backend() == "nccl" and trainer.strategy.root_device.type == "cuda"
        save_result(tmp, f"{kind}-saved", rank, to_cpu(snapshot(trainer)))

        probe = StateAtStart()
        ckpt = os.path.join(tmp, "cpu", "last.ckpt")
        trainer = _fit(kind, 1, "cuda", max_epochs=2, callbacks=[probe], ckpt_path=ckpt)
        save_result(tmp, f"{kind}-from-cpu", rank, {**probe.state, "final_step": trainer.global_step})


def _cpu_resume_worker(rank: int, world_size: int, tmp: str) -> None:
    for kind in KINDS:
        probe = StateAtStart()
        ckpt = os.path.join(tmp, kind, "last.ckpt")
        trainer = _fit("fsdp2", world_size, "cpu", max_epochs=2, callbacks=[probe], ckpt_path=ckpt)
        save_result(tmp, f"cpu-from-{kind}", rank, {**probe.state, "final_step": trainer.global_step})


def test_fsdp1_and_fsdp2_checkpoints_move_between_gpu_and_cpu(tmp_path):
    tmp = str(tmp_path)
    spawn(_cpu_save_worker, 2, tmp)
    spawn(_gpu_worker, 1, tmp, env=GPU_ENV, fresh=True)
    spawn(_cpu_resume_worker, 2, tmp)

    cpu_saved = load_result(tmp, "cpu-saved")
    assert cpu_saved["global_step"] == STEPS
    for kind in KINDS:
        from_cpu = load_result(tmp, f"{kind}-from-cpu")  # CPU/gloo world size 2 -> GPU/NCCL world size 1
        for key in RESTORED:
            assert_same(cpu_saved[key], from_cpu[key], f"{kind}-from-cpu.{key}")
        assert from_cpu["final_step"] == 2 * STEPS

        gpu_saved = load_result(tmp, f"{kind}-saved")  # GPU/NCCL world size 1 -> CPU/gloo world size 2
        assert gpu_saved["global_step"] == STEPS
        assert sorted(os.listdir(os.path.join(tmp, kind, "last.ckpt"))) == [".commit", ".metadata", "__0_0.distcp"]
        for rank in range(2):
            from_gpu = load_result(tmp, f"cpu-from-{kind}", rank)
            for key in RESTORED:
                assert_same(gpu_saved[key], from_gpu[key], f"cpu-from-{kind}.rank{rank}.{key}")
            assert from_gpu["final_step"] == 2 * STEPS
