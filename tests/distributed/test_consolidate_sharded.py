"""Consolidating 2-rank FSDP2 checkpoints (ours and Lightning's own ModelParallelStrategy layout) in one process."""

from __future__ import annotations

import os

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import load_file

from harness.ranks import spawn
from lightning_dcp import DCPModelParallelStrategy, consolidate, inspect_checkpoint
from tests._models import FSDP2Model, RandomDataModule
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot


def _worker(rank: int, world_size: int, tmp: str) -> None:
    for name, strategy in (
        ("ours", DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)),
        ("lightning", ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)),
    ):
        seed()
        model = FSDP2Model(hidden=50)
        trainer = make_trainer(world_size, strategy=strategy, max_epochs=1)
        trainer.fit(model, datamodule=RandomDataModule())
        trainer.save_checkpoint(os.path.join(tmp, f"{name}.ckpt"))
        save_result(tmp, name, rank, snapshot(trainer))


def test_consolidate_fsdp2_checkpoints(tmp_path):
    tmp = str(tmp_path)
    spawn(_worker, 2, tmp)
    for name, kind in (("ours", "lightning_dcp"), ("lightning", "lightning_sharded")):
        src = os.path.join(tmp, f"{name}.ckpt")
        expected = load_result(tmp, name, 0)
        report = inspect_checkpoint(src)
        assert report["format"] == kind and report["world_size"] == 2
        keys = {t["key"] for t in report["tensors"]}
        if kind == "lightning_sharded":  # Lightning's own key layout
            assert "state_dict.body.0.weight" in keys and "optimizer_0.state.body.0.weight.exp_avg" in keys

        out = torch.load(consolidate(src, dst=os.path.join(tmp, f"{name}.consolidated")), weights_only=True)
        assert_same(out["state_dict"], expected["params"], f"{name}.state_dict")
        assert out["global_step"] == expected["global_step"] == 8
        saved = out["optimizer_states"][0]
        full = expected["optimizers"][0]
        ids = saved["param_groups"][0]["params"]
        fqns = full["param_groups"][0]["params"]
        assert len(ids) == len(fqns) == len(full["state"])
        for i, fqn in zip(ids, fqns, strict=True):
            assert_same(saved["state"][i], full["state"][fqn], f"{name}.optimizer[{fqn}]")
        assert saved["param_groups"][0]["lr"] == full["param_groups"][0]["lr"]

        weights = load_file(consolidate(src, dst=os.path.join(tmp, f"{name}.safetensors"), dtype="bf16"))
        cast = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected["params"].items()}
        assert_same(weights, cast, f"{name}.safetensors")
