"""One rank of tests/distributed/test_clean_exit.py: an async save, then a plain interpreter exit (no teardown).

Started as a script by the test (``multiprocessing`` children skip ``atexit``, which is what is tested here).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch
import torch.distributed as dist

from lightning_dcp.engine.checkpointer import Checkpointer


def _report(path: str) -> None:  # registered first: runs after every handler registered later (LIFO)
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    with open(path, "w") as f:
        json.dump({"groups_at_exit": groups}, f)


def main(out: str, ckpt: str) -> None:
    dist.init_process_group("gloo")
    atexit.register(_report, os.path.join(out, f"exit-{dist.get_rank()}.json"))
    checkpointer = Checkpointer(async_save=True)
    before = len(dist.distributed_c10d._world.pg_map)
    checkpointer.save({"state_dict": {"w": torch.ones(64)}}, ckpt, objects={"step": 1}, collective=True)
    checkpointer.close()
    with open(os.path.join(out, f"run-{dist.get_rank()}.json"), "w") as f:
        json.dump({"groups_before": before, "groups_after_save": len(dist.distributed_c10d._world.pg_map)}, f)
    dist.barrier()  # the process then exits with the default group and the save's group as they are


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
