"""A one-process ``dcp_single_device`` run whose training step raises at step 3 (test_preemption.py).

Run as ``python -m tests.integration._failed_run_train DIR`` from the repository root. Once the run has failed, the
datamodule's ``on_exception`` (Lightning calls it after the callbacks', before the strategy's teardown) writes
``DIR/failed`` and sleeps 60 s, standing for a failed run's teardown that waits (for a save in flight, say).
"""

from __future__ import annotations

import os
import sys
import time

from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class _Failing(TinyModel):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 3:
            raise RuntimeError("the step failed")
        return super().training_step(batch, batch_idx)


class _Data(RandomDataModule):
    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def on_exception(self, exception: BaseException) -> None:
        open(os.path.join(self.directory, "failed"), "w").close()
        time.sleep(60)


def main() -> None:
    seed()
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=10, limit_val_batches=0)
    trainer.fit(_Failing(), datamodule=_Data(sys.argv[1]))


if __name__ == "__main__":
    main()
