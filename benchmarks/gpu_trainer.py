"""The run users would make on a GPU: a GPT-shaped model in a Trainer, the loop's blocked time per save, per method.

A GPT-shaped model (token embedding 32000 x 1024, 12 pre-norm encoder layers of width 1024, untied head: ~217M
parameters, ~2.6 GB of fp32 weights and AdamW moments) trains with ``bf16-mixed`` on one CUDA device and saves every
``every`` steps. Each method runs in a fresh process; per step the wall time from one ``on_train_batch_start`` to the
next, after ``torch.cuda.synchronize()``. Per save, *blocked* is the save step's and the next step's excess over the
median step of the run without saves (the first save reported apart: buffers, groups and pinned memory are made
there); *step_vs_none* is the mean step over the mean step without saves.

Methods: ``none`` (no saves); ``pinned_limit`` (a copy of every parameter and optimizer-state tensor into pinned
buffers made before, one synchronize: the least any save can block); ``dcp_async`` and ``dcp_async_skip``
(``DCPCheckpointIO(async_save=True)`` with ``when_busy="wait"`` / ``"skip"``, ``DCPSingleDeviceStrategy``);
``dcp_sync`` (``DCPCheckpointIO()``); ``stock`` (Lightning's ``ModelCheckpoint`` with ``torch.save``); ``stock_async``
(Lightning's ``AsyncCheckpointIO``); ``dcp_recipe`` (DCP's own recipe: ``dcp.async_save`` of ``get_state_dict`` with
a ``DefaultStager``, its staging awaited before the next ``optimizer.step()``).

    python -m benchmarks.bench_gpu --gpt              # one CUDA GPU: JSON on stdout
    python -m benchmarks.bench_gpu --gpt --smoke      # a tiny model on CPU: the same code paths, no figures
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from typing import Any

import torch

METHODS = (
    "none",
    "pinned_limit",
    "dcp_async",
    "dcp_async_skip",
    "dcp_sync",
    "stock",
    "stock_async",
    "dcp_recipe",
)

GPT = {"vocab": 32000, "width": 1024, "layers": 12, "heads": 16, "seq": 512, "batch": 8}
SMOKE_GPT = {"vocab": 256, "width": 32, "layers": 2, "heads": 2, "seq": 16, "batch": 2}


def _model(shape: dict) -> Any:
    import lightning.pytorch as pl
    from torch import nn

    class GPTLike(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            width = shape["width"]
            self.embed = nn.Embedding(shape["vocab"], width)
            self.pos = nn.Parameter(torch.zeros(shape["seq"], width))
            layer = nn.TransformerEncoderLayer(
                width, shape["heads"], 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, shape["layers"], enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, shape["vocab"], bias=False)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (tokens,) = batch
            x = self.embed(tokens[:, :-1]) + self.pos[: tokens.shape[1] - 1]
            logits = self.head(self.norm(self.blocks(x)))
            return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    return GPTLike()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _callbacks(method: str, workdir: str, every: int, device: str) -> tuple[list, list, Any]:
    """The callbacks, plugins and strategy of ``method``."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_dcp import DCPCheckpointIO, DCPSingleDeviceStrategy

    dirpath = os.path.join(workdir, method)
    every_n = {"dirpath": dirpath, "every_n_train_steps": every, "save_top_k": 1}
    dcp_strategy = DCPSingleDeviceStrategy(device=torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    if method in ("dcp_async", "dcp_async_skip", "dcp_sync"):
        io = DCPCheckpointIO(async_save=method != "dcp_sync", when_busy="skip" if method.endswith("skip") else "wait")
        return [pl.callbacks.ModelCheckpoint(**every_n)], [io], dcp_strategy
    if method == "stock":
        return [pl.callbacks.ModelCheckpoint(**every_n)], [], "auto"
    if method == "stock_async":
        return [pl.callbacks.ModelCheckpoint(**every_n)], [AsyncCheckpointIO()], "auto"
    if method == "dcp_recipe":
        return [_DCPRecipe(dirpath, every, device)], [], "auto"
    if method == "pinned_limit":
        return [_PinnedLimit(every, device)], [], "auto"
    return [], [], "auto"


class _Every:
    """Base of the callbacks that save by themselves every ``every`` steps."""

    def __init__(self, every: int, device: str) -> None:
        self.every, self.device = every, device

    def due(self, trainer: Any) -> bool:
        return trainer.global_step > 0 and trainer.global_step % self.every == 0


def _state_tensors(trainer: Any) -> list[torch.Tensor]:
    tensors = [p.detach() for p in trainer.lightning_module.parameters()]
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return tensors


class _PinnedLimit(_Every):
    """Every ``every`` steps: copy the state into pinned buffers made at the first save (the stall's floor)."""

    def __init__(self, every: int, device: str) -> None:
        import lightning.pytorch as pl

        super().__init__(every, device)
        self.buffers: list[torch.Tensor] = []
        self.callback = type("PinnedLimit", (pl.Callback,), {"on_train_batch_end": self._end})()

    def _end(self, trainer: Any, *args: Any) -> None:
        if not self.due(trainer):
            return
        tensors = _state_tensors(trainer)
        if not self.buffers:
            pin = self.device == "cuda"
            self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
        for buffer, tensor in zip(self.buffers, tensors, strict=True):
            buffer.copy_(tensor, non_blocking=self.device == "cuda")
        _sync(self.device)


class _DCPRecipe(_Every):
    """DCP's async recipe: ``dcp.async_save`` with a ``DefaultStager``; the next ``optimizer.step()`` awaits staging."""

    def __init__(self, dirpath: str, every: int, device: str) -> None:
        import lightning.pytorch as pl

        super().__init__(every, device)
        self.dirpath, self.response, self.stager = dirpath, None, None
        hooks = {"on_train_batch_end": self._end, "on_before_optimizer_step": self._before, "on_train_end": self._done}
        self.callback = type("DCPRecipe", (pl.Callback,), hooks)()

    def _end(self, trainer: Any, *args: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if not self.due(trainer):
            return
        if self.response is not None:  # one save in flight, as the recipe keeps it
            self.response.upload_completion.result()
        if self.stager is None:
            cuda = self.device == "cuda"
            self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))
        model_state, optim_state = get_state_dict(trainer.lightning_module, trainer.optimizers)
        path = os.path.join(self.dirpath, f"step={trainer.global_step}")
        state = {"model": model_state, "optim": optim_state}
        self.response = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager, no_dist=True)

    def _before(self, *args: Any) -> None:
        if self.response is not None:
            self.response.staging_completion.result()

    def _done(self, *args: Any) -> None:
        if self.response is not None:
            self.response.upload_completion.result()
        if self.stager is not None:
            self.stager.close()


class _Clock:
    def __init__(self, device: str) -> None:
        import lightning.pytorch as pl

        self.device, self.starts = device, []
        hooks = {"on_train_batch_start": self._start, "on_train_end": self._start}
        self.callback = type("Clock", (pl.Callback,), hooks)()

    def _start(self, *args: Any) -> None:
        _sync(self.device)
        self.starts.append(time.perf_counter())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def train_child(workdir: str, method: str, settings: dict, out: str) -> None:
    """One method's run (in its own process): writes ``{"step_s": [...], "state_gb": ...}`` to ``out``."""
    import lightning.pytorch as pl

    smoke = settings["smoke"]
    device = "cpu" if smoke else "cuda"
    shape = SMOKE_GPT if smoke else GPT
    callbacks, plugins, strategy = _callbacks(method, workdir, settings["every"], device)
    clock = _Clock(device)
    steps = settings["steps"]
    tokens = torch.randint(0, shape["vocab"], (steps * shape["batch"], shape["seq"]))
    trainer = pl.Trainer(
        accelerator=device,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        callbacks=[clock.callback, *(getattr(c, "callback", c) for c in callbacks)],
        plugins=plugins,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = _model(shape)
    dataset = torch.utils.data.TensorDataset(tokens)
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(dataset, batch_size=shape["batch"]))
    state = sum(p.numel() for p in model.parameters()) * 12  # fp32 weights + two AdamW moments
    skipped = len(plugins[0].checkpointer.skipped) if method == "dcp_async_skip" else 0
    shutil.rmtree(os.path.join(workdir, method), ignore_errors=True)
    with open(out, "w") as f:
        json.dump({"step_s": clock.steps(), "state_gb": state / 1e9, "skipped": skipped}, f)


def summarize(runs: dict[str, list[dict]], every: int) -> dict:
    """Per method: median step, step time over no saves, blocked per save (first apart), from each run's steps."""
    base_steps = [s for run in runs.get("none", []) for s in run["step_s"][1:]]
    median = statistics.median(base_steps) if base_steps else None
    base_mean = statistics.mean(base_steps) if base_steps else None
    summary: dict[str, Any] = {}
    for method, results in runs.items():
        first, later, means = [], [], []
        for run in results:
            steps = run["step_s"]
            means.append(statistics.mean(steps[1:]) if len(steps) > 1 else steps[0])
            if median is None or method == "none":
                continue
            # steps[i] ends with the checkpoint of global step i + 1 (ModelCheckpoint runs at the batch's end).
            saves = [i for i in range(len(steps)) if (i + 1) % every == 0]
            for n, i in enumerate(saves):
                blocked = sum(max(0.0, t - median) for t in steps[i : i + 2])
                (first if n == 0 else later).append(blocked)
        summary[method] = {
            "mean_step_s": statistics.median(means),
            "step_vs_none": statistics.median(means) / base_mean if base_mean else None,
            "first_save_blocked_s": statistics.median(first) if first else None,
            "blocked_per_save_s": statistics.median(later) if later else None,
            "blocked_per_save_max_s": max(later) if later else None,
            "skipped": results[0].get("skipped", 0),
        }
    return summary
