"""Model state: lightning_dcp's shortcuts give what DCP's ``get/set_model_state_dict`` give, bit for bit; the
optimizer state a save writes is DCP's ``get_optimizer_state_dict`` without its step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from lightning_dcp.engine.state import module_state
from lightning_dcp.engine.state.module_state import load_model_state_dict, model_state_dict, optimizer_state_dict


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1), nn.InstanceNorm2d(2))


def _assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]) and value.dtype == b[key].dtype, key
        elif isinstance(value, dict):
            _assert_same(value, b[key])
        elif isinstance(value, list):
            assert len(value) == len(b[key])
            for x, y in zip(value, b[key], strict=True):
                _assert_same(x, y) if isinstance(x, dict) else None
                assert isinstance(x, dict) or x == y
        else:
            assert value == b[key], key


def test_a_model_state_filled_in_place_is_not_copied_again_and_anything_else_is_loaded():
    net = _net()
    state = model_state_dict(net)
    for value in state.values():  # a restore writes into the module's own tensors
        value.add_(1)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    assert module_state._holds_module_tensors(net, state)
    load_model_state_dict(net, state, strict=True)
    _assert_same(net.state_dict(), expected)

    fresh = {k: v.clone() * 3 for k, v in state.items()}  # other tensors: DCP's load copies them in
    assert not module_state._holds_module_tensors(net, fresh)
    load_model_state_dict(net, fresh, strict=True)
    _assert_same(net.state_dict(), fresh)

    partial = dict(model_state_dict(net))
    partial.pop("2.weight")
    assert not module_state._holds_module_tensors(net, partial)  # non-strict with a key missing: DCP's path
    load_model_state_dict(net, partial, strict=False)
    with pytest.raises(RuntimeError, match="2.weight"):
        load_model_state_dict(net, partial, strict=True)


def test_load_hooks_and_own_load_methods_keep_dcps_path():
    net = _net()
    calls = []
    handle = net[2].register_load_state_dict_post_hook(lambda module, keys: calls.append(module))
    load_model_state_dict(net, model_state_dict(net), strict=True)
    assert calls == [net[2]]
    handle.remove()

    class Custom(nn.Linear):
        def _load_from_state_dict(self, state_dict, prefix, *args):
            calls.append(prefix)
            super()._load_from_state_dict(state_dict, prefix, *args)

    custom = nn.Sequential(Custom(2, 2))
    load_model_state_dict(custom, model_state_dict(custom), strict=True)
    assert calls[-1] == "0."


def test_full_state_dicts_still_go_through_dcp():
    net = _net()
    full = {k: v.clone() + 2 for k, v in net.state_dict().items()}
    set_model_state_dict(net, full, options=StateDictOptions(full_state_dict=True))
    _assert_same(net.state_dict(), full)


def test_targets_of_a_plain_model_are_dcps_without_dcp():
    """A plain model's target and a fresh optimizer's FQN groups equal DCP's (a tied weight under its first name)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from lightning_dcp.engine.state.optimizer_target import no_init_step

    net = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 5))
    net[3].weight = net[0].weight  # tied
    groups = [{"params": [*net[1].parameters(), *net[2].parameters(), net[3].bias]}, {"params": [net[0].weight]}]
    optimizer = torch.optim.SGD(groups, lr=0.5)
    assert module_state._plain_tree(net)
    mine = model_state_dict(net)
    theirs = get_model_state_dict(net)
    assert list(mine) == list(theirs) and all(module_state._same(mine[k], v) for k, v in theirs.items())
    target = optimizer_state_dict(net, optimizer)
    with no_init_step(optimizer):
        reference = get_optimizer_state_dict(net, optimizer)
    assert target["param_groups"] == reference["param_groups"] and target["state"] == reference["state"] == {}
    assert optimizer.state == {}
    assert not module_state._plain_tree(
        nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    )
