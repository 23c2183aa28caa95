"""Checksum overhead of lightning_dcp's integrity checks on save and on load (issue: integrity and crash safety).

Saves ~SIZE GB of GPT-style state (fp32 params + AdamW moments) with ``DCPCheckpointIO`` in one process, loads it
back, and measures what the checksums cost: the checksum work is xxHash3-64 over exactly the record bytes written (at
save) and read (at load), so its share is timed by hashing the same bytes again, outside the save.

    python benchmarks/bench_integrity.py --size-gb 1 [--repeats 3]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

import torch

from lightning_dcp import DCPCheckpointIO
from lightning_dcp.engine.format.marker import checksum

try:
    from benchmarks._cli import bench_main
except ImportError:  # run as a script: python benchmarks/bench_integrity.py
    from _cli import bench_main


def _state(size_gb: float) -> dict:
    n = int(size_gb * 2**30 / 4 / 3)  # params + exp_avg + exp_avg_sq, fp32
    sizes = [n // 8] * 8
    g = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(s, generator=g) for i, s in enumerate(sizes)}
    optim = {
        "state": {
            k: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)}
            for k, v in params.items()
        },
        "param_groups": [{"lr": 1e-3, "params": list(params)}],
    }
    return {"state_dict": params, "optimizer_states": [optim], "global_step": 10, "epoch": 0}


def run(size_gb: float, workdir: str, *, repeats: int = 3) -> dict:
    """Median save / load seconds and the checksum seconds over the same bytes; returns a dict of numbers."""
    state = _state(size_gb)
    io = DCPCheckpointIO()
    saves, loads, crcs = [], [], []
    path = os.path.join(workdir, "bench.ckpt")
    for _ in range(repeats):
        shutil.rmtree(path, ignore_errors=True)
        t = time.perf_counter()
        io.save_checkpoint(state, path)
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        io.load_checkpoint(path)
        loads.append(time.perf_counter() - t)
        blobs = []
        marker = json.load(open(os.path.join(path, ".commit")))
        for name, entry in marker["files"].items():
            data = open(os.path.join(path, name), "rb").read()
            blobs += [memoryview(data)[o : o + n] for o, n, _ in entry["records"]]
        t = time.perf_counter()
        for blob in blobs:
            checksum(blob)
        crcs.append(time.perf_counter() - t)
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    save, load, crc = statistics.median(saves), statistics.median(loads), statistics.median(crcs)
    return {
        "checkpoint_bytes": nbytes,
        "save_s": save,
        "load_s": load,
        "checksum_s": crc,
        "checksum_share_of_save": crc / save,
        "checksum_share_of_load": crc / load,
        "save_runs_s": saves,
        "load_runs_s": loads,
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, argv, doc=__doc__, default_size_gb=1.0, prefix="bench_integrity_")


if __name__ == "__main__":
    raise SystemExit(main())
