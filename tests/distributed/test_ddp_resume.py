"""DDP on 2 real gloo processes: sharded save, resume bit-identical, resume on 1 process."""

from __future__ import annotations

import os

from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _fit_worker(rank: int, world_size: int, tmp: str, two_optimizers: bool) -> None:
    # Uninterrupted: 4 epochs.
    seed()
    model = TinyModel(two_optimizers=two_optimizers)
    trainer = make_trainer(world_size, max_epochs=4)
    trainer.fit(model, datamodule=RandomDataModule())
    save_result(tmp, "full", rank, snapshot(trainer))

    # Interrupted: 2 epochs with a checkpoint at each epoch end, then resume to 4.
    seed()
    model = TinyModel(two_optimizers=two_optimizers)
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_epochs=1, save_top_k=-1, save_last=True)
    trainer = make_trainer(world_size, max_epochs=2, callbacks=[ckpt])
    trainer.fit(model, datamodule=RandomDataModule())
    save_result(tmp, "first", rank, snapshot(trainer))

    seed()  # the sampler shuffles with PL_GLOBAL_SEED + epoch: the same seed gives the same data order
    model = TinyModel(two_optimizers=two_optimizers)
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_epochs=1, save_top_k=-1, save_last=True)
    trainer = make_trainer(world_size, max_epochs=4, callbacks=[ckpt])
    trainer.fit(model, datamodule=RandomDataModule(), ckpt_path="last")
    save_result(tmp, "resumed", rank, snapshot(trainer))
    save_result(tmp, "extra", rank, model.extra_saved)


def test_ddp_resume_is_bit_identical(tmp_path):
    tmp = str(tmp_path)
    spawn(_fit_worker, 2, tmp, False)
    for rank in range(2):
        full, first, resumed = (load_result(tmp, n, rank) for n in ("full", "first", "resumed"))
        assert full["global_step"] == resumed["global_step"] == 2 * first["global_step"] == 32
        for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch"):
            assert_same(full[key], resumed[key], key)
        # Logged losses: the resumed run repeats exactly the second half of the uninterrupted run.
        assert resumed["losses"] == full["losses"][len(first["losses"]) :]
        assert first["losses"] == full["losses"][: len(first["losses"])]
        assert load_result(tmp, "extra", rank) == {"note": "kept", "values": [1, 2, 3]}
    # One data file per rank, DCP metadata, and the committed checkpoints ModelCheckpoint named.
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == [
        "epoch=0-step=8.ckpt",
        "epoch=1-step=16.ckpt",
        "epoch=2-step=24.ckpt",
        "epoch=3-step=32.ckpt",
        "last.ckpt",
    ]
    files = sorted(os.listdir(tmp_path / "ckpts" / "last.ckpt"))
    assert files == [".commit", ".metadata", "__0_0.distcp", "__1_0.distcp"]
