"""A script whose last checkpoint is an async save it never waits for; run by test_exit.py.

Run as ``python -m tests.integration._async_exit KIND DIR`` from the repository root. ``KIND``: ``engine`` (the
``Checkpointer`` used directly) or ``fabric`` (``Fabric(strategy=DCPSingleDeviceStrategy(async_save=True))``, a
training loop like most Fabric scripts: it saves at its end and returns, never calling ``wait_for_save()``). The
saves are large enough (64 MiB) that the process reaches its exit while the last one is still being written.
Prints ``SAVED <path>`` for each save it made.
"""

from __future__ import annotations

import os
import sys

import torch


def engine(directory: str) -> None:
    from lightning_dcp.engine import Checkpointer, CheckpointerConfig

    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    for step in (1, 2):
        path = os.path.join(directory, f"step-{step}")
        tree = {"state_dict": {f"w{i}": torch.full((1 << 20,), float(step)) for i in range(16)}}
        checkpointer.save(tree, path, objects={"step": step}, step=step)
        print("SAVED", path, flush=True)


def fabric(directory: str) -> None:
    from lightning.fabric import Fabric

    from lightning_dcp.fabric import DCPSingleDeviceStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=DCPSingleDeviceStrategy(async_save=True))
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(16)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for step in (1, 2):
        optimizer.zero_grad()
        model(torch.randn(4, 1024)).sum().backward()
        optimizer.step()
        path = os.path.join(directory, f"step-{step}")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
        print("SAVED", path, flush=True)


if __name__ == "__main__":
    {"engine": engine, "fabric": fabric}[sys.argv[1]](sys.argv[2])
