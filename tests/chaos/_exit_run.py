"""One process of the exit campaign (tests/chaos/exits.py): a short run that checkpoints, then ends as a script ends.

Run as ``python -m tests.chaos._exit_run CONFIG_JSON`` from the repository root, once per rank (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set by the campaign: Lightning launches nothing, so
every rank's own exit code is seen). CONFIG_JSON holds ``dir``, ``case`` (a name of :data:`CASES`), ``world_size``,
``steps`` and ``every``. The run's final checkpoint is named ``final`` (Trainer: ``step=<steps>.ckpt`` under
``dir/ckpts``; Fabric: ``dir/ckpts/step-<steps>``); rank 0 prints ``FINAL <path>`` once its last save call returned.
Nothing waits for a background save before the script ends: the process's own exit must finish it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CASES: dict[str, dict[str, Any]] = {
    # Trainer, one process
    "trainer-single-sync": {"front": "trainer", "strategy": "dcp_single_device", "async": False, "ranks": 1},
    "trainer-single-async": {"front": "trainer", "strategy": "dcp_single_device", "async": True, "ranks": 1},
    # Trainer, 2 ranks
    "trainer-ddp-sync": {"front": "trainer", "strategy": "dcp_ddp", "async": False, "ranks": 2},
    "trainer-ddp-async": {"front": "trainer", "strategy": "dcp_ddp", "async": True, "ranks": 2},
    "trainer-fsdp2-async": {"front": "trainer", "strategy": "dcp_model_parallel", "async": True, "ranks": 2},
    "trainer-memory-ddp": {"front": "trainer", "strategy": "dcp_ddp", "async": False, "ranks": 2, "memory": True},
    "trainer-stock-ddp-plugin": {"front": "trainer", "strategy": "ddp", "async": True, "ranks": 2},
    # Fabric: saves at its end and never calls wait_for_save(), as most Fabric loops do
    "fabric-single-async": {"front": "fabric", "strategy": "dcp_single_device", "async": True, "ranks": 1},
    "fabric-ddp-async": {"front": "fabric", "strategy": "dcp_ddp", "async": True, "ranks": 2},
    "fabric-fsdp2-sync": {"front": "fabric", "strategy": "dcp_model_parallel", "async": False, "ranks": 2},
    # The baseline: stock Lightning, nothing of lightning_dcp imported
    "stock-ddp": {"front": "stock", "strategy": "ddp", "async": False, "ranks": 2},
    "stock-single": {"front": "stock", "strategy": "auto", "async": False, "ranks": 1},
}

WIDTH = 512  # 4 layers x 512^2 floats + AdamW: ~12 MB of state, saves that take a moment on a loaded machine


def _model() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(128, WIDTH, generator=g)), batch_size=4)


def trainer_run(config: dict[str, Any], case: dict[str, Any]) -> None:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()

        def configure_model(self) -> None:
            if case["strategy"] == "dcp_model_parallel":
                from torch.distributed.fsdp import fully_shard

                for layer in self.body:
                    fully_shard(layer, mesh=self.device_mesh)
                fully_shard(self.body, mesh=self.device_mesh)

        def training_step(self, batch, batch_idx):
            return self.body(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Final(ModelCheckpoint):
        def on_train_end(self, trainer, pl_module) -> None:
            super().on_train_end(trainer, pl_module)
            if trainer.is_global_zero:
                print("FINAL", os.path.join(self.dirpath, f"step={config['steps']}.ckpt"), flush=True)

    directory = os.path.join(config["dir"], "ckpts")
    plugins, callbacks = [], []
    if case["front"] == "trainer":
        import lightning_dcp

        plugins = [lightning_dcp.DCPCheckpointIO(async_save=case["async"])]
        if case.get("memory"):
            callbacks.append(
                lightning_dcp.MemoryCheckpoint(
                    os.path.join(config["dir"], "shm"), every_n_train_steps=config["every"], persist_every=2
                )
            )
    callbacks.append(
        Final(dirpath=directory, filename="{step}", every_n_train_steps=config["every"], save_top_k=-1, save_last=False)
    )
    strategy = case["strategy"]
    if strategy == "dcp_model_parallel":
        from lightning_dcp import DCPModelParallelStrategy

        strategy = DCPModelParallelStrategy(data_parallel_size=config["world_size"], tensor_parallel_size=1)
    trainer = Trainer(
        accelerator="cpu",
        devices=config["world_size"],
        strategy=strategy,
        plugins=plugins,
        callbacks=callbacks,
        max_steps=config["steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), _data())


def fabric_run(config: dict[str, Any], case: dict[str, Any]) -> None:
    from lightning.fabric import Fabric

    import lightning_dcp.fabric as dcp_fabric

    strategies = {
        "dcp_single_device": lambda: dcp_fabric.DCPSingleDeviceStrategy(async_save=case["async"]),
        "dcp_ddp": lambda: dcp_fabric.DCPDDPStrategy(async_save=case["async"]),
        "dcp_model_parallel": lambda: dcp_fabric.DCPModelParallelStrategy(async_save=case["async"]),
    }
    fabric = Fabric(accelerator="cpu", devices=config["world_size"], strategy=strategies[case["strategy"]]())
    fabric.launch()
    model = _model()
    if case["strategy"] == "dcp_model_parallel":
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    loader = fabric.setup_dataloaders(_data())
    step = 0
    for (x,) in loader:
        optimizer.zero_grad()
        fabric.backward(model(x).square().mean())
        optimizer.step()
        step += 1
        if step % config["every"] == 0:
            path = os.path.join(config["dir"], "ckpts", f"step-{step}")
            fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
            if step == config["steps"] and fabric.global_rank == 0:
                print("FINAL", path, flush=True)
        if step == config["steps"]:
            break


def main() -> None:
    config = json.loads(sys.argv[1])
    case = CASES[config["case"]]
    torch.manual_seed(0)
    (fabric_run if case["front"] == "fabric" else trainer_run)(config, case)
    print("DONE", os.environ.get("RANK", "0"), flush=True)


if __name__ == "__main__":
    main()
