"""A worker of ``torchrun --nproc-per-node 2 --max-restarts N``: ``dcp_ddp`` on CPU with the memory tier, and a kill.

Run as ``python -m torch.distributed.run ... -m tests.integration._elastic_train --workdir W --kill-at K``. In the
first attempt (``TORCHELASTIC_RESTART_COUNT=0``) rank ``--kill-rank`` (``-1``: every rank) SIGKILLs itself after
optimizer step K; the agent restarts every worker, and ``fit(ckpt_path="last")`` resumes from the newest memory
checkpoint. Every rank appends JSON lines to ``W/log-{rank}.jsonl`` (``tests.integration._memory_train.Recorder``:
``saved`` with the state's hash after each memory save, ``resumed`` at the start of training), each with its attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, MemoryCheckpoint
from tests._models import DropoutModel, RandomDataModule
from tests._trainer import make_trainer, seed
from tests.integration._memory_train import Recorder

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class _AttemptRecorder(Recorder):
    def _log(self, **entry) -> None:
        super()._log(attempt=ATTEMPT, **entry)

    def on_train_end(self, trainer, pl_module) -> None:
        self._log(event="done", step=trainer.global_step)


class _Kill(Callback):
    """SIGKILL at ``step`` once the memory save in flight has committed: the newest memory checkpoint is then known
    (a save cut short by the kill is a different case, tests/chaos/memory.py's)."""

    def __init__(self, step: int, rank: int, memory: MemoryCheckpoint) -> None:
        self.step, self.rank, self.memory = step, rank, memory

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if ATTEMPT == 0 and trainer.global_step == self.step:
            self.memory.tier.wait()  # on every rank: the save's transfers need both
            if self.rank in (-1, trainer.global_rank):
                os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--kill-at", type=int, default=7)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=10)
    args = parser.parse_args(argv)
    seed()
    rank = int(os.environ["RANK"])
    memory = MemoryCheckpoint(
        os.path.join(args.workdir, "memory"), every_n_train_steps=args.every, dirpath=os.path.join(args.workdir, "d")
    )
    recorder = _AttemptRecorder(os.path.join(args.workdir, f"log-{rank}.jsonl"), args.every)
    trainer = make_trainer(
        2,
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=[memory, recorder, _Kill(args.kill_at, args.kill_rank, memory)],
        plugins=[DCPCheckpointIO()],
        limit_val_batches=0,
    )
    trainer.fit(DropoutModel(hidden=64), datamodule=RandomDataModule(n=64, batch_size=4), ckpt_path="last")


def read_log(workdir: str, rank: int) -> list[dict]:
    with open(os.path.join(workdir, f"log-{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


if __name__ == "__main__":
    main()
