"""One rank of tests/distributed/test_failed_exit.py: a 2-rank ``dcp_ddp`` fit that fails at step 3, or finishes.

Started as a script per rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` set: Lightning launches nothing). The model
keeps a journal: a buffered file that it writes a line to at each step and never closes, held in a reference cycle
(the model and its journal refer to each other), as user code often holds one. Only the interpreter's last
collections flush and close it: with stock Lightning every line reaches the file, whether the run finishes or fails.
"""

from __future__ import annotations

import os
import sys

from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class _Journal:
    def __init__(self, path: str, owner: object) -> None:
        self.file = open(path, "w", buffering=1 << 20)  # noqa: SIM115  (never closed by the user: that is the point)
        self.owner = owner  # a reference cycle: freed by the collector, not by reference counting


class _Journaling(TinyModel):
    def __init__(self, path: str, fail: bool) -> None:
        super().__init__()
        self.journal = _Journal(path, self)
        self.fail = fail

    def training_step(self, batch, batch_idx):
        self.journal.file.write(f"step {self.trainer.global_step}\n")
        if self.fail and self.trainer.global_step == 3:
            raise RuntimeError("the step failed")
        return super().training_step(batch, batch_idx)


def main(out: str, mode: str) -> None:
    seed()
    model = _Journaling(os.path.join(out, f"journal-{os.environ['RANK']}"), fail=mode == "fail")
    trainer = make_trainer(2, strategy="dcp_ddp", max_steps=5, limit_val_batches=0)
    trainer.fit(model, datamodule=RandomDataModule())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
