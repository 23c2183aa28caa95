"""The checkpoint layout's parts that keep torch.optim's structures: lists in optimizer state, values from rank 0."""

from __future__ import annotations

import torch

from lightning_dcp.engine.format import layout


def test_list_paths_and_restore_lists_give_lists_back():
    state = {
        "state": {
            "a.weight": {
                "step": torch.zeros(()),
                "old_dirs": [torch.ones(2), torch.ones(2)],
                "al": [None, torch.ones(())],
            },
            "a.bias": {"history": [1, 2], "nested": {"deep": [torch.zeros(1)]}},
        },
        "param_groups": [{"params": ["a.weight", "a.bias"], "lr": 0.1}],
    }
    paths = layout.list_paths(state)
    assert sorted(paths) == [
        ["state", "a.bias", "nested", "deep"],
        ["state", "a.weight", "al"],
        ["state", "a.weight", "old_dirs"],
    ]
    loaded = {  # as a read through the record index (no paths) gives it: lists as dicts keyed by index
        "state": {
            "a.weight": {"old_dirs": {"1": "y", "0": "x"}, "al": {"0": b"", "1": "z"}},
            "a.bias": {"history": [1, 2], "nested": {"deep": {"0": "d"}}},
        },
        "param_groups": [],
    }
    layout.restore_lists(loaded, paths)
    assert loaded["state"]["a.weight"] == {"old_dirs": ["x", "y"], "al": [b"", "z"]}
    assert loaded["state"]["a.bias"]["nested"]["deep"] == ["d"] and loaded["state"]["a.bias"]["history"] == [1, 2]
    layout.restore_lists(loaded, paths)  # lists already: left as they are
    assert loaded["state"]["a.weight"]["old_dirs"] == ["x", "y"]


def test_values_from_rank0_are_left_out_of_the_other_ranks_parts_without_changing_the_tree():
    from torch.distributed.tensor import DTensor

    buffer, weight = torch.zeros(3), torch.ones(3)
    tree = {
        layout.MODEL_KEY: {"bn.running_mean": buffer, "w": weight},
        layout.OPTIMIZER_KEY: [{"state": {"w": {"exp_avg": weight}}, "param_groups": [{"lr": 0.1}]}],
        "ema": {"w": weight},
    }
    paths = [(layout.MODEL_KEY, "bn.running_mean"), (layout.OPTIMIZER_KEY, 0, "state", "w"), ("ema",)]
    kept = layout.build_state(tree, objects={"x": 1}, info={}, rank=0, from_rank0=paths)
    assert kept[layout.MODEL_KEY] is tree[layout.MODEL_KEY] and "ema" in kept  # rank 0 writes them
    other = layout.build_state(tree, objects=None, info={}, rank=1, from_rank0=paths)
    assert other[layout.MODEL_KEY] == {"w": weight} and "ema" not in other
    assert other[layout.OPTIMIZER_KEY][0]["state"] == {} and other[layout.OPTIMIZER_KEY][0]["param_groups"]
    assert tree[layout.MODEL_KEY]["bn.running_mean"] is buffer and tree[layout.OPTIMIZER_KEY][0]["state"]["w"]
    assert "ema" in tree  # the caller's tree is not changed

    class Sharded(DTensor):  # a DTensor's type only: each rank's own shard is kept everywhere
        pass

    shard = torch.Tensor._make_subclass(Sharded, torch.zeros(2))
    both = layout.build_state({"m": {"s": shard}}, objects=None, info={}, rank=1, from_rank0=[("m", "s")])
    assert both["m"]["s"] is shard
