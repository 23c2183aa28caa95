"""Stateful data loaders resumed mid-epoch through the Trainer (``dcp_ddp``) and Fabric: per rank, other world sizes.

Loaders: torchdata's StatefulDataLoader (Lightning's DistributedSampler, 0 and 2 workers), LitData's
StreamingDataLoader over a dataset made by ``litdata.optimize``, and a user's own stateful iterable. 48 samples,
global batch 12 (2 ranks x 6): 4 steps per epoch, 2 epochs. The uninterrupted run saves at step 6 (half-way through
epoch 1) and runs on; that checkpoint is resumed at 2 ranks (must be bit-identical to the rest of the run, rank by
rank), at 1 rank (6 x accumulate 2) and at 3 ranks (4 x accumulate 1): every step must see 12 samples and every
epoch each of the 48 exactly once. Fabric (``DCPDDPStrategy``, one epoch, saved after step 2 of 4) does the same with
the loader in ``fabric.save``'s state: bit-identical at 2 ranks, LitData exactly once at 1 and 3 ranks, the
StatefulDataLoader refused there. Three spawns (2, 1 and 3 ranks), several runs each.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint

from harness.ranks import spawn
from lightning_dcp import ElasticResume
from lightning_dcp.errors import CheckpointError
from lightning_dcp.fabric import DCPDDPStrategy
from tests._loaders import SAMPLES, LoaderDataModule, make_litdata, make_loader, samples_by
from tests._models import IdLoggingModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot

pytest.importorskip("torchdata.stateful_dataloader")
pytest.importorskip("litdata")

EPOCHS, STEPS, GLOBAL_BATCH = 2, 8, 12
BATCH = {1: 6, 2: 6, 3: 4}  # per device: 1 rank needs accumulate 2, 3 ranks accumulate 1
KINDS = ("sdl0", "sdl2", "litdata")
CKPT = "epoch=1-step=6.ckpt"


def _fit(tmp: str, kind: str, world_size: int, name: str, *, resume: bool, elastic: bool = True) -> None:
    seed(7 + int(os.environ["RANK"]))  # per-rank random streams (worker base seeds, noise): per-rank states differ
    model = IdLoggingModel()
    callbacks = [ElasticResume(verbose=False)] if elastic else []
    if not resume:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(tmp, kind), every_n_train_steps=6, save_top_k=-1))
    trainer = make_trainer(world_size, max_epochs=EPOCHS, callbacks=callbacks)
    data = LoaderDataModule(kind, batch_size=BATCH[world_size], data=os.path.join(tmp, "optimized"))
    trainer.fit(model, datamodule=data, ckpt_path=os.path.join(tmp, kind, CKPT) if resume else None)
    result = snapshot(trainer)
    result.update(ids=model.seen_ids, accumulate=trainer.accumulate_grad_batches)
    save_result(tmp, f"{name}-{kind}", trainer.global_rank, result)


def _fabric(tmp: str, kind: str, world_size: int, name: str, *, resume: bool) -> None:
    """One epoch by hand; the uninterrupted run saves {model, optimizer, loader} after step 2 and runs on."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=DCPDDPStrategy())
    fabric.launch()
    fabric.seed_everything(7 + fabric.global_rank, verbose=False)
    model = fabric.setup_module(torch.nn.Linear(8, 2))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    # generator=: the loader's iterator, created after `fabric.load`, draws its base seed from it, not from the global
    # generator that fabric.load restored (the uninterrupted run drew that seed before the save; docs/resume.md)
    data = os.path.join(tmp, "optimized")
    loader = fabric.setup_dataloaders(
        make_loader(kind, batch_size=GLOBAL_BATCH // world_size, data=data, generator=torch.Generator()),
        use_distributed_sampler=False,  # the StatefulDataLoader has its DistributedSampler; LitData shards itself
    )
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    path, step, ids = os.path.join(tmp, f"fabric-{kind}"), 0, []
    if resume:
        step = fabric.load(path, state)["step"]
    for x, y, index in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step, ids = step + 1, [*ids, (0, step, index.tolist())]
        if step == 2 and not resume:
            fabric.save(path, {**state, "step": step})
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_result(tmp, f"fabric-{name}-{kind}", fabric.global_rank, {"ids": ids, "params": params, "step": step})


def _two_ranks(rank: int, world_size: int, tmp: str) -> None:
    for kind in KINDS:
        _fabric(tmp, kind, world_size, "full", resume=False)
        _fabric(tmp, kind, world_size, "resumed2", resume=True)
    for kind in (*KINDS, "own"):
        _fit(tmp, kind, world_size, "full", resume=False)
        _fit(tmp, kind, world_size, "resumed2", resume=True)
    _fit(tmp, "sdl2", world_size, "plain2", resume=True, elastic=False)  # per-rank states need no callback


def _other_ranks(rank: int, world_size: int, tmp: str) -> None:
    for kind in KINDS:
        _fit(tmp, kind, world_size, f"resumed{world_size}", resume=True)
    _fabric(tmp, "litdata", world_size, f"resumed{world_size}", resume=True)
    with pytest.raises(CheckpointError, match=r"Or leave these keys out of the state given to `fabric.load`"):
        _fabric(tmp, "sdl0", world_size, "refused", resume=True)
    if world_size == 1:
        # A loader nobody can reshard: refused, with or without ElasticResume, naming the saved world size.
        for elastic in (True, False):
            with pytest.raises(CheckpointError, match=r"Resume at world size 2 \(every rank gets its own"):
                _fit(tmp, "own", world_size, "refused", resume=True, elastic=elastic)
        # Without ElasticResume a resharded StatefulDataLoader position is refused too (the message names the fix).
        with pytest.raises(CheckpointError, match=r"^Add `lightning_dcp.ElasticResume\(\)` to the Trainer"):
            _fit(tmp, "sdl0", world_size, "refused", resume=True, elastic=False)


def test_stateful_loaders_resume_mid_epoch(tmp_path):
    tmp = str(tmp_path)
    make_litdata(tmp)
    spawn(_two_ranks, 2, tmp)
    spawn(_other_ranks, 1, tmp)
    spawn(_other_ranks, 3, tmp)

    def results(name: str, kind: str, world_size: int) -> list[dict]:
        return [load_result(tmp, f"{name}-{kind}", r) for r in range(world_size)]

    for kind in (*KINDS, "own"):
        full = results("full", kind, 2)
        full_steps = samples_by(full, 1)
        assert sorted(full_steps) == list(range(STEPS)), kind
        assert all(sum(c.values()) == GLOBAL_BATCH for c in full_steps.values()), kind
        assert all(c == Counter(range(SAMPLES)) for c in samples_by(full, 0).values()), kind
        first = [{"ids": [e for e in r["ids"] if e[1] < 6]} for r in full]
        # Same world size: every rank's batches and the final state are those of the uninterrupted run, bit for bit.
        for name in ("resumed2", "plain2") if kind == "sdl2" else ("resumed2",):
            for rank, resumed in enumerate(results(name, kind, 2)):
                assert first[rank]["ids"] + resumed["ids"] == full[rank]["ids"], (kind, name, rank)
                assert len(resumed["ids"]) == 2, (kind, name)  # resumed half-way through epoch 1
                for key in ("params", "optimizers", "global_step", "epoch"):
                    assert_same(full[rank][key], resumed[key], f"{kind}.{name}.{key}")
        if kind == "own":
            continue
        # Other world sizes: each step still sees 12 samples, each epoch every sample exactly once.
        for world_size, accumulate in ((1, 2), (3, 1)):
            resumed = results(f"resumed{world_size}", kind, world_size)
            assert all(r["accumulate"] == accumulate for r in resumed), kind
            steps = samples_by(first + resumed, 1)
            assert sorted(steps) == list(range(STEPS)), (kind, world_size)
            assert all(sum(c.values()) == GLOBAL_BATCH for c in steps.values()), (kind, world_size)
            assert all(c == Counter(range(SAMPLES)) for c in samples_by(first + resumed, 0).values()), (
                kind,
                world_size,
            )
            assert steps == full_steps, (kind, world_size)  # a world-size-independent order: same samples per step
            assert all(r["global_step"] == STEPS for r in resumed), (kind, world_size)

    # Fabric: the loader in the saved state; 4 steps of 12 samples, saved after step 2.
    for kind in KINDS:
        full = results("fabric-full", kind, 2)
        assert all(c == Counter(range(SAMPLES)) for c in samples_by(full, 0).values()), kind
        for rank, resumed in enumerate(results("fabric-resumed2", kind, 2)):
            assert full[rank]["ids"][:2] + resumed["ids"] == full[rank]["ids"], (kind, rank)
            assert resumed["step"] == 4, kind
            assert_same(full[rank]["params"], resumed["params"], f"fabric.{kind}")
    first = [{"ids": r["ids"][:2]} for r in results("fabric-full", "litdata", 2)]
    for world_size in (1, 3):
        resumed = results(f"fabric-resumed{world_size}", "litdata", world_size)
        steps = samples_by(first + resumed, 1)
        assert sorted(steps) == list(range(4)) and all(sum(c.values()) == GLOBAL_BATCH for c in steps.values())
        assert samples_by(first + resumed, 0)[0] == Counter(range(SAMPLES)), world_size
