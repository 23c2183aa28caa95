"""Restores through the record index at 2 ranks: the ranks agree on the way, whatever each rank's target is."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from harness.ranks import spawn
from lightning_dcp import CorruptCheckpointError
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.format.record_index import parse_index
from lightning_dcp.engine.load import local_load
from lightning_dcp.engine.save import planning
from tests._trainer import load_result, save_result


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    state = {f"layer{i}.{p}": torch.randn(7, 3 + i % 3, generator=g) for i in range(30) for p in ("weight", "grad")}
    state["embedding.weight"] = torch.randn(96, 32, generator=g)  # 12 KiB: row chunks (CHUNK_BYTES patched)
    return state


def _worker(rank: int, world_size: int, tmp: str) -> None:
    dist.init_process_group("gloo")
    general: list[int] = []
    original = local_load.load

    def counted(*args, **kwargs):
        general.append(1)
        return original(*args, **kwargs)

    local_load.load = counted
    planning.CHUNK_BYTES = 4 << 10  # the embedding in 3 row chunks, written by both ranks
    state = _state()
    path = os.path.join(tmp, "c.ckpt")
    Checkpointer().save({"state_dict": state}, path, objects={"step": 3}, collective=True)
    with open(os.path.join(path, ".commit")) as f:
        chunks = parse_index(json.load(f))["state_dict.embedding.weight"]
    results = {"chunks": sorted((chunk.file, chunk.chunk[0], chunk.shape[0]) for chunk in chunks)}
    for case in ("both", "rank 1 cannot"):
        target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
        if case == "rank 1 cannot" and rank == 1:  # a non-contiguous target: the index cannot copy into it
            target["state_dict"]["layer0.weight"] = torch.zeros(3, 7).t()
        general.clear()
        loaded = Checkpointer().load(path, target=target, collective=True)
        equal = all(torch.equal(loaded.tree["state_dict"][k], v) for k, v in state.items())
        results[case] = (equal, len(general), loaded.objects["step"])
    with open(os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]), "r+b") as f:
        if rank == 0:  # one byte of a record changed: every rank fails alike, naming the file
            f.seek(2000)
            byte = f.read(1)
            f.seek(2000)
            f.write(bytes([byte[0] ^ 1]))
    dist.barrier()
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
    try:
        Checkpointer().load(path, target=target, collective=True)
        results["corrupt"] = "loaded"
    except CorruptCheckpointError as err:
        results["corrupt"] = type(err).__name__
    save_result(tmp, "results", rank, results)


def test_the_ranks_take_the_same_way_and_fail_alike(tmp_path):
    spawn(_worker, 2, str(tmp_path))
    for rank in (0, 1):
        results = load_result(str(tmp_path), "results", rank)
        assert [rows for _, _, rows in results["chunks"]] == [32, 32, 32], rank
        assert len({file for file, _, _ in results["chunks"]}) == 2, rank  # chunks in both ranks' files
        assert results["both"] == (True, 0, 3), rank  # through the index on both ranks, chunks included
        assert results["rank 1 cannot"] == (True, 1, 3), rank  # the general way on both ranks
        assert results["corrupt"] == "CorruptCheckpointError", rank
