"""The ``ckpt_path`` a ``dcp_*`` strategy restores at ``setup`` comes from Lightning's ``Trainer._run`` call itself.

``Trainer.fit`` resolves ``ckpt_path`` and hands it to ``Trainer._run``, which keeps it in a local variable;
``lightning_dcp._compat.lightning_hooks.install_run_hook`` keeps ``_run``'s arguments on the trainer while it runs
(checked against the installed Lightning's signature), instead of reading them from Python stack frames.
"""

from __future__ import annotations

import lightning
from lightning.pytorch import Callback, Trainer

from lightning_dcp._compat.lightning_hooks import RUN_ARGUMENTS
from lightning_dcp._compat.lightning_run import trainer_run_arguments
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer


class _Seen(Callback):
    def __init__(self) -> None:
        self.seen: list = []

    def setup(self, trainer, pl_module, stage) -> None:
        self.seen.append(trainer_run_arguments(trainer))


def test_the_installed_lightning_has_the_run_signature_the_hook_checks():
    assert getattr(Trainer._run, "_lightning_dcp_run_hook", False), f"Lightning {lightning.__version__}"


def test_the_run_arguments_are_on_the_trainer_during_its_run_only(tmp_path):
    first = make_trainer(1, strategy="dcp_single_device", max_epochs=-1, max_steps=2, default_root_dir=str(tmp_path))
    first.fit(TinyModel(), datamodule=RandomDataModule(n=8))
    first.save_checkpoint(str(tmp_path / "a.ckpt"))
    seen = _Seen()
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=-1, max_steps=4, callbacks=[seen])
    trainer.fit(TinyModel(), datamodule=RandomDataModule(n=8), ckpt_path=str(tmp_path / "a.ckpt"), weights_only=True)
    assert seen.seen == [(str(tmp_path / "a.ckpt"), True)]
    assert trainer.global_step == 4  # resumed from step 2
    assert trainer_run_arguments(trainer) is None and trainer.__dict__.get(RUN_ARGUMENTS) is None
    trainer.validate(TinyModel(), datamodule=RandomDataModule(n=8))
    assert seen.seen[-1] == (None, None)
