"""GPU checkpoint costs: async stall vs the pinned-copy limit, sync save vs the disk, step time with async saves.

For ``size_gb`` GB of fp32 training state on one CUDA device (GPT-shaped weights plus AdamW ``exp_avg`` and
``exp_avg_sq``, layers of width 2048; ``bench_save.workload``), each method runs ``repeats`` times after one untimed
warm-up (first-save set-up such as pinned buffers and the gloo group is not what each later save costs):

- ``pinned_copy``: copy every tensor into pre-allocated pinned host buffers (non-blocking copies, one
  synchronize): the fastest any save can take the state off the GPU, the limit for the stall;
- ``async``: ``DCPCheckpointIO(async_save=True).save_checkpoint``; ``stall_s`` is the time it blocks the caller
  (the training loop), ``seconds`` the time until the save is committed;
- ``sync``: ``DCPCheckpointIO().save_checkpoint`` (device-to-host, write, fsync, commit);
- ``disk_limit``: one sequential write + fsync of the same number of bytes from host memory.

:func:`run_training` times a real Lightning training run on the GPU (``dcp_single_device``, ``bf16-mixed``) of an
MLP holding ~``state_gb`` GB of fp32 weights and AdamW state: the mean step time over the steps after ``warmup``
with no checkpoints, with an async save every ``every`` steps and with a sync save every ``every`` steps. Runs
alternate (none, async, sync, none, async, ...) so drift hits every mode alike. Every measurement runs in a fresh
process (own CUDA context, allocator and pinned-memory cache).

    python benchmarks/bench_gpu.py --size-gb 2            # one size (JSON on stdout)
    python -m benchmarks.bench_gpu --gpt                  # the GPT-shaped Trainer run of every method (gpu_trainer.py)
    python -m benchmarks.run --gpu                        # 2, 8, 20 GB and the training run -> results/GPU.md
    python -m benchmarks.run --gpu --smoke                # tiny sizes on CPU: the same code paths, no numbers

Without CUDA (and without ``--smoke``) it prints that it skipped and exits 0.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    from benchmarks import gpu_trainer
    from benchmarks._cli import bench_main
    from benchmarks.bench_save import disk_write, nbytes, workload
except ImportError:  # run as a script: python benchmarks/bench_gpu.py
    import gpu_trainer
    from _cli import bench_main
    from bench_save import disk_write, nbytes, workload

WIDTH = 2048
SMOKE_WIDTH = 64
SKIP_MESSAGE = "bench_gpu: skipped: needs a CUDA device (torch.cuda.is_available() is False); --smoke runs on CPU"
TRAIN_MODES = ("none", "async", "sync")


def cuda_ready(smoke: bool) -> bool:
    """Whether to run: CUDA is there, or ``smoke`` asks for the CPU check. Prints the skip otherwise."""
    if smoke or torch.cuda.is_available():
        return True
    print(SKIP_MESSAGE, flush=True)
    return False


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def _timed(fn: Callable[[], float | None], device: str) -> tuple[float, float]:
    """``(stall, total)`` seconds of ``fn`` from a synchronized start; ``fn`` returns its stall (or ``None``)."""
    _sync(device)
    start = time.perf_counter()
    stall = fn()
    _sync(device)
    total = time.perf_counter() - start
    return (total if stall is None else stall - start), total


def _saves_child(workdir: str, size_gb: float, repeats: int, smoke: bool, out: str) -> None:
    from lightning_dcp import DCPCheckpointIO

    device = "cpu" if smoke else "cuda"
    pin = device == "cuda"
    checkpoint = workload(size_gb, width=SMOKE_WIDTH if smoke else WIDTH, device=device)
    tensors = [t for t in _tensors(checkpoint) if t.device.type == device]
    size = nbytes(checkpoint)
    timings: dict[str, list[tuple[float, float]]] = {}

    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]

    def pinned_copy() -> None:
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=pin)

    pinned_copy()
    timings["pinned_copy"] = [_timed(pinned_copy, device) for _ in range(repeats)]
    buffers.clear()  # give the pinned memory back before the saves allocate theirs

    def saves(name: str, io: Any, *, warmup: bool) -> None:
        def once(path: str) -> float:
            io.save_checkpoint(checkpoint, path)
            stalled = time.perf_counter()
            io.wait()
            return stalled

        if warmup:
            once(os.path.join(workdir, f"{name}-warmup.ckpt"))
            _remove(os.path.join(workdir, f"{name}-warmup.ckpt"))
        timings[name] = []
        for i in range(repeats):
            path = os.path.join(workdir, f"{name}-{i}.ckpt")
            timings[name].append(_timed(lambda path=path: once(path), device))
            _remove(path)
        io.teardown()

    saves("async", DCPCheckpointIO(async_save=True), warmup=True)
    saves("sync", DCPCheckpointIO(), warmup=False)  # nothing to set up once; a warm-up would cost a whole write
    path = os.path.join(workdir, "disk-limit.bin")
    timings["disk_limit"] = []
    for _ in range(repeats):
        timings["disk_limit"].append(_timed(lambda: disk_write(path, size), "cpu"))
        _remove(path)
    with open(out, "w") as f:
        json.dump({"bytes": size, "tensors": len(tensors), "timings": timings}, f)


def _run_child(target: Callable[..., None], workdir: str, *args: Any) -> dict:
    """Run ``target(workdir, *args, out)`` in a fresh spawned process and return the JSON it wrote to ``out``."""
    out = os.path.join(workdir, f"result-{time.time_ns()}.json")
    process = multiprocessing.get_context("spawn").Process(target=target, args=(workdir, *args, out))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{target.__name__}{args} failed in its process (exit code {process.exitcode})")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def run(size_gb: float, workdir: str, *, repeats: int = 3, smoke: bool = False, gpt: bool = False) -> dict:
    """Measure the save side for ``size_gb`` GB on the GPU (``smoke``: on CPU); medians, min-max and ratios.

    ``gpt``: :func:`run_gpt` instead (``size_gb`` unused).
    """
    if not cuda_ready(smoke):
        return {"skipped": SKIP_MESSAGE}
    if gpt:
        return run_gpt(workdir, repeats=max(1, repeats // 2), smoke=smoke)
    os.makedirs(workdir, exist_ok=True)
    raw = _run_child(_saves_child, workdir, size_gb, repeats, smoke)
    size = raw["bytes"]
    methods = {}
    for name, pairs in raw["timings"].items():
        stalls, totals = [p[0] for p in pairs], [p[1] for p in pairs]
        methods[name] = {
            "seconds": statistics.median(totals),
            "seconds_min": min(totals),
            "seconds_max": max(totals),
            "stall_s": statistics.median(stalls),
            "gb_per_s": size / 1e9 / statistics.median(totals),
        }
    return {
        "size_gb": size / 1e9,
        "tensors": raw["tensors"],
        "repeats": repeats,
        "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(0),
        "methods": methods,
        "stall_vs_pinned_copy": methods["async"]["stall_s"] / methods["pinned_copy"]["seconds"],
        "sync_vs_disk_limit": methods["disk_limit"]["seconds"] / methods["sync"]["seconds"],
    }


# ------------------------------------------------------------------------------------------------- training
def _train_child(workdir: str, mode: str, settings: dict, out: str) -> None:
    import lightning.pytorch as pl
    from torch import nn

    from lightning_dcp import DCPCheckpointIO

    smoke = settings["smoke"]
    device = "cpu" if smoke else "cuda"
    width, warmup, steps, every = settings["width"], settings["warmup"], settings["steps"], settings["every"]
    layers = max(1, round(settings["state_gb"] * 1e9 / 12 / width**2))

    class Stalls(DCPCheckpointIO):
        """Records how long each save blocked the training loop."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.stalls: list[float] = []

        def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
            super().save_checkpoint(*args, **kwargs)
            self.stalls.append(self.last_save_seconds)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
            self.register_buffer("x", torch.randn(settings["batch"], width), persistent=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(self.x).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-6)

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == warmup:
                _sync(device)
                self.start = time.perf_counter()

        def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
            _sync(device)  # the write of the last async save may still run: steps are what is timed
            self.seconds = time.perf_counter() - self.start
            self.steps = trainer.global_step - warmup

    clock = Clock()
    callbacks: list[pl.Callback] = [clock]
    plugins = []
    io = None
    if mode != "none":
        io = Stalls(async_save=mode == "async")
        plugins.append(io)
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=os.path.join(workdir, mode), every_n_train_steps=every))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(warmup + steps, 1)), batch_size=1)
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        strategy="dcp_single_device",
        precision=settings["precision"],
        max_steps=warmup + steps,
        callbacks=callbacks,
        plugins=plugins,
        enable_checkpointing=mode != "none",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(Model(), train_dataloaders=data)
    shutil.rmtree(os.path.join(workdir, mode), ignore_errors=True)
    state = sum(p.numel() for p in trainer.lightning_module.parameters()) * 12
    result = {
        "step_s": clock.seconds / clock.steps,
        "steps": clock.steps,
        "saves": len(io.stalls) if io else 0,
        "stall_s": statistics.mean(io.stalls) if io and io.stalls else 0.0,
        "state_gb": state / 1e9,
        "layers": layers,
    }
    with open(out, "w") as f:
        json.dump(result, f)


def run_training(
    workdir: str,
    *,
    state_gb: float = 2.0,
    steps: int = 200,
    every: int = 50,
    warmup: int = 20,
    batch: int = 16384,
    precision: str = "bf16-mixed",
    repeats: int = 2,
    modes: tuple[str, ...] = TRAIN_MODES,
    smoke: bool = False,
) -> dict:
    """Mean step time without checkpoints and with a save every ``every`` steps (each mode ``repeats`` times)."""
    if not cuda_ready(smoke):
        return {"skipped": SKIP_MESSAGE}
    os.makedirs(workdir, exist_ok=True)
    settings = {
        "state_gb": state_gb,
        "steps": steps,
        "every": every,
        "warmup": warmup,
        "batch": batch,
        "precision": precision,
        "width": SMOKE_WIDTH if smoke else 4096,
        "smoke": smoke,
    }
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            runs[mode].append(_run_child(_train_child, workdir, mode, settings))
    summary = {}
    for mode, results in runs.items():
        summary[mode] = {
            "step_s": statistics.median(r["step_s"] for r in results),
            "step_s_all": [r["step_s"] for r in results],
            "saves_per_run": results[0]["saves"],
            "stall_s": statistics.median(r["stall_s"] for r in results),
        }
    base = summary.get("none", {}).get("step_s")
    for entry in summary.values():
        entry["vs_none"] = entry["step_s"] / base if base else None
    first = next(iter(runs.values()))[0]
    return {"settings": settings, "state_gb": first["state_gb"], "layers": first["layers"], "modes": summary}


def run_gpt(
    workdir: str,
    *,
    steps: int = 50,
    every: int = 10,
    repeats: int = 1,
    methods: tuple[str, ...] = gpu_trainer.METHODS,
    smoke: bool = False,
) -> dict:
    """The GPT-shaped Trainer run of every method (:mod:`benchmarks.gpu_trainer`), methods alternating per repeat."""
    if not cuda_ready(smoke):
        return {"skipped": SKIP_MESSAGE}
    os.makedirs(workdir, exist_ok=True)
    settings = {"steps": 6 if smoke else steps, "every": 2 if smoke else every, "smoke": smoke}
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for _ in range(repeats):
        for method in methods:
            runs[method].append(_run_child(gpu_trainer.train_child, workdir, method, settings))
    first = next(iter(runs.values()))[0]
    return {
        "settings": settings,
        "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(0),
        "state_gb": first["state_gb"],
        "methods": gpu_trainer.summarize(runs, settings["every"]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not cuda_ready("--smoke" in argv):
        return 0
    return bench_main(
        run,
        argv,
        doc=__doc__,
        default_size_gb=2.0,
        prefix="bench_gpu_",
        options={
            "--smoke": {"action": "store_true", "help": "tiny state on CPU: checks the code paths run"},
            "--gpt": {"action": "store_true", "help": "the GPT-shaped Trainer run of every method instead"},
        },
    )


if __name__ == "__main__":
    raise SystemExit(main())
