"""Save time, throughput, training-loop stall and peak RSS: lightning_dcp vs the peers and the disk's limit.

Every rank of a real gloo process group holds the same GPT-style state (fp32 weights plus AdamW ``exp_avg`` and
``exp_avg_sq``: DDP's replicated state, ~``size_gb`` GB in all) and saves it with each method, ``repeats`` times:

- ``lightning_dcp``: ``DCPCheckpointIO`` as the ``dcp_*`` strategies call it (every rank writes its part);
- ``lightning_dcp_async``: the same with ``async_save=True`` (the stall is the time ``save_checkpoint`` blocks);
- ``torch_save_rank0``: Lightning's default ``TorchCheckpointIO`` (rank 0 ``torch.save``s everything, others wait);
- ``lightning_async_io``: Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())`` (clone, then a background thread);
- ``raw_dcp_save``: ``dcp.save`` with DCP's default ``FileSystemWriter`` (what Lightning's ``ModelParallelStrategy``
  sharded save calls for the tensors, plus a small rank-0 ``meta.pt``);
- ``disk_limit``: one sequential write + fsync of the same number of bytes (the disk's limit).

One untimed warm-up save per method comes first (a training run saves many times: the first save's one-off set-up,
such as the async gloo group and staging buffers, is not what each later save costs). Time is from a barrier to the
slowest rank's return (for async methods, to the save being complete); GB/s is the
checkpoint's bytes over that time; peak RSS is each process's high-water mark while running that method alone.

    python benchmarks/bench_save.py --size-gb 1 --world-size 2
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from benchmarks._cli import bench_main
except ImportError:  # run as a script: python benchmarks/bench_save.py
    from _cli import bench_main

METHODS = (
    "lightning_dcp",
    "lightning_dcp_async",
    "torch_save_rank0",
    "lightning_async_io",
    "raw_dcp_save",
    "disk_limit",
)
WIDTH = 512


def workload(size_gb: float, *, width: int = WIDTH, device: str = "cpu") -> dict:
    """A GPT-style checkpoint dict of ~``size_gb`` GB on ``device``: weights and two AdamW moments per parameter
    (fp32), layers of ``width``."""
    per_layer = {
        "attn.qkv.weight": (3 * width, width),
        "attn.proj.weight": (width, width),
        "mlp.fc.weight": (4 * width, width),
        "mlp.proj.weight": (width, 4 * width),
        "ln.weight": (width,),
    }
    layer_numel = sum(torch.Size(s).numel() for s in per_layer.values())
    layers = max(1, round(size_gb * 1e9 / 12 / layer_numel))
    g = torch.Generator(device=device).manual_seed(0)

    def randn(shape: tuple) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device)

    params = {f"h.{i}.{k}": randn(s) for i in range(layers) for k, s in per_layer.items()}
    state = {
        k: {"step": torch.tensor(100.0), "exp_avg": randn(v.shape), "exp_avg_sq": randn(v.shape).abs_()}
        for k, v in params.items()
    }
    optimizer = {"state": state, "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": list(params)}]}
    return {"state_dict": params, "optimizer_states": [optimizer], "global_step": 100, "epoch": 1, "loops": {}}


def nbytes(checkpoint: dict) -> int:
    total = sum(t.nbytes for t in checkpoint["state_dict"].values())
    return total + sum(t.nbytes for s in checkpoint["optimizer_states"][0]["state"].values() for t in s.values())


def disk_write(path: str, size: int) -> None:
    """Write ``size`` bytes sequentially to ``path`` in 64 MiB blocks and fsync: the disk's limit for a save."""
    block = torch.empty(64 * 2**20, dtype=torch.uint8).numpy()
    left = size
    with open(path, "wb") as f:
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())


def _save_once(method: str, checkpoint: dict, path: str, rank: int, io: object) -> tuple[float, float]:
    """Returns (stall, total) seconds on this rank."""
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    start = time.perf_counter()
    if method in ("lightning_dcp", "lightning_dcp_async"):
        io.save_checkpoint(checkpoint, path, collective=dist.is_initialized())
        stall = time.perf_counter() - start
        io.wait(collective=dist.is_initialized())
    elif method == "torch_save_rank0":
        if rank == 0:
            TorchCheckpointIO().save_checkpoint(checkpoint, path)
        stall = time.perf_counter() - start
    elif method == "lightning_async_io":
        if rank == 0:
            async_io = AsyncCheckpointIO(TorchCheckpointIO())
            async_io.save_checkpoint(checkpoint, path)
        stall = time.perf_counter() - start
        if rank == 0:
            async_io.teardown()  # joins the background write
    elif method == "raw_dcp_save":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(checkpoint, checkpoint_id=path, no_dist=not dist.is_initialized())
        stall = time.perf_counter() - start
    else:  # disk_limit: rank 0 writes the same bytes sequentially and fsyncs
        if rank == 0:
            disk_write(path, nbytes(checkpoint))
        stall = time.perf_counter() - start
    if dist.is_initialized():
        dist.barrier()
    return stall, time.perf_counter() - start


def _worker(rank: int, world_size: int, port: int, method: str, size_gb: float, workdir: str, repeats: int) -> None:
    from lightning_dcp import DCPCheckpointIO

    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    checkpoint = workload(size_gb)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    io = DCPCheckpointIO(async_save=method.endswith("async")) if method.startswith("lightning_dcp") else None
    stalls, totals = [], []
    _save_once(
        method, checkpoint, os.path.join(workdir, f"{method}-warmup.ckpt"), rank, io
    )  # untimed: first-save setup
    if rank == 0:
        path = os.path.join(workdir, f"{method}-warmup.ckpt")
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    for i in range(repeats):
        path = os.path.join(workdir, f"{method}-{i}.ckpt")
        if dist.is_initialized():
            dist.barrier()
        stall, total = _save_once(method, checkpoint, path, rank, io)
        stalls.append(stall)
        totals.append(total)
        if rank == 0 and os.path.isdir(path):
            shutil.rmtree(path)
        elif rank == 0 and os.path.exists(path):
            os.unlink(path)
    if io is not None and hasattr(io, "teardown"):
        io.teardown()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "stall_s": stalls,
        "total_s": totals,
        "peak_rss_bytes": peak,
        "state_rss_bytes": base_rss,
        "bytes": nbytes(checkpoint),
    }
    with open(os.path.join(workdir, f"result-{method}-{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(size_gb: float, workdir: str, *, world_size: int = 2, repeats: int = 3, methods=METHODS) -> dict:
    """Measure every method at ``world_size``; returns ``{method: {...medians, min, max, per-rank peak RSS}}``."""
    os.makedirs(workdir, exist_ok=True)
    results = {}
    for method in methods:
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), method, size_gb, workdir, repeats),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result-{method}-{rank}.json")) as f:
                per_rank.append(json.load(f))
        totals = [max(r["total_s"][i] for r in per_rank) for i in range(repeats)]
        stalls = [max(r["stall_s"][i] for r in per_rank) for i in range(repeats)]
        results[method] = {
            "seconds": statistics.median(totals),
            "seconds_min": min(totals),
            "seconds_max": max(totals),
            "stall_s": statistics.median(stalls),
            "peak_rss_gb_per_rank": [round(r["peak_rss_bytes"] / 1e9, 2) for r in per_rank],
            "state_rss_gb_per_rank": [round(r["state_rss_bytes"] / 1e9, 2) for r in per_rank],
        }
    size = per_rank[0]["bytes"]
    for entry in results.values():
        entry["gb_per_s"] = size / 1e9 / entry["seconds"]
    return {"size_gb": size / 1e9, "world_size": world_size, "repeats": repeats, "methods": results}


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, argv, doc=__doc__, default_size_gb=1.0, prefix="bench_save_", world_size=True)


if __name__ == "__main__":
    raise SystemExit(main())
