"""Load time of a sharded checkpoint at a new world size vs at the world size that wrote it.

Two real gloo processes write a GPT-style checkpoint (embeddings, per-layer attention/MLP weights, AdamW
``exp_avg``/``exp_avg_sq``/``step``; about ``size_gb`` GB) through ``DCPCheckpointIO``, every tensor a DTensor
sharded on dim 0 over the 2 ranks (FSDP2's layout; the 50257-row embedding splits unevenly). Then, each the median of
``repeats`` loads into the same pre-built target, timed from a barrier to the last rank's return:

- ``same_ws2``: 2 processes load their own shards (no resharding);
- ``new_ws1``: 1 process loads full tensors from both ranks' files (resharding 2 -> 1);
- ``ws1_written_ws1``: 1 process loads the same state written by 1 process (isolates the cost of resharding from
  the cost of one process reading twice the bytes);
- ``torch_load_consolidated``: ``torch.load`` of ``lightning_dcp.consolidate``'s single file (1 process).

Files are read from a warm page cache (dropping it needs root). Goal: ``new_ws1`` within 1.2x of ``same_ws2``.

    python benchmarks/bench_reshard.py --size-gb 1 --workdir /tmp/bench_reshard
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from benchmarks._cli import bench_main
except ImportError:  # run as a script: python benchmarks/bench_reshard.py
    from _cli import bench_main

VOCAB, CONTEXT, WIDTH = 50257, 1024, 768
_LAYER = {
    "ln_1.weight": (WIDTH,),
    "attn.c_attn.weight": (3 * WIDTH, WIDTH),
    "attn.c_attn.bias": (3 * WIDTH,),
    "attn.c_proj.weight": (WIDTH, WIDTH),
    "ln_2.weight": (WIDTH,),
    "mlp.c_fc.weight": (4 * WIDTH, WIDTH),
    "mlp.c_fc.bias": (4 * WIDTH,),
    "mlp.c_proj.weight": (WIDTH, 4 * WIDTH),
}


def shapes(size_gb: float) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a GPT-2-like model whose weights + two AdamW moments take about ``size_gb`` GB (fp32)."""
    per_layer = sum(torch.Size(s).numel() for s in _LAYER.values())
    layers = max(1, round((size_gb * 1e9 / 12 - (VOCAB + CONTEXT) * WIDTH) / per_layer))
    out = {"wte.weight": (VOCAB, WIDTH), "wpe.weight": (CONTEXT, WIDTH)}
    for i in range(layers):
        out.update({f"h.{i}.{name}": shape for name, shape in _LAYER.items()})
    return out


def _value(index: int, kind: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The same full tensor on every process (seeded by parameter index and kind)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(index * 3 + kind)) * 0.02


def checkpoint(size_gb: float, *, mesh=None, fill: bool = True) -> dict:
    """A Lightning checkpoint dict: DTensors sharded over ``mesh`` (plain tensors without one), filled or empty."""
    from torch.distributed.tensor import DTensor, Shard

    def make(index: int, kind: int, shape: tuple[int, ...]) -> torch.Tensor:
        full = _value(index, kind, shape) if fill else torch.empty(shape)
        if mesh is None:
            return full
        local = full.chunk(mesh.size(), dim=0)[mesh.get_local_rank()].clone()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())

    params = shapes(size_gb)
    weights = {name: make(i, 0, s) for i, (name, s) in enumerate(params.items())}
    state = {
        name: {"step": torch.tensor(100.0), "exp_avg": make(i, 1, s), "exp_avg_sq": make(i, 2, s)}
        for i, (name, s) in enumerate(params.items())
    }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(params)}]
    return {
        "state_dict": weights,
        "optimizer_states": [{"state": state, "param_groups": groups}],
        "epoch": 1,
        "global_step": 100,
        "loops": {},
        "callbacks": {},
        "lr_schedulers": [],
    }


def _entry(rank: int, world_size: int, port: int, job: str, size_gb: float, workdir: str, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        _job(rank, world_size, job, size_gb, workdir, repeats)
    finally:
        dist.destroy_process_group()


def _job(rank: int, world_size: int, job: str, size_gb: float, workdir: str, repeats: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_dcp import DCPCheckpointIO

    io = DCPCheckpointIO(sync_files=False)
    mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
    if job == "save":
        io.save_checkpoint(checkpoint(size_gb, mesh=mesh), os.path.join(workdir, f"ws{world_size}"), collective=True)
        return
    source, seconds = job.split(":")[1], []
    for _ in range(repeats):
        target = checkpoint(size_gb, mesh=mesh, fill=False)
        target = {k: target[k] for k in ("state_dict", "optimizer_states")}
        dist.barrier()
        start = time.perf_counter()
        if source == "consolidated":
            torch.load(os.path.join(workdir, "consolidated.ckpt"), map_location="cpu", weights_only=True)
        else:
            io.load_checkpoint(os.path.join(workdir, source), state_dict=target, collective=True)
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    if rank == 0:
        with open(os.path.join(workdir, f"{job.replace(':', '_')}_{world_size}.json"), "w") as f:
            json.dump(seconds, f)


def _spawn(world_size: int, job: str, size_gb: float, workdir: str, repeats: int = 1) -> list[float] | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _entry, args=(world_size, port, job, size_gb, workdir, repeats), nprocs=world_size, start_method="spawn"
    )
    result = os.path.join(workdir, f"{job.replace(':', '_')}_{world_size}.json")
    if not os.path.exists(result):
        return None
    with open(result) as f:
        return json.load(f)


def run(size_gb: float, workdir: str, *, repeats: int = 3) -> dict:
    """Write the checkpoints into ``workdir`` and time the four loads (median of ``repeats`` each, seconds)."""
    from lightning_dcp import consolidate

    os.makedirs(workdir, exist_ok=True)
    _spawn(2, "save", size_gb, workdir)
    _spawn(1, "save", size_gb, workdir)
    consolidate(os.path.join(workdir, "ws2"), dst=os.path.join(workdir, "consolidated.ckpt"), progress=False)
    runs = {
        "same_ws2": _spawn(2, "load:ws2", size_gb, workdir, repeats),
        "new_ws1": _spawn(1, "load:ws2", size_gb, workdir, repeats),
        "ws1_written_ws1": _spawn(1, "load:ws1", size_gb, workdir, repeats),
        "torch_load_consolidated": _spawn(1, "load:consolidated", size_gb, workdir, repeats),
    }
    seconds = {name: statistics.median(times) for name, times in runs.items()}
    nbytes = sum(torch.Size(s).numel() * 4 * 3 for s in shapes(size_gb).values())
    return {
        "size_gb": size_gb,
        "checkpoint_bytes": nbytes,
        "seconds": seconds,
        "runs": runs,
        "gb_per_s": {name: nbytes / 1e9 / s for name, s in seconds.items()},
        "ratio_new_vs_same": seconds["new_ws1"] / seconds["same_ws2"],
        "ratio_new_vs_ws1_written_ws1": seconds["new_ws1"] / seconds["ws1_written_ws1"],
        "goal_ok": seconds["new_ws1"] <= 1.2 * seconds["same_ws2"],
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, argv, doc=__doc__, default_size_gb=1.0, prefix="bench_reshard_")


if __name__ == "__main__":
    raise SystemExit(main())
