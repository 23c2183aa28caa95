"""Partial loads for fine-tuning: weights only, excluded keys, strict=False report, clear mismatch errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dcp import DCPCheckpointIO, StateDictMismatchError, consolidate, load_model_weights


class Net(nn.Module):
    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        torch.manual_seed(classes)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, classes)


@pytest.fixture
def pretrained(tmp_path):
    net = Net()
    opt = torch.optim.AdamW(net.parameters())
    path = str(tmp_path / "pre.ckpt")
    DCPCheckpointIO().save_checkpoint(
        {"state_dict": net.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 3}, path
    )
    return net, path


def test_weights_only_with_excluded_head(pretrained):
    net, path = pretrained
    fresh = Net(classes=5)  # a new head with another shape
    head_before = fresh.head.weight.clone()
    report = load_model_weights(fresh, path, exclude=["head.*"])
    for name in ("body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"):
        assert torch.equal(fresh.state_dict()[name], net.state_dict()[name])
    assert torch.equal(fresh.head.weight, head_before)
    assert report.excluded_keys == ["head.bias", "head.weight"]
    assert report.missing_keys == [] and report.unexpected_keys == []
    assert len(report.loaded_keys) == 4


def test_strict_false_reports_missing_and_unexpected(pretrained):
    net, path = pretrained
    other = nn.ModuleDict({"body": Net().body, "extra": nn.Linear(2, 2)})
    report = load_model_weights(other, path, strict=False)
    assert report.missing_keys == ["extra.bias", "extra.weight"]
    assert report.unexpected_keys == ["head.bias", "head.weight"]
    assert torch.equal(other["body"][0].weight, net.body[0].weight)
    with pytest.raises(StateDictMismatchError, match="extra.weight"):
        load_model_weights(nn.ModuleDict({"body": Net().body, "extra": nn.Linear(2, 2)}), path)


def test_shape_mismatch_names_fqn_and_shapes(pretrained):
    _, path = pretrained
    with pytest.raises(StateDictMismatchError, match=r"'head.weight': saved shape \(2, 16\).*expected \(5, 16\)"):
        load_model_weights(Net(classes=5), path, strict=False)


def test_weights_from_a_consolidated_file(pretrained, tmp_path):
    net, path = pretrained
    single = consolidate(path, dst=str(tmp_path / "single.ckpt"))
    fresh = Net(classes=5)
    report = load_model_weights(fresh, single, exclude=["head.*"])
    assert torch.equal(fresh.body[2].weight, net.body[2].weight)
    assert report.excluded_keys == ["head.bias", "head.weight"]
    with pytest.raises(StateDictMismatchError, match="head.weight"):
        load_model_weights(Net(classes=5), single, strict=False)
