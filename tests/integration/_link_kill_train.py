"""A one-process fit with Lightning's own ``ModelCheckpoint(save_last="link")`` and ``DCPCheckpointIO``.

Run as ``python -m tests.integration._link_kill_train DIRPATH MAX_STEPS CKPT_PATH KILL_AT`` from the repository root
(``CKPT_PATH``: ``-`` for none, ``last``, or a checkpoint's path). With ``KILL_AT`` > 0 the process SIGKILLs itself
inside Lightning's ``_link_checkpoint`` for the ``KILL_AT``-th link, after the old ``last.ckpt`` was removed and
before the new one is made: the one moment a directory of committed checkpoints has no ``last*.ckpt`` at all.
Writes ``DIRPATH/../resumed.json`` (the step the fit started from) and ``DIRPATH/../final.pt`` (the model's state at
the end).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dcp import DCPCheckpointIO
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class StartStep(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        with open(self.out, "w") as f:
            json.dump({"start_step": trainer.global_step}, f)


def _kill_inside_link(kill_at: int) -> None:
    """SIGKILL this process at the ``kill_at``-th symlink of a ``last*.ckpt``: after the old link is gone."""
    symlink, seen = os.symlink, [0]

    def symlink_or_die(src, dst, *args, **kwargs):
        if os.path.basename(os.fspath(dst)).startswith("last"):
            seen[0] += 1
            if seen[0] == kill_at:
                assert not os.path.lexists(dst)  # Lightning removed the old link a moment ago
                os.kill(os.getpid(), signal.SIGKILL)
        return symlink(src, dst, *args, **kwargs)

    os.symlink = symlink_or_die


def main() -> None:
    dirpath, max_steps, ckpt_path, kill_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    out = os.path.dirname(dirpath.rstrip("/"))
    os.makedirs(out, exist_ok=True)
    if kill_at:
        _kill_inside_link(kill_at)
    seed()
    callback = ModelCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_train_steps=4, save_top_k=-1, save_last="link"
    )
    trainer = make_trainer(
        1,
        strategy="auto",
        max_epochs=-1,
        max_steps=max_steps,
        callbacks=[callback, StartStep(os.path.join(out, "resumed.json"))],
        plugins=[DCPCheckpointIO()],
    )
    trainer.fit(TinyModel(), datamodule=RandomDataModule(n=16), ckpt_path=None if ckpt_path == "-" else ckpt_path)
    torch.save({k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}, os.path.join(out, "final.pt"))


if __name__ == "__main__":
    main()
