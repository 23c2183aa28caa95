"""Resharding matrix: every checkpoint of {1, 2, 3, 4} ranks x {DDP, FSDP2, single device} loads into every other.

Nine saving configurations (single device at 1; ``dcp_ddp`` and FSDP2 ``fully_shard`` at 1-4 ranks) train a
``hidden=50`` model (uneven FSDP2 shards at 3 ranks) with two optimizers (AdamW, SGD with momentum) and two lr
schedulers, save, and record their full state. Every other configuration then restores each checkpoint
(``fit(ckpt_path=...)`` with ``max_steps`` at the saved step, so nothing trains) and must hold exactly the saved
model, optimizer states (step counts included), lr, scheduler states and ``global_step``.

Spawns are shared: the ascending pass (1, 2, 3, 4 ranks) saves and loads the checkpoints written at fewer or the
same ranks, the descending pass (3, 2, 1) loads those written at more ranks.
"""

from __future__ import annotations

import os
import traceback

import pytest

from harness.ranks import spawn
from lightning_dcp import DCPModelParallelStrategy
from tests._models import FSDP2Model, RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot

WORLD_SIZES = (1, 2, 3, 4)
CONFIGS = [("single", 1)] + [(kind, ws) for ws in WORLD_SIZES for kind in ("ddp", "fsdp2")]
KEYS = ("params", "optimizers", "lrs", "schedulers", "global_step")


def _name(kind: str, world_size: int) -> str:
    return f"{kind}{world_size}"


def _trainer(kind: str, world_size: int, **kwargs):
    if kind == "fsdp2":
        strategy = DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        model = FSDP2Model(hidden=50, two_optimizers=True)
    else:
        strategy = "dcp_single_device" if kind == "single" else "dcp_ddp"
        model = TinyModel(hidden=50, two_optimizers=True)
    return make_trainer(world_size, strategy=strategy, **kwargs), model


def _save(rank: int, kind: str, world_size: int, tmp: str) -> None:
    seed()
    trainer, model = _trainer(kind, world_size, max_steps=6)  # 3 batches, two optimizer steps each
    trainer.fit(model, datamodule=RandomDataModule())
    trainer.save_checkpoint(os.path.join(tmp, _name(kind, world_size)))
    save_result(tmp, _name(kind, world_size), rank, {k: v for k, v in snapshot(trainer).items() if k in KEYS})


def _load(rank: int, kind: str, world_size: int, source: str, tmp: str) -> str | None:
    """Restore ``source`` into this configuration; the first difference from its saved state, or None."""
    expected = load_result(tmp, source, 0)
    try:
        seed()
        trainer, model = _trainer(kind, world_size, max_steps=expected["global_step"])
        trainer.fit(model, datamodule=RandomDataModule(), ckpt_path=os.path.join(tmp, source))
        assert not model.losses, "the restored run trained: the restore did not reach max_steps"
        got = snapshot(trainer)
        for key in KEYS:
            assert_same(expected[key], got[key], key)
    except Exception:  # reported per pair by the test
        return traceback.format_exc(limit=-3)
    return None


def _worker(rank: int, world_size: int, tmp: str, ascending: bool) -> None:
    mine = [kind for kind, ws in CONFIGS if ws == world_size]
    if ascending:
        for kind in mine:
            _save(rank, kind, world_size, tmp)
    sources = [_name(k, ws) for k, ws in CONFIGS if (ws <= world_size if ascending else ws > world_size)]
    report = {}
    for kind in mine:
        for source in sources:
            if source != _name(kind, world_size):
                report[f"{source} -> {_name(kind, world_size)}"] = _load(rank, kind, world_size, source, tmp)
    save_result(tmp, f"report{world_size}{'up' if ascending else 'down'}", rank, report)


@pytest.mark.full
def test_reshard_matrix(tmp_path):
    tmp = str(tmp_path)
    for world_size in WORLD_SIZES:
        spawn(_worker, world_size, tmp, True)
    for world_size in reversed(WORLD_SIZES[:-1]):
        spawn(_worker, world_size, tmp, False)
    reports = {}
    for world_size in WORLD_SIZES:
        for direction in ("up", "down") if world_size < 4 else ("up",):
            for rank in range(world_size):
                for pair, error in load_result(tmp, f"report{world_size}{direction}", rank).items():
                    reports[pair] = reports.get(pair) or error  # failed if it failed on any rank
    assert len(reports) == len(CONFIGS) * (len(CONFIGS) - 1)  # 72 ordered pairs
    failures = {pair: error for pair, error in reports.items() if error is not None}
    assert not failures, "\n".join(f"{pair}:\n{error}" for pair, error in sorted(failures.items()))
