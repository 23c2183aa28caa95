"""A 2-rank ``dcp_ddp`` run on CPU (Lightning's launcher) that one rank signals at a given step (test_preemption.py).

The loader is a user's own stateful one (tests._loaders, 6 steps per epoch), so a resume mid-epoch continues exactly.

Run as ``python -m tests.integration._preempt_train DIR MAX_STEPS SIGNAL_STEP SIGNAL_RANK SIGNAL [STUCK_AFTER]``
from the repository root (``SIGNAL_STEP`` -1: never). The signalled rank sends ``SIGNAL`` to itself at the start of
that step (``SIGSTOP``: a rank whose host vanished, its connections open). ``STUCK_AFTER`` (seconds, or ``none``):
the run's own ``Preemption(stuck_after=...)``. Every rank writes its pid to ``DIR/pid-{rank}`` at the start.
``fit(ckpt_path="last")``. Every rank appends JSON lines to ``DIR/log-{rank}.jsonl``: ``step`` (with the state's
hash, tests.integration._memory_train.state_hash) after each step, ``resumed`` at the start of training, ``stopped``
(with the hash) when the run stops for a signal.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_dcp import DCPCheckpointIO
from lightning_dcp.trainer.preemption import Preemption
from tests._loaders import LoaderDataModule
from tests._models import IdLoggingModel
from tests._trainer import make_trainer, seed
from tests.integration._memory_train import state_hash


class _Log(Callback):
    def __init__(self, directory: str, signal_step: int, signal_rank: int, signum: int) -> None:
        self.directory, self.signal_step, self.signal_rank, self.signum = directory, signal_step, signal_rank, signum

    def _log(self, trainer, **entry) -> None:
        with open(os.path.join(self.directory, f"log-{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps({**entry, "step": trainer.global_step, "hash": state_hash(trainer)}) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        with open(os.path.join(self.directory, f"pid-{trainer.global_rank}"), "w") as f:
            f.write(str(os.getpid()))
        self._log(trainer, event="resumed")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.signal_step and trainer.global_rank == self.signal_rank:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self._log(trainer, event="step")

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException):
            self._log(trainer, event="stopped", code=exception.code)


def main() -> None:
    directory, max_steps, signal_step, signal_rank = sys.argv[1], *map(int, sys.argv[2:5])
    signum = getattr(signal, sys.argv[5])
    stuck = sys.argv[6:7]
    preemption = [Preemption(stuck_after=None if stuck[0] == "none" else float(stuck[0]))] if stuck else []
    seed()
    trainer = make_trainer(
        2,
        max_steps=max_steps,
        max_epochs=-1,
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(directory, "ckpts"), save_top_k=0),
            _Log(directory, signal_step, signal_rank, signum),
            *preemption,
        ],
        plugins=[DCPCheckpointIO()],
        limit_val_batches=0,
    )
    trainer.fit(IdLoggingModel(), datamodule=LoaderDataModule("own", batch_size=4), ckpt_path="last")


if __name__ == "__main__":
    main()
