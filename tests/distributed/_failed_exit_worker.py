"""One rank of tests/distributed/test_failed_exit.py: a 2-rank ``dcp_ddp`` fit that fails at step 3, or finishes.

Started as a script per rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` set: Lightning launches nothing). An ``atexit``
handler registered before anything else runs after every later one (LIFO) and writes ``gc.get_freeze_count()``
there: how many objects the interpreter's last collections will skip.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys

from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


def _report(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(gc.get_freeze_count()))


class _Failing(TinyModel):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 3:
            raise RuntimeError("the step failed")
        return super().training_step(batch, batch_idx)


def main(out: str, mode: str) -> None:
    atexit.register(_report, os.path.join(out, f"frozen-{os.environ['RANK']}"))
    seed()
    model = _Failing() if mode == "fail" else TinyModel()
    trainer = make_trainer(2, strategy="dcp_ddp", max_steps=5, limit_val_batches=0)
    trainer.fit(model, datamodule=RandomDataModule())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
