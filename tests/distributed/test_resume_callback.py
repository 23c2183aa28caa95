"""ElasticResume on real gloo processes: mid-epoch resume at the same and at other world sizes.

One run at 2 ranks x 4 samples x accumulate 2 (global batch 16; 64 samples = 4 steps per epoch) is interrupted
after step 6 (half-way through epoch 1) and resumed at 2 ranks (bit-identical continuation), at 1 rank
(accumulate 4) and at 4 ranks (accumulate 1). Each batch logs its sample ids with the epoch and optimizer step.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from lightning_dcp import ElasticResume
from tests._loaders import samples_by
from tests._models import IdLoggingModel, IndexedDataModule
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot

STEPS, EPOCHS, SAMPLES = 12, 3, 64
CKPT = "epoch=1-step=6.ckpt"


class DropoutIdModel(IdLoggingModel):
    """IdLoggingModel with dropout: every step draws from the global torch generator (issue 11 #9)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.body(x)))


def _record(tmp: str, name: str, rank: int, trainer, model, callback: ElasticResume | None) -> None:
    result = snapshot(trainer)
    result["ids"] = model.seen_ids
    result["accumulate"] = trainer.accumulate_grad_batches
    result["state"] = callback.state_dict() if callback is not None else None
    save_result(tmp, name, rank, result)


def _fit(world_size: int, model_cls=IdLoggingModel, **kwargs):
    seed()
    model, callback = model_cls(), ElasticResume()
    trainer = make_trainer(world_size, callbacks=[callback, *kwargs.pop("callbacks", [])], **kwargs)
    trainer.fit(model, datamodule=IndexedDataModule(SAMPLES, batch_size=4))
    return trainer, model, callback


def _two_ranks(rank: int, world_size: int, tmp: str) -> None:
    trainer, model, cb = _fit(world_size, max_epochs=EPOCHS, accumulate_grad_batches=2)
    _record(tmp, "full", rank, trainer, model, cb)

    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_train_steps=6, save_top_k=-1)
    trainer, model, cb = _fit(world_size, max_steps=6, accumulate_grad_batches=2, callbacks=[ckpt])
    _record(tmp, "first", rank, trainer, model, cb)

    _resume(rank, world_size, tmp, "resumed2", accumulate_grad_batches=2)
    _resume(rank, world_size, tmp, "plain2", callback=False, accumulate_grad_batches=2)

    # Dropout: the random streams of a mid-epoch resume continue exactly (RNG restored after the epoch's iterator).
    trainer, model, cb = _fit(world_size, DropoutIdModel, max_epochs=EPOCHS, accumulate_grad_batches=2)
    _record(tmp, "full_dropout", rank, trainer, model, cb)
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "dropout"), every_n_train_steps=6, save_top_k=-1)
    _fit(world_size, DropoutIdModel, max_steps=6, accumulate_grad_batches=2, callbacks=[ckpt])
    seed()
    torch.rand(17)  # the resumed process's own random state must not matter (PL_GLOBAL_SEED, the sampler's, stays)
    resumed = make_trainer(world_size, max_epochs=EPOCHS, accumulate_grad_batches=2, callbacks=[ElasticResume()])
    model = DropoutIdModel()
    resumed.fit(
        model, datamodule=IndexedDataModule(SAMPLES, batch_size=4), ckpt_path=os.path.join(tmp, "dropout", CKPT)
    )
    _record(tmp, "resumed_dropout", rank, resumed, model, None)


def _resume(rank: int, world_size: int, tmp: str, name: str, **kwargs) -> None:
    seed()
    model = IdLoggingModel()
    callback = ElasticResume() if kwargs.pop("callback", True) else None
    trainer = make_trainer(world_size, max_epochs=EPOCHS, callbacks=[callback] if callback else [], **kwargs)
    trainer.fit(model, datamodule=IndexedDataModule(SAMPLES, batch_size=4), ckpt_path=_ckpt(tmp))
    _record(tmp, name, rank, trainer, model, callback)


def _other_ranks(rank: int, world_size: int, tmp: str) -> None:
    _resume(rank, world_size, tmp, f"resumed{world_size}")
    if world_size == 4:  # 16 samples per step cannot be 4 ranks x 3 samples x an integer accumulation
        seed()
        trainer = make_trainer(world_size, max_epochs=EPOCHS, callbacks=[ElasticResume()])
        with pytest.raises(ValueError, match=r"global batch size of 16 samples on 4 ranks with 3 samples per device"):
            trainer.fit(IdLoggingModel(), datamodule=IndexedDataModule(SAMPLES, batch_size=3), ckpt_path=_ckpt(tmp))


def _ckpt(tmp: str) -> str:
    return os.path.join(tmp, "ckpts", CKPT)


def _assert_close(a, b, path: str = "") -> None:
    """Equal up to float summation order (another world size adds the same gradients in another order)."""
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"{path}: max diff {(a - b).abs().max()}"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            if k != "seen":  # a per-rank sample counter: differs with the world size by design
                _assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_close(x, y, f"{path}[{i}]")
    else:
        assert_same(a, b, path)


@pytest.mark.full
def test_elastic_resume(tmp_path):
    tmp = str(tmp_path)
    spawn(_two_ranks, 2, tmp)
    spawn(_other_ranks, 1, tmp)
    spawn(_other_ranks, 4, tmp)

    def results(name: str, world_size: int) -> list[dict]:
        return [load_result(tmp, name, r) for r in range(world_size)]

    full, first = results("full", 2), results("first", 2)
    full_steps, full_epochs = samples_by(full, 1), samples_by(full, 0)
    assert sorted(full_steps) == list(range(STEPS))
    assert all(sum(c.values()) == 16 for c in full_steps.values())
    assert all(c == Counter(range(SAMPLES)) for c in full_epochs.values())
    assert full[0]["state"]["samples_total"] == EPOCHS * SAMPLES
    assert first[0]["state"]["samples_in_epoch"] == 32 and first[0]["state"]["global_batch_size"] == 16

    # Same world size: bit-identical continuation, rank by rank, batch by batch.
    for rank in range(2):
        resumed = load_result(tmp, "resumed2", rank)
        for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch"):
            assert_same(full[rank][key], resumed[key], key)
        assert first[rank]["ids"] + resumed["ids"] == full[rank]["ids"]
        assert first[rank]["losses"] + resumed["losses"] == full[rank]["losses"]

    for rank in range(2):  # with dropout too: the mid-epoch resume continues the random streams bit for bit
        full_dropout, resumed_dropout = (
            load_result(tmp, "full_dropout", rank),
            load_result(tmp, "resumed_dropout", rank),
        )
        for key in ("params", "optimizers", "global_step"):
            assert_same(full_dropout[key], resumed_dropout[key], key)
        assert resumed_dropout["losses"] == full_dropout["losses"][6 * 2 :]
        assert not torch.equal(full_dropout["params"]["body.0.weight"], full[rank]["params"]["body.0.weight"])

    # Without the callback Lightning restarts epoch 1 at its first batch: samples seen twice, others never.
    plain_epoch1 = samples_by(first + results("plain2", 2), 0)[1]
    assert plain_epoch1 != full_epochs[1] and max(plain_epoch1.values()) == 2

    # Other world sizes: same accumulation-adjusted global batch, same samples per step and per epoch.
    for world_size, accumulate in ((1, 4), (4, 1)):
        resumed = results(f"resumed{world_size}", world_size)
        assert all(r["accumulate"] == accumulate for r in resumed)
        assert samples_by(first + resumed, 1) == full_steps
        assert samples_by(first + resumed, 0) == full_epochs
        assert resumed[0]["state"]["samples_total"] == EPOCHS * SAMPLES
        assert resumed[0]["state"]["global_batch_size"] == 16
        for rank in range(world_size):
            assert resumed[rank]["global_step"] == STEPS and resumed[rank]["epoch"] == EPOCHS
            for key in ("params", "optimizers", "lrs", "schedulers"):
                _assert_close(full[0][key], resumed[rank][key], key)
