"""Applying a restored state: lightning_dcp's shortcuts give what DCP's ``set_*_state_dict`` give, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from lightning_dcp.engine.state import module_state
from lightning_dcp.engine.state.module_state import (
    load_model_state_dict,
    load_optimizer_state_dict,
    model_state_dict,
    optimizer_state_dict,
)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1), nn.InstanceNorm2d(2))


def _trained(net: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(
        [{"params": list(net[0].parameters())}, {"params": list(net[1:].parameters()), "lr": 0.5}]
    )
    net(torch.randn(2, 3, 6, 6)).sum().backward()
    optimizer.step()
    return optimizer


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


def test_optimizer_state_applied_as_dcps_set_optimizer_state_dict_applies_it():
    net = _net()
    net[2].bias.requires_grad_(False)  # DCP drops the state of parameters that need no grad
    optimizer = _trained(net)
    model_state_dict(net)  # what a restore's target is built from first
    twin_net = copy.deepcopy(net)
    twin = torch.optim.AdamW(
        [{"params": list(twin_net[0].parameters())}, {"params": list(twin_net[1:].parameters()), "lr": 0.5}]
    )
    twin.load_state_dict(optimizer.state_dict())
    saved = copy.deepcopy(optimizer_state_dict(net, optimizer))
    for values in saved["state"].values():
        values["exp_avg"].mul_(7)
    saved["param_groups"][1]["lr"] = 0.125
    saved["state"]["2.bias"] = copy.deepcopy(saved["state"]["2.weight"])

    assert module_state._split_by_fqn(net, optimizer, saved) is not None  # the shortcut applies
    load_optimizer_state_dict(net, optimizer, copy.deepcopy(saved))
    set_optimizer_state_dict(twin_net, twin, copy.deepcopy(saved), options=StateDictOptions())
    _assert_same(optimizer.state_dict(), twin.state_dict())
    assert optimizer.param_groups[1]["lr"] == 0.125 and optimizer.param_groups[1]["params"][0] is net[1].weight

    missing = copy.deepcopy(saved)
    del missing["state"]["0.weight"]
    assert module_state._split_by_fqn(net, optimizer, missing) is None
    with pytest.raises(RuntimeError, match="0.weight"):  # DCP's error for it
        load_optimizer_state_dict(net, optimizer, missing)


def test_optimizer_state_restored_in_place_only_sets_the_groups_as_load_state_dict_would():
    net = _net()
    optimizer = _trained(net)
    model_state_dict(net)
    twin_net = copy.deepcopy(net)
    twin = torch.optim.AdamW(
        [{"params": list(twin_net[0].parameters())}, {"params": list(twin_net[1:].parameters()), "lr": 0.5}]
    )
    twin.load_state_dict(optimizer.state_dict())
    target = optimizer_state_dict(net, optimizer)  # the optimizer's own tensors: a restore fills them in place
    for values in target["state"].values():
        values["exp_avg"].mul_(3)
    target["param_groups"][0]["lr"] = 0.25
    saved = copy.deepcopy(target)
    split = module_state._split_by_fqn(net, optimizer, target)
    assert split is not None and module_state._holds_optimizer_tensors(optimizer, split)  # the shortcut applies
    load_optimizer_state_dict(net, optimizer, target)
    set_optimizer_state_dict(twin_net, twin, saved, options=StateDictOptions())
    _assert_same(optimizer.state_dict(), twin.state_dict())
    assert optimizer.param_groups[0]["lr"] == 0.25 and optimizer.param_groups[0]["params"][0] is net[0].weight
    assert optimizer.param_groups[0] is not target["param_groups"][0]  # copied, as load_state_dict copies
    # A tensor that is not the optimizer's own, or a load hook, takes load_state_dict itself.
    other = copy.deepcopy(optimizer_state_dict(net, optimizer))  # equal values in other tensors
    assert not module_state._holds_optimizer_tensors(optimizer, module_state._split_by_fqn(net, optimizer, other))
    optimizer.register_load_state_dict_pre_hook(lambda opt, sd: None)
    mine = optimizer_state_dict(net, optimizer)
    assert not module_state._holds_optimizer_tensors(optimizer, module_state._split_by_fqn(net, optimizer, mine))


def test_set_backed_members_answer_in_as_the_list_does():
    members = module_state._Members(["a.weight", "b.bias"])
    assert "a.weight" in members and "c" not in members and [] not in members
    assert members == ["a.weight", "b.bias"] and "b.bias" in copy.deepcopy(members)


def test_full_state_dicts_still_go_through_dcp():
    net = _net()
    full = {k: v.clone() + 2 for k, v in net.state_dict().items()}
    set_model_state_dict(net, full, options=StateDictOptions(full_state_dict=True))
    _assert_same(net.state_dict(), full)


def test_an_optimizer_without_state_is_not_stepped_and_its_target_is_built_from_what_was_saved(tmp_path):
    """A fresh optimizer's target: no step (DCP would run one), then the saved state tensors, as recorded."""
    import torch.distributed.checkpoint as dcp

    from lightning_dcp.engine.catalog.metadata import read_metadata
    from lightning_dcp.engine.state.optimizer_target import PendingState, fill_pending, saved_entries
    from lightning_dcp.engine.storage.location import Location

    net = _net()
    trained = _trained(net)
    saved = copy.deepcopy(trained.state_dict())
    model_state_dict(net)
    dcp.save({"optimizer_states": [optimizer_state_dict(net, trained)]}, checkpoint_id=str(tmp_path), no_dist=True)

    fresh_net = copy.deepcopy(net)
    fresh = torch.optim.AdamW(
        [{"params": list(fresh_net[0].parameters())}, {"params": list(fresh_net[1:].parameters()), "lr": 0.5}]
    )
    model_state_dict(fresh_net)
    target = optimizer_state_dict(fresh_net, fresh)
    assert fresh.state == {} and all(p.grad is None for p in fresh_net.parameters())  # nothing stepped
    assert isinstance(target["state"], PendingState) and target["state"] == {}
    assert copy.deepcopy(target["state"]).__class__ is dict  # a save hands it on as optimizer.state_dict()'s {}
    tree = {"optimizer_states": [target]}
    fill_pending(tree, saved_entries(metadata=read_metadata(Location(str(tmp_path)))))
    assert sorted(target["state"]["0.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert target["state"]["0.weight"]["exp_avg"].shape == net[0].weight.shape
    dcp.load(tree, checkpoint_id=str(tmp_path), no_dist=True)
    restored = {fqn: dict(values) for fqn, values in target["state"].items()}
    split = module_state._split_by_fqn(fresh_net, fresh, target)
    assert split is not None and module_state._uncast_state(fresh, split) is not None  # installed without casts
    load_optimizer_state_dict(fresh_net, fresh, target)
    _assert_same(fresh.state_dict(), saved)  # what stock Lightning's load_state_dict of the saved dict gives
    assert fresh.state[fresh_net[0].weight]["exp_avg"] is restored["0.weight"]["exp_avg"]  # the restored tensor


def test_a_fresh_optimizers_state_takes_load_state_dict_where_it_would_cast():
    """A state tensor of another dtype than its parameter, or a fused/capturable group: load_state_dict's own casts."""
    net = _net()
    trained = _trained(net)
    model_state_dict(net)
    saved = copy.deepcopy(optimizer_state_dict(net, trained))
    saved["state"]["0.weight"]["exp_avg"] = saved["state"]["0.weight"]["exp_avg"].double()

    def fresh(**options: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        fresh_net = copy.deepcopy(net)
        groups = [{"params": list(fresh_net[0].parameters())}, {"params": list(fresh_net[1:].parameters()), "lr": 0.5}]
        optimizer = torch.optim.AdamW(groups, **options)
        model_state_dict(fresh_net)  # the targets a restore builds first: they map the FQNs
        optimizer_state_dict(fresh_net, optimizer)
        return fresh_net, optimizer

    fresh_net, optimizer = fresh()
    split = module_state._split_by_fqn(fresh_net, optimizer, saved)
    assert split is not None and module_state._uncast_state(optimizer, split) is None
    load_optimizer_state_dict(fresh_net, optimizer, copy.deepcopy(saved))
    assert optimizer.state[fresh_net[0].weight]["exp_avg"].dtype == torch.float32  # cast to the parameter's dtype
    assert torch.equal(optimizer.state[fresh_net[0].weight]["exp_avg"], trained.state[net[0].weight]["exp_avg"])

    saved["state"]["0.weight"]["exp_avg"] = saved["state"]["0.weight"]["exp_avg"].float()
    fresh_net, optimizer = fresh()
    assert module_state._uncast_state(optimizer, module_state._split_by_fqn(fresh_net, optimizer, saved)) is not None
    fresh_net, optimizer = fresh(capturable=True)
    assert module_state._uncast_state(optimizer, module_state._split_by_fqn(fresh_net, optimizer, saved)) is None
    load_optimizer_state_dict(fresh_net, optimizer, copy.deepcopy(saved))
    assert optimizer.state[fresh_net[0].weight]["step"].dtype == torch.float32  # capturable: step cast


def test_pending_state_is_filled_from_ids_and_chunked_records():
    from lightning_dcp.engine.format.record_index import IndexedRecord
    from lightning_dcp.engine.state.optimizer_target import PendingState, fill_pending, saved_entries

    a, b = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(3))
    chunks = tuple(IndexedRecord("f", 0, 1, 0, torch.float32, (2, 2), (row, 0)) for row in (0, 2))
    records = {
        "opt.state.0.exp_avg": chunks,  # saved keyed by parameter id, in row chunks
        "opt.state.0.step": IndexedRecord("f", 0, 1, 0, torch.float32, ()),
        "opt.state.1.extra": IndexedRecord("f", 0, 1, 0, None, None),  # a bytes entry
        "opt.state.9.exp_avg": IndexedRecord("f", 0, 1, 0, torch.float32, (3,)),  # no such parameter: left out
    }
    tree = {"opt": {"state": PendingState({"w.a": a, "w.b": b}), "param_groups": []}}
    fill_pending(tree, saved_entries(records=records))
    state = tree["opt"]["state"]
    assert state["w.a"]["exp_avg"].shape == (4, 2) and state["w.a"]["step"].shape == ()
    assert state["w.b"] == {"extra": b""} and len(state) == 2


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
