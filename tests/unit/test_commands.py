"""``python -m lightning_dcp`` lists the commands; ``verify`` and ``load_checkpoint`` show progress as ``consolidate``
does; ``inspect`` lists names in an evident order (issue 22)."""

from __future__ import annotations

import pytest
import torch

from lightning_dcp import DCPCheckpointIO, inspect_checkpoint, load_checkpoint
from lightning_dcp.__main__ import COMMANDS, main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    layers = {f"layers.{i}.weight": torch.full((64, 64), float(i)) for i in (10, 2, 1, 0)}  # saved out of order
    path = str(tmp_path_factory.mktemp("ckpt") / "a.ckpt")
    extra = {"head.weight": torch.ones(2, 64), "embed.weight": torch.ones(8, 64)}
    state = {"state_dict": {**layers, **extra}, "optimizer_states": [{"state": {}, "param_groups": []}]}
    DCPCheckpointIO().save_checkpoint({**state, "global_step": 5}, path)
    return path


def test_the_package_lists_its_commands_and_runs_them(checkpoint, capsys):
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS) and "usage: python -m lightning_dcp" in listed
    assert main(["verify", checkpoint, "--fast"]) == 0 and "OK:" in capsys.readouterr().out
    assert main(["nonsense"]) == 2 and "unknown command 'nonsense'" in capsys.readouterr().err


def test_verify_and_load_show_progress_over_the_bytes_they_read(checkpoint, capsys):
    assert main(["verify", checkpoint, "--progress"]) == 0
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("a.ckpt: 100%") and "/" in bar
    loaded = load_checkpoint(checkpoint, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("a.ckpt: 100%") and len(loaded["state_dict"]) == 6
    assert main(["verify", checkpoint]) == 0 and capsys.readouterr().err == ""  # no terminal: no bar by default


def test_inspect_lists_weights_first_in_natural_order(checkpoint):
    names = [t["name"] for t in inspect_checkpoint(checkpoint)["tensors"] if t["weight"]]
    assert names == ["embed.weight", "head.weight", *(f"layers.{i}.weight" for i in (0, 1, 2, 10))]
