"""Stateful data loaders: which ones reshard themselves, the refusal message, and the hooks on Lightning's state."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from lightning_dcp._compat.lightning_run import (
    fit_loop_loader_states,
    on_iterator_created,
    replace_fit_loop_loader_states,
)
from lightning_dcp.engine.state.loaders import is_stateful_loader, refuse, reshards_itself
from lightning_dcp.errors import CheckpointError
from lightning_dcp.trainer.global_order import global_order_sampler, is_distributed_sampler
from tests._models import IndexedDataset

stateful = pytest.importorskip("torchdata.stateful_dataloader")
stateful_sampler = pytest.importorskip("torchdata.stateful_dataloader.sampler")


def test_kinds_of_loader():
    plain = DataLoader(IndexedDataset(8), batch_size=2)
    resumable = stateful.StatefulDataLoader(IndexedDataset(8), batch_size=2)
    assert not is_stateful_loader(plain) and is_stateful_loader(resumable)
    assert not is_stateful_loader(object()) and not reshards_itself(resumable) and not reshards_itself(plain)


def test_refusal_names_the_saved_world_size_and_the_options():
    err = refuse(["'loader'"], saved_world_size=2, world_size=3, path="ckpt/step-6", hint="Or else.")
    assert isinstance(err, CheckpointError)
    message = str(err)
    for part in (
        "'ckpt/step-6'",
        "world size 2",
        "At world size 3",
        "Resume at world size 2",
        "DistributedSampler",
        "StreamingDataLoader",
        "Or else.",
    ):
        assert part in message


def test_loader_states_in_the_fit_loop_state_are_replaced_or_removed():
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"rank": 0}]}}}}
    assert fit_loop_loader_states(checkpoint) == [{"rank": 0}]
    replace_fit_loop_loader_states(checkpoint, [{"rank": 1}])
    assert fit_loop_loader_states(checkpoint) == [{"rank": 1}]
    replace_fit_loop_loader_states(checkpoint, None)
    assert fit_loop_loader_states(checkpoint) is None and checkpoint["loops"]["fit_loop"]["state_dict"] == {}
    assert fit_loop_loader_states({}) is None


def test_iterator_creation_is_reported_once_after_the_seed_draw():
    loader = DataLoader(IndexedDataset(8), batch_size=2)
    calls = []
    undo = on_iterator_created(loader, lambda: calls.append(torch.get_rng_state()))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(loader)
    assert len(calls) == 1 and not torch.equal(calls[0], before)  # after the base seed was drawn
    iter(loader)
    assert len(calls) == 1 and "_get_iterator" not in loader.__dict__
    undo()  # harmless once fired
    undo = on_iterator_created(loader, lambda: calls.append(None))
    undo()
    iter(loader)
    assert len(calls) == 1


def test_torchdata_samplers_map_onto_the_global_order():
    dataset = IndexedDataset(10)
    sampler = stateful_sampler.StatefulDistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    assert is_distributed_sampler(sampler)
    order = global_order_sampler(sampler, world_size=2, epoch=0)
    assert list(order) == list(DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3))
    # StatefulDataLoader swaps in its own RandomSampler (always with a generator): on one device, shuffled order
    loader = stateful.StatefulDataLoader(dataset, batch_size=2, shuffle=True)
    assert global_order_sampler(loader.sampler, world_size=1, epoch=0).shuffle
    assert global_order_sampler(SequentialSampler(dataset), world_size=2, epoch=0) is None
