"""Async saves on 2 real gloo processes: same checkpoints as sync, no torn state, errors surface with rank and path."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from lightning_dcp import CheckpointError, DCPCheckpointIO, DCPModelParallelStrategy
from tests._models import FSDP2Model, RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _strategy(kind: str, world_size: int):
    if kind == "fsdp2":
        return DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    return "dcp_ddp"


def _model(kind: str):
    return FSDP2Model(hidden=50) if kind == "fsdp2" else TinyModel()


def _resume_worker(rank: int, world_size: int, tmp: str, kind: str) -> None:
    for mode in ("sync", "async"):
        seed()
        ckpt = ModelCheckpoint(
            dirpath=os.path.join(tmp, mode), every_n_epochs=1, save_top_k=1, monitor="val_loss", save_last=True
        )
        trainer = make_trainer(
            world_size,
            strategy=_strategy(kind, world_size),
            max_epochs=2,
            callbacks=[ckpt],
            plugins=[DCPCheckpointIO(async_save=mode == "async")],
        )
        trainer.fit(_model(kind), datamodule=RandomDataModule())
        seed()
        trainer = make_trainer(
            world_size,
            strategy=_strategy(kind, world_size),
            max_epochs=4,
            plugins=[DCPCheckpointIO(async_save=mode == "async")],
        )
        trainer.fit(_model(kind), datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp, mode, "last.ckpt"))
        save_result(tmp, mode, rank, snapshot(trainer))
        # Only committed checkpoints are visible: the best one and last, nothing staged left behind.
        if rank == 0:
            save_result(tmp, f"{mode}-files", rank, sorted(os.listdir(os.path.join(tmp, mode))))


@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp2", marks=pytest.mark.full)])
def test_async_resume_equals_sync_resume(tmp_path, kind):
    tmp = str(tmp_path)
    spawn(_resume_worker, 2, tmp, kind)
    for rank in range(2):
        sync, async_ = load_result(tmp, "sync", rank), load_result(tmp, "async", rank)
        for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch", "losses"):
            assert_same(sync[key], async_[key], key)
    files = load_result(tmp, "async-files")
    assert len(files) == 2 and "last.ckpt" in files and not any(f.startswith(".") for f in files)


def _torn_worker(rank: int, world_size: int, tmp: str) -> None:
    seed()
    model = TinyModel()
    io = DCPCheckpointIO(async_save=True)
    trainer = make_trainer(world_size, max_epochs=1, plugins=[io])
    trainer.fit(model, datamodule=RandomDataModule())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = os.path.join(tmp, "torn.ckpt")
    trainer.save_checkpoint(path)  # the run's first save: planned in the background, parameters written live
    for param in model.parameters():  # the next training step starts right away, while the save is in the background
        param.grad = torch.full_like(param, 1000.0)
    trainer.optimizers[0].step()  # waits until the save no longer reads the parameters
    assert all(
        not torch.equal(before[k], v) for k, v in model.state_dict().items() if k in dict(model.named_parameters())
    )
    io.wait(collective=True)
    assert os.path.isfile(os.path.join(path, ".commit"))
    loaded = DCPCheckpointIO().load_checkpoint(path)["state_dict"]
    assert_same(before, loaded)

    # A writer that fails in the background: the error reaches the training process at the next save,
    # naming the rank and the path; nothing is committed.
    blocker = os.path.join(tmp, "not-a-dir")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("x")
    trainer.strategy.barrier()
    bad = os.path.join(blocker, "bad.ckpt")
    trainer.save_checkpoint(bad)
    with pytest.raises(CheckpointError, match=r"not-a-dir/bad\.ckpt.*rank") as err:
        trainer.save_checkpoint(os.path.join(tmp, "next.ckpt"))
    save_result(tmp, "error", rank, str(err.value))
    trainer.save_checkpoint(os.path.join(tmp, "after.ckpt"))  # the plugin keeps working
    io.wait(collective=True)  # every rank returns once rank 0 committed
    assert os.path.isfile(os.path.join(tmp, "after.ckpt", ".commit"))
    io.teardown()


def test_async_no_torn_state_and_errors_surface(tmp_path):
    tmp = str(tmp_path)
    spawn(_torn_worker, 2, tmp)
    assert "rank" in load_result(tmp, "error", 0)
    assert not os.path.exists(tmp_path / "next.ckpt")  # the save that raised did not start


def _groups_worker(rank: int, world_size: int, tmp: str) -> None:
    """Which process group each collective of an async save uses, with the default group made as ``cpu:gloo``."""
    import torch.distributed as dist

    from lightning_dcp.engine import Checkpointer, CheckpointerConfig

    dist.init_process_group(backend="cpu:gloo")
    default = dist.group.WORLD

    def ops(group: dist.ProcessGroup) -> int:  # collectives issued on the group so far (its gloo sequence number)
        return group._get_backend(torch.device("cpu"))._get_sequence_number_for_group()

    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    weights = {"w": torch.full((1024, 256), float(rank)), "b": torch.arange(4.0)}
    seen = {}
    for i in range(3):
        path = os.path.join(tmp, f"s{i}.ckpt")
        checkpointer.save({"state_dict": weights}, path, objects={}, collective=True, volatile=[])
        returned = ops(default)
        checkpointer._async.wait()  # this rank's background part only: no collective of the caller's
        seen[i] = ops(default) - returned  # what the background thread ran on it
    side = checkpointer._async._group
    dist.barrier()
    checkpointer.close()
    save_result(
        tmp,
        "groups",
        rank,
        {
            "default_backend": str(dist.get_backend(default)),
            "side": None if side is None else (str(dist.get_backend(side)), side is default, dist.get_world_size(side)),
            "side_ops": None if side is None else ops(side),
            "default_ops_in_background": seen,
        },
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_background_writes_use_their_own_gloo_group_never_the_training_group(tmp_path, world_size):
    tmp = str(tmp_path)
    spawn(_groups_worker, world_size, tmp)
    for rank in range(world_size):
        result = load_result(tmp, "groups", rank)
        assert result["default_backend"] == "cpu:gloo"
        # Nothing the background thread runs (planning, the write's gather, the commit's agreement) touches the
        # default (training) group: on a GPU it is NCCL's, and a second thread's collectives there hang or corrupt.
        assert result["default_ops_in_background"] == {0: 0, 1: 0, 2: 0}
        if world_size == 1:
            assert result["side"] is None  # one process: no group, nothing collective at all
        else:
            assert result["side"] == ("gloo", False, 2)  # a group of its own, gloo whatever the default is
            assert result["side_ops"] > 0
    assert all(os.path.isfile(tmp_path / f"s{i}.ckpt" / ".commit") for i in range(3))
