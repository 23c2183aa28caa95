"""Saves requested faster than the disk takes them: the loop's blocked time per save under each ``when_busy`` policy.

A one-process Trainer (``dcp_single_device``) trains a tiny model beside a large buffer (``--size-gb`` of state,
changed by every forward pass, so each save copies it at the call and writes it in the background) and saves through
``DCPCheckpointIO(async_save=True, when_busy=...)`` every ``--every`` steps. Per policy it reports the step wall times
(``on_train_batch_start`` to the next), the blocked time per save (a save step's excess over the median step of the
run without saves), and how many saves were committed and skipped::

    python -m benchmarks.bench_when_busy --size-gb 0.25 --steps 24 --every 1 --repeats 2
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from benchmarks._cli import bench_main
from lightning_dcp import DCPCheckpointIO
from lightning_dcp.engine import Location, committed_checkpoints


class _Model(LightningModule):
    def __init__(self, size_gb: float) -> None:
        super().__init__()
        self.register_buffer("big", torch.zeros(max(1, int(size_gb * 2**30 / 4 / 4096)), 4096))
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.big[batch_idx % self.big.shape[0]].add_(1.0)
        return self.head(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())

    def times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def _fit(size_gb: float, workdir: str, steps: int, every: int, policy: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    timer = _StepTimes()
    callbacks: list[Callback] = [timer]
    plugins = []
    dirpath = tempfile.mkdtemp(dir=workdir)
    if policy is not None:
        callbacks.append(ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=every, save_top_k=-1))
        plugins.append(DCPCheckpointIO(async_save=True, when_busy=policy))
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy="dcp_single_device",
        max_steps=steps,
        callbacks=callbacks,
        plugins=plugins,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=policy is not None,
    )
    data = DataLoader(TensorDataset(torch.randn(4 * steps, 8)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(_Model(size_gb), train_dataloaders=data)
    result: dict[str, Any] = {"step_s": timer.times()}
    if policy is not None:
        io = plugins[0]
        result["skipped"] = len(io.checkpointer.skipped)
        result["committed"] = len(committed_checkpoints(Location(dirpath)))
    return result


def run(size_gb: float, workdir: str, *, repeats: int = 2, steps: int = 24, every: int = 1, **_: Any) -> dict[str, Any]:
    """Per policy and repeat: median step, blocked per save (mean, max; the first save apart), committed, skipped."""
    rounds = []
    for _ in range(repeats):
        plain = _fit(size_gb, workdir, steps, every, None)
        median = statistics.median(plain["step_s"][1:])
        row: dict[str, Any] = {"no_saves_median_step_s": round(median, 4)}
        for policy in ("wait", "skip"):  # alternated within the round
            fit = _fit(size_gb, workdir, steps, every, policy)
            times = fit["step_s"]
            # The step whose on_train_batch_end saved, and the next one (what a save's write may keep waiting).
            blocked = [max(0.0, t - median) for i, t in enumerate(times) if (i + 1) % every == 0]
            row[policy] = {
                "first_save_blocked_s": round(blocked[0], 4),
                "blocked_per_save_mean_s": round(statistics.mean(blocked[1:]), 4),
                "blocked_per_save_max_s": round(max(blocked[1:]), 4),
                "committed": fit["committed"],
                "skipped": fit["skipped"],
            }
        rounds.append(row)
    return {"size_gb": size_gb, "steps": steps, "every": every, "host_cpus": os.cpu_count(), "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    return bench_main(
        run,
        argv,
        doc=__doc__,
        default_size_gb=0.25,
        prefix="lightning_dcp-busy-",
        options={"--steps": {"type": int, "default": 24}, "--every": {"type": int, "default": 1}},
    )


if __name__ == "__main__":
    raise SystemExit(main())
