"""Replicated tensors split into chunks spread over ranks; read back at any world size, by any DCP reader."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from harness.ranks import spawn
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.save import planning
from tests._trainer import load_result, save_result


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(256, 512, generator=g), "small": torch.randn(10, generator=g)}


def _worker(rank: int, world_size: int, tmp: str) -> None:
    dist.init_process_group("gloo")
    planning.CHUNK_BYTES = 1 << 16  # 512 KiB tensor: 8 chunks of 64 KiB
    state = _state()
    checkpointer = Checkpointer()
    for name in ("a.ckpt", "b.ckpt"):  # the second save reuses the first one's plan
        checkpointer.save({"state_dict": state}, os.path.join(tmp, name), objects={"step": 1}, collective=True)
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
    checkpointer.load(os.path.join(tmp, "b.ckpt"), target=target, collective=True)
    save_result(tmp, "ws2", rank, target["state_dict"])
    dist.barrier()
    if rank == 0:
        alone = Checkpointer().load(os.path.join(tmp, "b.ckpt"))  # world size 1, no target: full tensors
        save_result(tmp, "ws1", 0, alone.tree["state_dict"])
        stock = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(stock, storage_reader=FileSystemReader(os.path.join(tmp, "b.ckpt")), no_dist=True)
        save_result(tmp, "stock", 0, stock["state_dict"])
        for name in ("a.ckpt", "b.ckpt"):
            metadata = FileSystemReader(os.path.join(tmp, name)).read_metadata()
            files = {
                info.relative_path for index, info in metadata.storage_data.items() if index.fqn == "state_dict.big"
            }
            sizes = {f: os.path.getsize(os.path.join(tmp, name, f)) for f in files}
            save_result(tmp, f"files-{name}", 0, (len(metadata.state_dict_metadata["state_dict.big"].chunks), sizes))


def test_replicated_tensors_are_split_over_ranks_and_read_anywhere(tmp_path):
    tmp = str(tmp_path)
    spawn(_worker, 2, tmp)
    expected = _state()
    for name, rank in (("ws2", 0), ("ws2", 1), ("ws1", 0), ("stock", 0)):
        loaded = load_result(tmp, name, rank)
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), (name, rank, key)
    for name in ("a.ckpt", "b.ckpt"):
        chunks, sizes = load_result(tmp, f"files-{name}")
        assert chunks == 8
        assert sorted(sizes) == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote a share of the big tensor
        assert max(sizes.values()) < 0.7 * sum(sizes.values())


def _in_turn_worker(rank: int, world_size: int, tmp: str) -> None:
    from lightning_dcp.engine.save import saving

    dist.init_process_group("gloo")
    made = []
    plan = saving.global_plan

    def counted(*args, **kwargs):
        made.append(1)
        return plan(*args, **kwargs)

    saving.global_plan = counted  # the coordinator's global planning, counted
    # One checkpoint IO, two structures in turn: a full ModelCheckpoint and a weights-only one.
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    results = {}
    for round_ in range(3):
        state = {f"w{i}": torch.full((64,), float(round_ * 10 + i)) for i in range(6)}
        optimizer = {f"m{i}": torch.full((32,), float(-round_ - i)) for i in range(4)}
        for name, tree in (
            ("full", {"state_dict": state, "optimizer": optimizer}),
            ("weights", {"state_dict": {k: v for k, v in state.items() if k != "w5"}}),
        ):
            path = os.path.join(tmp, f"{name}-{round_}.ckpt")
            checkpointer.save(tree, path, objects={"round": round_}, collective=True)
            checkpointer.wait(collective=True)
            loaded = Checkpointer().load(path, collective=True).tree
            pairs = [(loaded[group][key], value) for group, values in tree.items() for key, value in values.items()]
            results[(name, round_)] = all(torch.equal(a, b) for a, b in pairs)
    checkpointer.close()
    save_result(tmp, "in-turn", rank, (results, len(made)))


@pytest.mark.full
def test_two_plans_saved_in_turn_are_planned_once_each_on_every_rank(tmp_path):
    tmp = str(tmp_path)
    spawn(_in_turn_worker, 2, tmp)
    for rank in (0, 1):
        results, planned = load_result(tmp, "in-turn", rank)
        assert results and all(results.values()), (rank, results)
        assert len(results) == 6
        assert planned == (2 if rank == 0 else 0)  # one global plan per structure, reused at every later save
