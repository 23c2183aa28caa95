"""A record index edited after commit fails a 2-rank restore on every rank alike (issue 40, item 1)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from harness.ranks import spawn
from lightning_dcp import CheckpointError
from lightning_dcp.engine.checkpointer import Checkpointer
from tests._trainer import load_result, save_result


def _state() -> dict:
    g = torch.Generator().manual_seed(2)
    return {f"l{i}.weight": torch.randn(8, 4, generator=g) for i in range(6)}


def _worker(rank: int, world_size: int, tmp: str) -> None:
    dist.init_process_group("gloo")
    path = os.path.join(tmp, "step=1.ckpt")
    Checkpointer().save({"state_dict": _state()}, path, objects={"step": 1}, collective=True)
    if rank == 0:  # l0.weight and l1.weight swapped in the index (every record's checksum still holds)
        with open(os.path.join(path, ".commit")) as f:
            marker = json.load(f)
        for entries in marker["index"]["files"].values():
            for entry in entries:
                if entry[0] in ("state_dict.l0.weight", "state_dict.l1.weight"):
                    entry[0] = "state_dict.l1.weight" if entry[0].endswith("l0.weight") else "state_dict.l0.weight"
        with open(os.path.join(path, ".commit"), "w") as f:
            json.dump(marker, f)
    dist.barrier()
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in _state().items()}}
    try:
        loaded = Checkpointer().load(path, target=target, collective=True)
        result = ["loaded", torch.equal(loaded.tree["state_dict"]["l0.weight"], _state()["l0.weight"])]
    except CheckpointError as err:
        result = [type(err).__name__, str(err), getattr(err, "file", None)]
    save_result(tmp, "result", rank, result)


def test_an_edited_index_fails_every_rank_with_the_same_error(tmp_path):
    spawn(_worker, 2, str(tmp_path))
    results = [load_result(str(tmp_path), "result", rank) for rank in (0, 1)]
    assert results[0] == results[1], results
    kind, message, file = results[0]
    assert kind == "CorruptCheckpointError" and file == ".commit"
    assert "does not match its own checksum" in message and "step=1.ckpt" in message
    assert "Resume from another checkpoint" in message
