"""ElasticResume's pieces in one process: the sampler's order and skipping, the accumulation rule, its state."""

from __future__ import annotations

import io
import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from lightning_dcp import ElasticResume
from lightning_dcp.trainer.global_order import GlobalOrderSampler, accumulation_for
from lightning_dcp.trainer.global_order import global_order_sampler as _global_order_sampler


def _sampler(n: int, world_size: int, rank: int, **kwargs) -> GlobalOrderSampler:
    return GlobalOrderSampler(n, num_replicas=world_size, rank=rank, **kwargs)


@pytest.mark.parametrize(("n", "world_size"), [(64, 1), (64, 4), (10, 3), (7, 4)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_order_equals_distributed_sampler(n, world_size, drop_last):
    for rank, shuffle, epoch in itertools.product(range(world_size), (True, False), (0, 3)):
        ours = _sampler(n, world_size, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last
        )
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize(("saved", "resumed", "steps"), [(2, 1, 3), (2, 4, 1), (4, 2, 2), (3, 3, 2)])
def test_skip_continues_the_global_order(saved, resumed, steps):
    """Samples consumed at ``saved`` ranks + the rest drawn at ``resumed`` ranks = the epoch, each once."""
    n, batch = 48, 2
    consumed = steps * saved * batch
    before = [list(_sampler(n, saved, r, shuffle=True, seed=7, epoch=5))[: consumed // saved] for r in range(saved)]
    after = []
    for rank in range(resumed):
        sampler = _sampler(n, resumed, rank, shuffle=True, seed=7)
        sampler.skip(epoch=5, samples=consumed)
        sampler.set_epoch(5)
        assert len(sampler) == n // resumed  # the full epoch's length: what Lightning counts batches against
        after.append(list(sampler))
        sampler.set_epoch(6)  # other epochs are not skipped
        assert len(list(sampler)) == n // resumed
    seen = sorted(i for part in before + after for i in part)
    assert seen == list(range(n))
    # The first global batch after the resume is the next chunk of the epoch's global order.
    order = _sampler(n, 1, 0, shuffle=True, seed=7).global_order(5)
    first_after = sorted(i for part in after for i in part[:batch])
    assert first_after == sorted(order[consumed : consumed + resumed * batch])


def test_accumulation_for():
    assert accumulation_for(16, world_size=1, batch_size=4) == 4
    assert accumulation_for(16, world_size=4, batch_size=4) == 1
    with pytest.raises(ValueError, match=r"global batch size of 8 samples on 3 ranks.*Resume on 1, 2 or 4 rank"):
        accumulation_for(8, world_size=3, batch_size=2)
    with pytest.raises(ValueError, match=r"not a multiple of 12\. Change the per-device batch size"):
        accumulation_for(16, world_size=4, batch_size=3)


def test_which_samplers_are_replaced(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    data = range(10)
    random = _global_order_sampler(RandomSampler(data), world_size=1, epoch=2)
    assert random.shuffle and random.seed == 11 and random.epoch == 2
    assert not _global_order_sampler(SequentialSampler(data), world_size=1, epoch=0).shuffle
    assert _global_order_sampler(RandomSampler(data, generator=torch.Generator()), world_size=1, epoch=0) is None
    assert _global_order_sampler(RandomSampler(data), world_size=2, epoch=0) is None  # use_distributed_sampler=False
    assert _global_order_sampler(RandomSampler(data, replacement=True), world_size=1, epoch=0) is None
    distributed = DistributedSampler(data, num_replicas=3, rank=1, seed=5, drop_last=True)
    ours = _global_order_sampler(distributed, world_size=3, epoch=4)
    distributed.set_epoch(4)
    assert list(ours) == list(distributed)


def test_state_is_weights_only_safe():
    buffer = io.BytesIO()
    torch.save(ElasticResume().state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["world_size"] == 1 and state["samples_total"] == 0 and state["version"] == 1
