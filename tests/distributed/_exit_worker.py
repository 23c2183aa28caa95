"""One rank of tests/distributed/test_clean_exit.py: an async save, then a plain interpreter exit (no teardown).

Started as a script by the test, so that the interpreter's own exit runs. The report of what is left at exit is
registered before lightning_dcp is imported: ``atexit`` runs handlers last-first, so it runs after the package's exit
(``engine/shutdown.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch
import torch.distributed as dist


def _report(path: str) -> None:  # registered before lightning_dcp's: runs after its exit (LIFO)
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    with open(path, "w") as f:
        json.dump({"groups_at_exit": groups}, f)


atexit.register(_report, os.path.join(sys.argv[1], f"exit-{os.environ['RANK']}.json"))

from lightning_dcp.engine import Checkpointer, CheckpointerConfig  # noqa: E402  (after the report's registration)


def main(out: str, ckpt: str) -> None:
    dist.init_process_group("gloo")
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    before = len(dist.distributed_c10d._world.pg_map)
    checkpointer.save({"state_dict": {"w": torch.ones(64)}}, ckpt, objects={"step": 1}, collective=True)
    checkpointer.close()
    with open(os.path.join(out, f"run-{dist.get_rank()}.json"), "w") as f:
        json.dump({"groups_before": before, "groups_after_save": len(dist.distributed_c10d._world.pg_map)}, f)
    dist.barrier()  # the process then exits with the default group and the save's group as they are


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
