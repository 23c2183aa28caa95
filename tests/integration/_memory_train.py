"""One node of a simulated multi-node run with the memory tier (``tests/integration/test_memory_tier.py`` and the chaos
campaign's memory pass): ``strategy="dcp_ddp"`` on ``--nodes`` x ``--devices`` CPU processes over loopback, a memory
checkpoint every 2 steps (``MemoryCheckpoint``, K=1 replica), every 3rd persisted to ``--durable``.

Run as ``python -m tests.integration._memory_train --workdir W --memory M --node J --nodes N ...`` with ``NODE_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set (Lightning's launcher starts the node's other ranks). Every rank appends JSON
lines to ``W/log-{rank}.jsonl``: ``{"event": "resumed", "step", "hash"}`` at the start of training and ``{"event":
"saved", "step", "hash"}`` after each memory save (the hash covers the weights and the optimizer state, which DDP
keeps identical on every rank and at every world size).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, MemoryCheckpoint
from tests._models import DropoutModel, RandomDataModule
from tests._trainer import make_trainer, seed, snapshot


def state_hash(trainer) -> str:
    """A digest of the weights and optimizer state (full, FQN-keyed; the same on every DDP rank)."""
    state = snapshot(trainer)
    digest = hashlib.sha256()
    for key, value in sorted(state["params"].items()):
        digest.update(key.encode() + value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(repr(sorted((k, str(v)) for k, v in _flat(state["optimizers"]))).encode())
    return digest.hexdigest()[:16]


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}/{i}")
    elif isinstance(obj, torch.Tensor):
        yield (
            prefix,
            hashlib.sha256(obj.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16],
        )
    else:
        yield prefix, obj


class Recorder(Callback):
    def __init__(self, path: str, every: int) -> None:
        self.path, self.every = path, every

    def _log(self, **entry) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        self._log(event="resumed", step=trainer.global_step, hash=state_hash(trainer), world=trainer.world_size)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step % self.every == 0:
            self._log(event="saved", step=trainer.global_step, hash=state_hash(trainer))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--memory", required=True, help="this node's memory area")
    parser.add_argument("--durable", required=True, help="the durable dirpath (persisted checkpoints)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sync", action="store_true", help="synchronous memory saves")
    args = parser.parse_args(argv)
    seed()
    every = 2
    memory = MemoryCheckpoint(
        args.memory,
        every_n_train_steps=every,
        replicas=1,
        persist_every=3,
        async_save=not args.sync,
        dirpath=args.durable,
    )
    rank = int(os.environ.get("NODE_RANK", "0")) * args.devices + int(os.environ.get("LOCAL_RANK", "0"))
    recorder = Recorder(os.path.join(args.workdir, f"log-{rank}.jsonl"), every)
    trainer = make_trainer(
        args.devices,
        num_nodes=args.nodes,
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=[memory, recorder],
        plugins=[DCPCheckpointIO()],
        limit_val_batches=0,
    )
    trainer.fit(DropoutModel(hidden=args.hidden), datamodule=RandomDataModule(n=64, batch_size=4), ckpt_path="last")


if __name__ == "__main__":
    main()
