"""Incremental checkpoints through a real Trainer: bytes, time and disk per save vs full saves.

One process (``strategy="auto"`` on CPU) trains a model whose ``frozen`` fraction of parameter bytes is frozen
(``requires_grad=False``: Linear layers of ``layer_mib``, 4 MiB by default) and the rest trainable (AdamW: two
state tensors per parameter). After every optimizer step, in the same process and on the same state, it saves
with ``trainer.save_checkpoint`` twice, the order alternating (A B, B A, ...): once with ``DCPCheckpointIO()``
(``full``), once with ``DCPCheckpointIO(incremental=True)`` (``incremental``), each into its own directory,
``saves`` times. Reports per mode the median seconds per save after the first, the bytes of files newly written
per save (files whose inode no earlier checkpoint of that directory has), and the disk used by all ``saves``
checkpoints (allocated blocks, each inode counted once, as ``du`` counts hard links) vs one full checkpoint. Full
checkpoints are deleted as soon as they are measured (only the disk space of one is needed).

    python -m benchmarks.bench_incremental --total-mib 1024 --frozen 0.99 --saves 10
    python -m benchmarks.bench_incremental --total-mib 512 --frozen 0 --saves 10    # overhead when all changes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from torch import nn


def _model(total_mib: int, frozen: float, layer_mib: int) -> Any:
    from lightning.pytorch import LightningModule

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            side = int((layer_mib << 20) // 4) // 2048  # 2048 x side float32 = layer_mib
            n_frozen = round(total_mib * frozen / layer_mib)
            trainable_bytes = (total_mib << 20) - n_frozen * (layer_mib << 20)
            self.frozen = nn.ModuleList(nn.Linear(side, 2048, bias=False) for _ in range(n_frozen))
            self.frozen.requires_grad_(False)
            n_full, rest = divmod(trainable_bytes // 4, 2048 * side)
            layers = [nn.Linear(side, 2048, bias=False) for _ in range(n_full)]
            if rest >= side:
                layers.append(nn.Linear(side, rest // side, bias=False))
            self.trainable = nn.ModuleList(layers)

        def training_step(self, batch, batch_idx):
            x = batch[0]
            return sum((layer.weight.sum() * x.mean() for layer in self.trainable), torch.zeros(()))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.trainable.parameters(), lr=1e-3)

    return Model()


def _tree_bytes(path: str, seen: set[int]) -> tuple[int, int]:
    """``(bytes of files in path, bytes of files whose inode is not in seen)``; adds the inodes to ``seen``."""
    total = new = 0
    for name in os.listdir(path):
        info = os.stat(os.path.join(path, name))
        total += info.st_size
        if info.st_ino not in seen:
            new += info.st_size
            seen.add(info.st_ino)
    return total, new


def _disk(paths: list[str]) -> int:
    """Allocated bytes of the files under ``paths``, each inode once (what ``du`` reports for hard links)."""
    inodes = {}
    for path in paths:
        for name in os.listdir(path):
            info = os.stat(os.path.join(path, name))
            inodes[info.st_ino] = info.st_blocks * 512
    return sum(inodes.values())


def run(*, total_mib: int, frozen: float, saves: int, root: str, layer_mib: int = 4) -> dict[str, Any]:
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dcp import DCPCheckpointIO

    modes = {"full": DCPCheckpointIO(), "incremental": DCPCheckpointIO(incremental=True)}
    results: dict[str, dict[str, list]] = {m: {"seconds": [], "new_bytes": [], "total_bytes": []} for m in modes}
    seen: dict[str, set[int]] = {m: set() for m in modes}
    kept: dict[str, list[str]] = {m: [] for m in modes}

    class Saver(Callback):
        def on_train_batch_end(self, trainer, *args: Any) -> None:
            step = trainer.global_step
            order = list(modes) if step % 2 else list(reversed(modes))
            for mode in order:
                trainer.strategy.checkpoint_io = modes[mode]
                path = os.path.join(root, mode, f"step{step:03d}")
                started = time.perf_counter()
                trainer.save_checkpoint(path)
                results[mode]["seconds"].append(time.perf_counter() - started)
                total, new = _tree_bytes(path, seen[mode])
                results[mode]["total_bytes"].append(total)
                results[mode]["new_bytes"].append(new)
                kept[mode].append(path)
            if len(kept["full"]) == 1:
                results["full"]["one_disk"] = [_disk(kept["full"][:1])]
            for path in kept["full"][1:]:  # keep one full checkpoint only (disk space)
                shutil.rmtree(path)
            del kept["full"][1:]

    model = _model(total_mib, frozen, layer_mib)
    data = DataLoader(TensorDataset(torch.randn(saves * 2, 4)), batch_size=2)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=saves,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Saver()],
        plugins=[modes["full"]],
    )
    trainer.fit(model, data)
    full, incremental = results["full"], results["incremental"]
    later = slice(1, None)
    summary = {
        "total_mib": total_mib,
        "frozen": frozen,
        "trainable_params_mib": sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) / (1 << 20),
        "saves": saves,
        "full_bytes": full["total_bytes"][-1],
        "full_seconds_median": statistics.median(full["seconds"][later]),
        "incremental_seconds_median": statistics.median(incremental["seconds"][later]),
        "incremental_new_bytes_median": statistics.median(incremental["new_bytes"][later]),
        "incremental_first_seconds": incremental["seconds"][0],
        "full_first_seconds": full["seconds"][0],
        "disk_one_full": full["one_disk"][0],
        "disk_all_incremental": _disk(kept["incremental"]),
        "incremental_stats_last": vars(modes["incremental"].checkpointer.incremental.stats),
        "seconds": {m: [round(s, 4) for s in r["seconds"]] for m, r in results.items()},
        "new_bytes": {m: r["new_bytes"] for m, r in results.items()},
    }
    summary["bytes_ratio"] = summary["incremental_new_bytes_median"] / summary["full_bytes"]
    summary["time_ratio"] = summary["incremental_seconds_median"] / summary["full_seconds_median"]
    pairs = [i / f for i, f in zip(incremental["seconds"][later], full["seconds"][later], strict=True)]
    summary["time_ratio_paired_median"] = statistics.median(pairs)
    summary["time_ratio_total"] = sum(incremental["seconds"][later]) / sum(full["seconds"][later])
    summary["disk_ratio"] = summary["disk_all_incremental"] / summary["disk_one_full"]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mib", type=int, default=512, help="parameter bytes of the model (MiB)")
    parser.add_argument("--frozen", type=float, default=0.99, help="fraction of parameter bytes frozen (0..1)")
    parser.add_argument("--saves", type=int, default=10, help="saves per mode (one per optimizer step)")
    parser.add_argument("--layer-mib", type=int, default=4, help="bytes of each Linear layer's weight (MiB)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    root = tempfile.mkdtemp(prefix="bench_incremental_", dir=args.dir)
    try:
        print(
            json.dumps(
                run(
                    total_mib=args.total_mib, frozen=args.frozen, saves=args.saves, root=root, layer_mib=args.layer_mib
                ),
                indent=1,
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
