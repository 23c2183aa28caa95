"""A Fabric worker of ``torchrun --nproc-per-node 2 --max-restarts 1`` (test_elastic_restart.py).

``Fabric(strategy="dcp_ddp")`` on CPU: every step all-reduces; in the first attempt rank 1 SIGKILLs itself after
step 3. The restarted attempt must set up its process group and finish; each rank then writes ``W/done-{rank}``
with its attempt.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from lightning.fabric import Fabric

import lightning_dcp  # noqa: F401  (registers the dcp_* names)


def main() -> None:
    workdir = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    fabric = Fabric(accelerator="cpu", devices=2, strategy="dcp_ddp")
    fabric.launch()
    total = torch.zeros(1)
    for step in range(6):
        total += fabric.all_reduce(torch.ones(1), reduce_op="sum")
        if attempt == 0 and step == 3 and fabric.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(workdir, f"done-{fabric.global_rank}"), "w") as f:
        f.write(f"{attempt} {int(total.item())}")


if __name__ == "__main__":
    main()
