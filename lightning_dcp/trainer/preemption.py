"""Preemption for the Trainer: a SIGTERM or SIGUSR1 sets a flag; at the next step's end every rank saves and exits.

A scheduler that preempts a job sends SIGTERM (SLURM with ``--signal``, torchrun's agent, Kubernetes) or SIGUSR1
(SLURM's requeue signal) and gives it a grace period. Lightning 2.6's handlers run collectives inside the signal
handler (its SIGTERM handler broadcasts; its SLURM requeue handler saves a whole checkpoint), which deadlock against
the collective the interrupted main thread was in; and its loop stops only on rank 0's flag (a rank that alone got the
signal stops alone and the others hang at their next collective).

Here the handlers only record the signal (and forward SIGTERM to the processes Lightning launched, as Lightning's
does). At the end of every training step (after the callbacks that save at that step, e.g.
:class:`~lightning_dcp.trainer.memory.MemoryCheckpoint`) the ranks agree with one all-reduce whether any of them was
signalled; if so, every rank saves the step's checkpoint and the run stops with Lightning's ``SIGTERMException``,
whose exit status is ``128 + signal`` (143 for SIGTERM, 138 for SIGUSR1: what a process killed by the signal reports).
Where the checkpoint goes:

- with a ``MemoryCheckpoint``: into the memory tier (unless it saved this step already), then its ``on_exception``
  persists the newest memory checkpoint to its ``dirpath``;
- under SLURM: Lightning's ``hpc_ckpt_{n}.ckpt`` in ``default_root_dir``, which a requeued job resumes by itself;
  with ``SLURMEnvironment(auto_requeue=True)`` and its requeue signal, rank 0 then runs ``scontrol requeue``;
- else: ``last-preempted.ckpt`` in the first ``ModelCheckpoint``'s ``dirpath`` (``fit(ckpt_path="last")`` finds it),
  or in ``default_root_dir`` without one.

Repeated signals change nothing (Lightning's launcher forwards SIGTERM to the ranks it started, which may have had
it already). A rank stuck inside one C call (a collective with a peer whose host vanished) cannot run a Python
handler at all: ``stuck_after`` seconds after the signal, :class:`~lightning_dcp.engine.SignalWatch` forwards it to
the processes Lightning launched and ends the process with status ``128 + signal``, rather than waiting for the
scheduler's SIGKILL (torchelastic's agent sends it 30 s after its SIGTERM). Once the run has failed (``on_exception``,
before the teardown, which may wait for a save in flight), every signal gets the handler it had before ``fit`` back:
a SIGTERM then ends a failed run's teardown as it would end any process, instead of being recorded for a step that
never comes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_dcp._compat.lightning_run import restore_signal_handlers
from lightning_dcp.engine import SignalWatch
from lightning_dcp.trainer.memory import memory_checkpoint_of

__all__ = ["Preemption", "install_preemption"]

log = logging.getLogger(__name__)

PREEMPTED_NAME = "last-preempted"
"""File name (before the extension) of the checkpoint saved at a signal without a memory tier or SLURM."""


class Preemption(Callback):
    """Records SIGTERM/SIGUSR1 in flag-only handlers; at each step's end the ranks agree, save, and stop together.

    Installed by the ``dcp_*`` strategies at ``on_train_start`` (``install_preemption``), last among the
    callbacks; at the end of the run Lightning's signal connector gives each signal back to its earlier handler.
    With gradient accumulation the ranks agree at every batch's end (they may stop between a step's micro-batches).
    To change ``stuck_after``, pass your own instance in the Trainer's ``callbacks``.

    Args:
        stuck_after: Seconds after a signal by which the main thread must have run the handler, else the process
            ends with status ``128 + signal`` (``SignalWatch``); ``None``: never.
    """

    def __init__(self, *, stuck_after: float | None = SignalWatch.STUCK_AFTER_S) -> None:
        self.stuck_after = stuck_after
        self.received: int | None = None
        """The signal received by this rank since the last step's end, if any."""
        self.stopped_by: int | None = None
        """The signal the ranks stopped for (on every rank), once they did."""
        self._previous: dict[int, Any] = {}
        self._trainer: pl.Trainer | None = None
        self._watch: SignalWatch | None = None

    def signals(self, trainer: pl.Trainer) -> list[int]:
        """SIGTERM and the requeue signal (SLURM's, else SIGUSR1)."""
        environment = trainer._accelerator_connector.cluster_environment
        usr = environment.requeue_signal if isinstance(environment, SLURMEnvironment) else None
        return [signal.SIGTERM, usr if usr is not None else signal.SIGUSR1]

    def install(self, trainer: pl.Trainer) -> bool:
        """Put the flag-only handlers in place (main thread only); False when they cannot be installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._trainer = trainer
        self.received = self.stopped_by = None
        for signum in self.signals(trainer):
            previous = signal.getsignal(signum)
            if previous == self._on_signal:
                continue
            if previous is signal.SIG_IGN:
                continue  # the process ignores it: nothing to defer
            self._previous[signum] = previous
            signal.signal(signum, self._on_signal)
        if self._watch is None and self._previous:
            self._watch = SignalWatch(signals=list(self._previous), after=self.stuck_after, on_stuck=self._forward)
            self._watch.start()
        return True

    def uninstall(self) -> None:
        """Give each signal back to the handler it had before (main thread; a no-op when not installed)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._watch is not None:
            self._watch.handler_ran()
        first = self.received is None
        self.received = self.received or signum  # a repeat (Lightning's launcher forwards SIGTERM) changes nothing
        if first:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        """SIGTERM: the processes Lightning launched stop too (as its handler does)."""
        trainer = self._trainer
        if signum == signal.SIGTERM and trainer is not None and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The run failed: every signal gets the handler it had before ``fit`` back.

        Lightning does it later, after the strategy's teardown, which may wait for a save in flight; a SIGTERM then
        ends the process instead of waiting for a step's end that never comes.
        """
        self.uninstall()
        restore_signal_handlers(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Agree (one all-reduce) whether any rank was signalled; if so, every rank saves and the run stops.

        Collective: every rank takes part, at every step's end.

        Raises:
            SIGTERMException: A rank was signalled; its ``code`` is ``128 + signal``.
        """
        received = self.received or 0
        if trainer.world_size > 1:
            strategy = trainer.strategy
            flag = torch.tensor(received, device=strategy.root_device)
            received = int(strategy.reduce(flag, reduce_op="max"))
        if not received:
            return
        self.stopped_by = received
        path = _save(trainer)
        if trainer.is_global_zero and received != signal.SIGTERM:
            _requeue(trainer)
        rank_zero_info(f"lightning_dcp: signal {received} received: saved {path!r} on every rank; stopping.")
        raise SIGTERMException(128 + received)


def _save(trainer: pl.Trainer) -> str:
    """Save this step's checkpoint where a restart finds it (see the module docstring). Collective."""
    memory = memory_checkpoint_of(trainer)
    if memory is not None:
        step = trainer.global_step
        name = memory.format_checkpoint_name({"epoch": trainer.current_epoch, "step": step})
        if getattr(memory, "_last_memory_step", None) != step:  # else MemoryCheckpoint saved this step already
            memory._last_memory_step = step
            with memory._io(trainer).checkpointer.into_memory():
                trainer.save_checkpoint(name)
        return name
    if SLURMEnvironment.detect():
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
    else:
        callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
        callback = callbacks[0] if callbacks else None
        directory = callback.dirpath if callback is not None and callback.dirpath else trainer.default_root_dir
        extension = callback.FILE_EXTENSION if callback is not None else ModelCheckpoint.FILE_EXTENSION
        path = os.path.join(str(directory), PREEMPTED_NAME + extension)
    path = trainer.strategy.broadcast(path)
    trainer.save_checkpoint(path)
    return path


def _requeue(trainer: pl.Trainer) -> None:
    """Rank 0: requeue the SLURM job when its environment asks for it (``SLURMEnvironment(auto_requeue=True)``)."""
    environment = trainer._accelerator_connector.cluster_environment
    if not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
        return
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID", "")
    if not job.replace("_", "").isdigit():
        log.warning("lightning_dcp: no SLURM job id to requeue (SLURM_JOB_ID=%r)", job)
        return
    done = subprocess.run(["scontrol", "requeue", job], check=False)
    if done.returncode != 0:
        log.warning("lightning_dcp: `scontrol requeue %s` failed with exit status %d", job, done.returncode)


def install_preemption(trainer: pl.Trainer) -> Preemption | None:
    """Install the run's :class:`Preemption` (once per Trainer; last among its callbacks) and its handlers."""
    existing = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None)
    preemption = existing or Preemption()
    if existing is None:
        trainer.callbacks.append(preemption)
    return preemption if preemption.install(trainer) else None
