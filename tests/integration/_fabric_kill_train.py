"""Training run used by test_fabric_kill.py: a hand-written Fabric loop (dcp_ddp, one rank), an async save every step.

Run as ``python -m tests.integration._fabric_kill_train DIR STEPS`` from the repository root. It resumes from the
newest committed checkpoint in ``DIR/ckpts`` and writes ``DIR/final.pt`` when training completes.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_dcp.fabric import DCPDDPStrategy, latest_checkpoint


def main() -> None:
    directory, steps = sys.argv[1], int(sys.argv[2])
    ckpt_dir = os.path.join(directory, "ckpts")
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DCPDDPStrategy(async_save=True))
    fabric.launch()
    fabric.seed_everything(11, verbose=False)
    # ~2.1M parameters: 8.4 MB of weights + 16.8 MB of AdamW state, so a background write takes a while
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.2), nn.Linear(1024, 1024))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    resume = fabric.broadcast(latest_checkpoint(ckpt_dir) if fabric.is_global_zero else None)
    if resume is not None:
        fabric.load(resume, state)
    while state["step"] < steps:
        batch = torch.randn(8, 1024, generator=torch.Generator().manual_seed(1000 * state["step"] + fabric.global_rank))
        fabric.backward(model(batch).square().mean())  # dropout draws from each rank's RNG, restored on resume
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        fabric.save(os.path.join(ckpt_dir, f"step-{state['step']:04d}"), state)
    fabric.strategy.wait_for_save()
    if fabric.is_global_zero:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(directory, "final.pt"))


if __name__ == "__main__":
    main()
