"""``planning.flatten`` gives DCP's flat keys and paths, in DCP's order."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from lightning_dcp.engine.format.keys import flatten


def test_flatten_equals_dcps_flatten_state_dict():
    state = {
        "state_dict": OrderedDict(
            [("a.weight", torch.ones(2)), ("a.bias", torch.nn.Parameter(torch.zeros(1))), ("n", torch.tensor(3))]
        ),
        "optimizer_states": [
            {
                "state": {"a.weight": {"exp_avg": torch.ones(2), "step": torch.tensor(1.0)}, 7: {"m": 1.5}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a.weight", "a.bias"]}],
            }
        ],
        "lightning": b"blob",
        "nested": {"list": [torch.zeros(1), {"x": torch.ones(1)}, [1, 2]], "empty": {}, "none": None},
    }
    flat, mappings = flatten(state)
    reference, reference_mappings = flatten_state_dict(state)
    assert list(flat) == list(reference)
    assert all(flat[k] is reference[k] for k in reference)
    assert mappings == reference_mappings


def test_flatten_refuses_two_paths_to_one_key():
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)})
