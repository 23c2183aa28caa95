"""Restoring an optimizer: exactly what ``optimizer.load_state_dict`` of the saved ``state_dict()`` gives (torch.optim's
semantics, stock Lightning's restore), through lightning_dcp's FQN-keyed save, a DCP round trip and the target built
from what the checkpoint holds; the shortcuts only where nothing can differ."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.state import optimizer_restore
from lightning_dcp.engine.state.module_state import model_state_dict, optimizer_state_dict, parameters_by_fqn
from lightning_dcp.engine.state.optimizer_restore import load_optimizer_state_dict
from lightning_dcp.engine.state.optimizer_target import OptimizerTarget, fill_pending, saved_entries
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import StateDictMismatchError


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2), nn.Linear(6, 3))


def _groups(net: nn.Module) -> list[dict[str, Any]]:
    return [{"params": [*net[0].parameters(), *net[2].parameters()]}, {"params": [*net[4:].parameters()], "lr": 0.02}]


def _train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    """``net[5]`` is never used: its parameters get no gradient and no state."""
    for _ in range(steps):

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = net[:5](torch.randn(5, 4)).square().mean()
            loss.backward()
            return loss

        optimizer.step(closure)


MAKERS = {
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01),
    "lbfgs": lambda g: torch.optim.LBFGS([p for group in g for p in group["params"]], lr=0.1, history_size=3),
    "adafactor": lambda g: torch.optim.Adafactor(g, lr=0.01),
    "asgd": lambda g: torch.optim.ASGD(g, lr=0.01, t0=1),
    "rprop": lambda g: torch.optim.Rprop(g, lr=0.01),
    "sgd_plain": lambda g: torch.optim.SGD(g, lr=0.01),
}


def _round_trip(tmp_path, net: nn.Module, optimizer: torch.optim.Optimizer, fresh_net: nn.Module, fresh):
    """Save ``optimizer`` (FQN-keyed, through DCP), read it into a target made for ``fresh`` from the checkpoint."""
    model_state_dict(net)
    saved = optimizer_state_dict(net, optimizer)
    info = {layout.OPTIMIZER_LISTS: {"0": layout.list_paths(saved)}}
    dcp.save({"optimizer_states": [saved]}, checkpoint_id=str(tmp_path), no_dist=True)
    target = OptimizerTarget.of(parameters_by_fqn(fresh_net), fresh)
    tree = {"optimizer_states": [target]}
    metadata = read_metadata(Location(str(tmp_path)))
    fill_pending(tree, saved_entries(metadata=metadata))  # no paths: as from the record index
    dcp.load(tree, checkpoint_id=str(tmp_path), no_dist=True)
    return layout.join_checkpoint(tree, {layout.INFO_KEY: info}, in_place=True)["optimizer_states"][0]


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_restore_equals_load_state_dict_of_the_saved_state(tmp_path, kind):
    net = _net()
    net[2].bias.requires_grad_(False)  # frozen: in the optimizer, no state
    optimizer = MAKERS[kind](_groups(net))
    _train(net, optimizer)
    expected_from = copy.deepcopy(optimizer.state_dict())

    fresh_net = copy.deepcopy(net)
    fresh_net[0].weight.requires_grad_(False)  # frozen since the save: keeps its saved state (stock does)
    fresh = MAKERS[kind](_groups(fresh_net))
    twin_net = copy.deepcopy(fresh_net)
    twin = MAKERS[kind](_groups(twin_net))
    twin.load_state_dict(copy.deepcopy(expected_from))  # stock Lightning's restore

    loaded = _round_trip(tmp_path, net, optimizer, fresh_net, fresh)
    load_optimizer_state_dict(fresh_net, fresh, loaded)
    _assert_same(fresh.state_dict(), twin.state_dict())
    assert all(p in fresh.state for p in fresh_net[0].parameters()) or kind in ("lbfgs", "sgd_plain")
    assert not any(p in fresh.state for p in fresh_net[5].parameters())  # never stepped: no state
    mine = [p for group in fresh.param_groups for p in group["params"]]
    assert all(a is b for a, b in zip(mine, [p for g in _groups(fresh_net) for p in g["params"]], strict=True))
    # and both go on alike
    for a, b in ((fresh_net, fresh), (twin_net, twin)):
        torch.manual_seed(5)
        _train(a, b, steps=1)
    assert all(torch.equal(p, q) for p, q in zip(fresh_net.parameters(), twin_net.parameters(), strict=True))


def test_lists_in_a_state_come_back_as_lists(tmp_path):
    net = _net()
    optimizer = MAKERS["lbfgs"](_groups(net))
    _train(net, optimizer, steps=4)
    saved = optimizer_state_dict(net, optimizer)
    paths = layout.list_paths(saved)
    assert ["state", "0.weight", "old_dirs"] in paths and ["state", "0.weight", "ro"] in paths
    fresh_net = copy.deepcopy(net)
    fresh = MAKERS["lbfgs"](_groups(fresh_net))
    loaded = _round_trip(tmp_path, net, optimizer, fresh_net, fresh)
    assert isinstance(loaded["state"]["0.weight"]["old_dirs"], list)
    assert len(loaded["state"]["0.weight"]["old_dirs"]) == len(optimizer.state[net[0].weight]["old_dirs"])


def test_a_param_group_added_after_the_read_is_restored():
    """The target holds every saved group; the restore runs once a callback re-added the missing one."""
    net = _net()
    optimizer = torch.optim.Adam(net[:3].parameters(), lr=0.01)
    optimizer.add_param_group({"params": list(net[4].parameters()), "lr": 0.5, "betas": (0.5, 0.6)})
    _train(net, optimizer)
    model_state_dict(net)
    saved = copy.deepcopy(optimizer_state_dict(net, optimizer))

    fresh_net = copy.deepcopy(net)
    fresh = torch.optim.Adam(fresh_net[:3].parameters(), lr=0.01)
    with pytest.raises(StateDictMismatchError, match=r"2 param group\(s\).*has 1") as error:
        load_optimizer_state_dict(fresh_net, fresh, copy.deepcopy(saved), where="ckpt")
    assert "BackboneFinetuning" in str(error.value)
    fresh.add_param_group({"params": list(fresh_net[4].parameters()), "lr": 0.1})
    load_optimizer_state_dict(fresh_net, fresh, saved)
    assert fresh.param_groups[1]["lr"] == 0.5 and fresh.param_groups[1]["betas"] == (0.5, 0.6)
    assert torch.equal(fresh.state[fresh_net[4].weight]["exp_avg"], optimizer.state[net[4].weight]["exp_avg"])


def test_another_kind_of_optimizer_is_refused_and_a_related_one_is_not():
    net = _net()
    optimizer = torch.optim.AdamW(_groups(net))
    _train(net, optimizer)
    model_state_dict(net)
    saved, kind = optimizer_state_dict(net, optimizer), optimizer_restore.optimizer_kind(optimizer)
    assert kind[:2] == ["torch.optim.adamw.AdamW", "torch.optim.adam.Adam"]
    sgd = torch.optim.SGD(_groups(net), lr=0.1, momentum=0.9)
    with pytest.raises(StateDictMismatchError, match="saved from a torch.optim.adamw.AdamW, which is not a SGD"):
        load_optimizer_state_dict(net, sgd, copy.deepcopy(saved), where="ckpt", kind=kind)
    assert sgd.state == {} and sgd.param_groups[0]["momentum"] == 0.9  # nothing applied

    class Mine(torch.optim.AdamW):
        pass

    for related in (Mine(_groups(net)), torch.optim.Adam(_groups(net))):  # a subclass, a base: load_state_dict's
        load_optimizer_state_dict(net, related, copy.deepcopy(saved), kind=kind)
        assert torch.equal(related.state[net[0].weight]["exp_avg"], optimizer.state[net[0].weight]["exp_avg"])


def test_own_load_state_dict_and_hooks_are_honoured():
    net = _net()
    optimizer = torch.optim.AdamW(_groups(net))
    _train(net, optimizer)
    model_state_dict(net)
    saved = optimizer_state_dict(net, optimizer)

    calls: list[str] = []
    fresh = torch.optim.AdamW(_groups(net))
    stock = fresh.load_state_dict
    fresh.load_state_dict = lambda state: (calls.append("instance"), stock(state))  # set on the instance
    load_optimizer_state_dict(net, fresh, copy.deepcopy(saved))
    assert calls == ["instance"]

    class Own(torch.optim.AdamW):
        def load_state_dict(self, state_dict: Any) -> None:
            calls.append("subclass")
            super().load_state_dict(state_dict)

    own = Own(_groups(net))
    load_optimizer_state_dict(net, own, copy.deepcopy(saved))
    hooked = torch.optim.AdamW(_groups(net))
    hooked.register_load_state_dict_pre_hook(lambda opt, state: calls.append("pre") or None)
    hooked.register_load_state_dict_post_hook(lambda opt: calls.append("post"))
    load_optimizer_state_dict(net, hooked, copy.deepcopy(saved))
    assert calls == ["instance", "subclass", "pre", "post"]


def test_shortcuts_give_load_state_dicts_result_and_step_aside_where_it_would_cast():
    net = _net()
    optimizer = torch.optim.AdamW(_groups(net))
    _train(net, optimizer)
    model_state_dict(net)
    saved = optimizer_state_dict(net, optimizer)
    split = {"state": saved["state"], "param_groups": saved["param_groups"]}
    assert optimizer_restore._holds_optimizer_tensors(optimizer, split)  # a restore in place: the very tensors
    mine = {k: dict(v) for k, v in saved["state"].items()}
    load_optimizer_state_dict(net, optimizer, {"state": mine, "param_groups": copy.deepcopy(saved["param_groups"])})
    assert optimizer.state[net[0].weight]["exp_avg"] is saved["state"]["0.weight"]["exp_avg"]

    fresh = torch.optim.AdamW(_groups(net))
    copied = copy.deepcopy(saved)
    assert optimizer_restore._uncast_state(fresh, copied) is not None  # installed without casts
    copied["state"]["0.weight"]["exp_avg"] = copied["state"]["0.weight"]["exp_avg"].double()
    assert optimizer_restore._uncast_state(fresh, copied) is None  # load_state_dict casts it
    load_optimizer_state_dict(net, fresh, copied)
    assert fresh.state[net[0].weight]["exp_avg"].dtype == torch.float32
    capturable = torch.optim.AdamW(_groups(net), capturable=True)
    assert optimizer_restore._uncast_state(capturable, copy.deepcopy(saved)) is None
    load_optimizer_state_dict(net, capturable, copy.deepcopy(saved))
    assert capturable.state[net[0].weight]["step"].dtype == torch.float32


def test_set_backed_members_answer_in_as_the_list_does():
    members = optimizer_restore._Members(["a.weight", "b.bias"])
    assert "a.weight" in members and "c" not in members and [] not in members
    assert members == ["a.weight", "b.bias"] and "b.bias" in copy.deepcopy(members)


def test_targets_are_filled_from_ids_chunked_records_and_the_optimizers_own_tensors():
    from lightning_dcp.engine.format.record_index import IndexedRecord

    net = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 3))
    optimizer = torch.optim.Adam(net.parameters())
    optimizer.state[net[1].bias]["exp_avg"] = mine = torch.zeros(3)
    chunks = tuple(IndexedRecord("f", 0, 1, 0, torch.float32, (2, 2), (row, 0)) for row in (0, 2))
    records = {
        "opt.state.0.exp_avg": chunks,  # saved keyed by parameter id, in row chunks
        "opt.state.0.step": IndexedRecord("f", 0, 1, 0, torch.float32, ()),
        "opt.state.1.bias.exp_avg": IndexedRecord("f", 0, 1, 0, torch.float32, (3,)),  # the optimizer's own
        "opt.state.1.bias.extra": IndexedRecord("f", 0, 1, 0, None, None),  # a bytes entry
        "opt.param_groups.0.lr": IndexedRecord("f", 0, 1, 0, None, None),
        "opt.param_groups.1.params": IndexedRecord("f", 0, 1, 0, None, None),
    }
    target = OptimizerTarget.of(parameters_by_fqn(net), optimizer)
    tree = {"opt": target}
    fill_pending(tree, saved_entries(records=records))
    state = target["state"]
    assert state["0"]["exp_avg"].shape == (4, 2) and state["0"]["step"].shape == ()
    assert state["1.bias"]["exp_avg"] is mine and state["1.bias"]["extra"] == b""
    assert target["param_groups"] == [{"lr": b""}, {"params": b""}] and target.filled


def test_state_tensors_are_allocated_contiguous_of_the_saved_dtype_each_its_own_and_never_requiring_grad():
    from lightning_dcp.engine.format.record_index import IndexedRecord

    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(net.parameters())
    record = lambda dtype, shape: IndexedRecord("f", 0, 1, 0, dtype, shape)  # noqa: E731
    records = {}
    for fqn, param in net.named_parameters():
        records[f"opt.state.{fqn}.exp_avg"] = record(torch.float32, tuple(param.shape))
        records[f"opt.state.{fqn}.exp_avg_sq"] = record(torch.bfloat16, tuple(param.shape))  # another dtype
        records[f"opt.state.{fqn}.step"] = record(torch.float32, ())
    records["opt.state.0.weight.max_exp_avg_sq"] = record(torch.float64, (7,))  # not the parameter's shape
    target = OptimizerTarget.of(parameters_by_fqn(net), optimizer)
    fill_pending({"opt": target}, saved_entries(records=records))

    state = target["state"]
    assert sorted(state) == sorted(name for name, _ in net.named_parameters())
    made = [t for values in state.values() for t in values.values()]
    assert len({t.data_ptr() for t in made if t.numel()}) == sum(1 for t in made if t.numel())  # no shared memory
    assert len({id(t) for t in made}) == len(made)
    for name, param in net.named_parameters():
        assert state[name]["exp_avg"].dtype == torch.float32 and state[name]["exp_avg_sq"].dtype == torch.bfloat16
        assert state[name]["step"].shape == () and state[name]["step"].dtype == torch.float32
        for tensor in (state[name]["exp_avg"], state[name]["exp_avg_sq"]):
            assert tensor.shape == param.shape and tensor.is_contiguous() and type(tensor) is torch.Tensor
            assert not tensor.requires_grad and tensor.device == param.device
    other = state["0.weight"]["max_exp_avg_sq"]
    assert other.shape == (7,) and other.dtype == torch.float64
    assert not net[0].weight.is_contiguous()  # channels_last: the parameter's own layout is not the target's


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for key in a:
            _assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)
