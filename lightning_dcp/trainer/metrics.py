"""Checkpoint metrics in the Trainer's loggers: what each save and restore cost, logged at the step of the save.

``DCPModelCheckpoint`` (and so ``MemoryCheckpoint``) calls :func:`log_checkpoint_metrics` from its hooks on the main
thread; it drains the finished records of the Trainer's ``DCPCheckpointIO``
(:class:`~lightning_dcp.engine.save_log.SaveLog`) and hands them to every logger with ``logger.log_metrics(metrics,
step=...)``, as Lightning's ``LearningRateMonitor`` does. Nothing goes through ``LightningModule.log``: callbacks
that monitor metrics, the progress bar and ``trainer.callback_metrics`` never see them, so they cannot change the run.
An async save is logged once it is committed and seen finished on the training loop's thread, at the first hook after
that (at the latest when ``fit`` ends, after the teardown's wait for it).

Metrics (rank 0):

- ``checkpoint/save_blocked_s``: seconds the training loop waited for the save. A sync save: its call. An async save:
  its call (staging), plus every wait for it after the call returned: the optimizer steps (and validation, the end of
  training) waiting for its deferred staging copies or its live write, the next save call, a load or a removal
  waiting for its write (back-pressure, ``when_busy="wait"``), and the teardown's wait; a wait in a call for the
  previous save counts on that save, not on the call's own.
- ``checkpoint/save_s``: seconds from the save's start until the checkpoint was committed.
- ``checkpoint/save_bytes``: bytes of the committed checkpoint's files (not for memory-tier saves).
- ``checkpoint/save_gbps``: ``save_bytes / save_s`` in GB/s (10^9 bytes per second).
- ``checkpoint/tier``: where the save went, as a number (:data:`~lightning_dcp.engine.save_log.TIER_CODES`):
  0 the checkpoint's directory, 1 the local tier of a remote path (``local_dir``), 2 the memory tier.
- ``checkpoint/restore_s``: seconds the resume's load took on rank 0, logged at the restored step when training
  starts.
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl

from lightning_dcp._compat import lightning_run
from lightning_dcp.engine import save_metrics
from lightning_dcp.trainer.checkpoint_io import DCPCheckpointIO

__all__ = ["log_checkpoint_metrics"]

log = logging.getLogger(__name__)


def log_checkpoint_metrics(trainer: pl.Trainer) -> int:
    """Log the finished saves (and a restore) of the Trainer's ``DCPCheckpointIO`` to its loggers.

    Every rank drains its records (only rank 0 has any); rank 0 logs them. Not collective.

    Returns:
        How many records were logged (0 on other ranks, without a ``DCPCheckpointIO`` or without loggers).
    """
    io = lightning_run.unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
    if not isinstance(io, DCPCheckpointIO):
        return 0
    saves = io.checkpointer.saves
    records = io.checkpointer.finished_saves()
    restore, saves.restore = saves.restore, None
    if not trainer.is_global_zero:
        return 0
    if restore is not None:
        where = restore.source or repr(restore.url) + (f" ({restore.tier} tier)" if restore.tier else "")
        log.info("lightning_dcp: restored %s in %.3f s", where, restore.restore_s)
    if not trainer.loggers:
        return 0
    count = 0
    for record in records:
        step = record.step if record.step is not None else trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(save_metrics(record), step=step)
        count += 1
    if restore is not None:
        for logger in trainer.loggers:
            logger.log_metrics({"checkpoint/restore_s": restore.restore_s}, step=trainer.global_step)
        count += 1
    return count
