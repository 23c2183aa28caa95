"""Streaming consolidation of real DCP checkpoints into .ckpt and safetensors (no mocks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from lightning_dcp import CheckpointNotFoundError, DCPCheckpointIO, NotACheckpointError, consolidate
from lightning_dcp.consolidate import main
from tests._trainer import assert_same


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    model.register_buffer("count", torch.arange(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def checkpoint(tmp_path):
    """A lightning_dcp checkpoint (param-id optimizer layout) and the dict it was saved from."""
    model, opt = _model_and_optimizer()
    ckpt = {
        "state_dict": model.state_dict(),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [{"last_epoch": 3}],
        "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5)}},
        "epoch": 2,
        "global_step": 7,
        "hyper_parameters": {"hidden": 5},
    }
    path = str(tmp_path / "step=7.ckpt")
    DCPCheckpointIO().save_checkpoint(ckpt, path)
    return path, ckpt


def test_ckpt_round_trip_full(checkpoint, tmp_path):
    src, saved = checkpoint
    dst = consolidate(src, dst=str(tmp_path / "out.ckpt"))
    for mmap in (False, True):
        out = torch.load(dst, weights_only=True, mmap=mmap)
        assert_same(out["state_dict"], saved["state_dict"], "state_dict")
        assert_same(out["optimizer_states"], saved["optimizer_states"], "optimizer_states")
        assert_same(out["callbacks"], saved["callbacks"], "callbacks")
        assert (out["epoch"], out["global_step"], out["hyper_parameters"]) == (2, 7, {"hidden": 5})
        assert out["lightning_dcp"]["optimizer_layout"] == "param_id"
    # The same as what the in-memory loader returns.
    loaded = DCPCheckpointIO().load_checkpoint(src)
    assert_same(out["state_dict"], loaded["state_dict"])
    assert sorted(os.listdir(tmp_path)) == ["out.ckpt", "step=7.ckpt"]  # no temporary file left


def test_ckpt_weights_only_cast_and_select(checkpoint, tmp_path):
    src, saved = checkpoint
    dst = consolidate(src, dst=str(tmp_path / "w.ckpt"), weights_only=True, dtype="bf16", exclude=["2.*"])
    out = torch.load(dst, weights_only=True)
    assert "optimizer_states" not in out and "lr_schedulers" not in out and "callbacks" not in out
    assert set(out["state_dict"]) == {"0.weight", "0.bias", "count"}
    assert out["state_dict"]["0.weight"].dtype == torch.bfloat16
    assert torch.equal(out["state_dict"]["0.weight"], saved["state_dict"]["0.weight"].bfloat16())
    assert out["state_dict"]["count"].dtype == torch.int64  # not floating: not cast
    with pytest.raises(ValueError, match="weights_only"):
        consolidate(src, dst=str(tmp_path / "x.ckpt"), include=["0.*"])


def test_safetensors_single_and_sharded(checkpoint, tmp_path):
    src, saved = checkpoint
    single = consolidate(src, dst=str(tmp_path / "model.safetensors"))
    assert_same(load_file(single), dict(saved["state_dict"]))
    half = load_file(consolidate(src, dst=str(tmp_path / "h.safetensors"), dtype=torch.float16))
    assert half["2.weight"].dtype == torch.float16 and half["count"].dtype == torch.int64

    shard_dir = consolidate(src, dst=str(tmp_path / "hf"), max_shard_size=64)
    index = json.loads(open(os.path.join(shard_dir, "model.safetensors.index.json")).read())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for name in files:
        merged.update(load_file(os.path.join(shard_dir, name)))
    assert_same(merged, dict(saved["state_dict"]))
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in saved["state_dict"].values())
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # staging removed


def test_safetensors_full_includes_optimizer_tensors(checkpoint, tmp_path):
    src, saved = checkpoint
    out = load_file(consolidate(src, dst=str(tmp_path / "f.safetensors"), weights_only=False))
    assert torch.equal(out["optimizer_states.0.state.0.exp_avg"], saved["optimizer_states"][0]["state"][0]["exp_avg"])


def test_plain_dcp_directory(tmp_path):
    state = {"model": {"w": torch.randn(3, 2), "b": torch.ones(2)}, "step": torch.tensor(4), "note": "hello"}
    dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    out = torch.load(consolidate(str(tmp_path / "plain"), dst=str(tmp_path / "p.ckpt")), weights_only=True)
    assert_same(out, state)
    flat = load_file(consolidate(str(tmp_path / "plain"), dst=str(tmp_path / "p.safetensors")))
    assert set(flat) == {"model.w", "model.b", "step"}


def test_existing_output_refused(checkpoint, tmp_path):
    src, _ = checkpoint
    dst = tmp_path / "out.ckpt"
    dst.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="overwrite"):
        consolidate(src, dst=str(dst))
    assert dst.read_bytes() == b"keep me"
    assert main([src, "-o", str(dst)]) == 1
    assert main([src, "-o", str(dst), "--overwrite", "--no-progress"]) == 0
    assert "state_dict" in torch.load(dst, weights_only=True)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_input_names_file_and_leaves_nothing(checkpoint, tmp_path, damage):
    src, _ = checkpoint
    data = os.path.join(src, "__0_0.distcp")
    raw = bytearray(open(data, "rb").read())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:  # a flipped byte in every record
        for i in range(100, len(raw), 64):
            raw[i] ^= 0xFF
    open(data, "wb").write(bytes(raw))
    for fmt in ("out.ckpt", "out.safetensors"):
        with pytest.raises(NotACheckpointError, match="__0_0.distcp"):
            consolidate(src, dst=str(tmp_path / fmt))
    assert sorted(os.listdir(tmp_path)) == ["step=7.ckpt"]


def test_missing_and_non_checkpoint_inputs(tmp_path, capsys):
    with pytest.raises(CheckpointNotFoundError):
        consolidate(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1
    assert ".metadata" in capsys.readouterr().err


def test_main_in_process(checkpoint, tmp_path, capsys):
    src, saved = checkpoint
    dst = str(tmp_path / "cli.safetensors")
    assert main([src, "--output", dst, "--dtype", "bf16", "--include", "0.*", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == dst
    out = load_file(dst)
    assert set(out) == {"0.weight", "0.bias"} and out["0.bias"].dtype == torch.bfloat16


def test_help_subprocess():
    result = subprocess.run(
        [sys.executable, "-m", "lightning_dcp.consolidate", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    assert "examples:" in result.stdout and "--max-shard-size" in result.stdout


def test_lightning_fsdp_sharded_layout(tmp_path):
    # Lightning's FSDPStrategy(state_dict_type="sharded") layout: model.*, optimizer_{i}.* (FQN-keyed) + meta.pt.
    model, opt = _model_and_optimizer()
    names = [n for n, _ in model.named_parameters()]
    osd = opt.state_dict()
    by_fqn = {
        "state": {names[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    src = tmp_path / "fsdp.ckpt"
    dcp.save({"model": model.state_dict(), "optimizer_0": by_fqn}, checkpoint_id=str(src), no_dist=True)
    torch.save({"epoch": 4, "global_step": 9}, src / "meta.pt")
    out = torch.load(consolidate(str(src), dst=str(tmp_path / "o.ckpt")), weights_only=True)
    assert_same(out["state_dict"], model.state_dict())
    assert_same(out["optimizer_states"], [osd])
    assert (out["epoch"], out["global_step"]) == (4, 9)
