"""Checkpoint metrics through Fabric's loggers: ``log_checkpoint_metrics(fabric)`` after ``fabric.save``/``load``.

Fabric has no hooks, so the training script calls :func:`log_checkpoint_metrics` where it logs (after a save, or
once per step: a save still in flight in the background is logged by the first call after it is committed). The
metrics and their units are the Trainer's (:mod:`lightning_dcp.trainer.metrics`): ``checkpoint/save_blocked_s``,
``checkpoint/save_s``, ``checkpoint/save_bytes``, ``checkpoint/save_gbps``, ``checkpoint/tier`` and
``checkpoint/restore_s``, handed to ``fabric.log_dict`` at the step of each save. An async save's
``checkpoint/save_blocked_s`` holds every wait of the loop for it (the call, optimizer steps waiting for its staging
copies, the next ``fabric.save`` or ``wait_for_save()`` waiting for its write, the teardown): it is logged by the first
call after the save is finished (after ``wait_for_save()``, every save so far is).
"""

from __future__ import annotations

from typing import Any

from lightning_dcp.engine import save_metrics

__all__ = ["log_checkpoint_metrics"]


def log_checkpoint_metrics(fabric: Any, *, step: int | None = None) -> int:
    """Log the finished saves (and the last restore) of a ``dcp_*`` strategy through ``fabric.log_dict``.

    Args:
        fabric: A ``lightning.fabric.Fabric`` whose strategy is one of the ``dcp_*`` strategies.
        step: The step for a save whose state named none (no ``"global_step"``, ``"step"``, ``"iteration"`` or
            ``"iter_num"`` entry) and for the restore; ``None`` lets the loggers choose.

    Every rank drains its records; rank 0 holds them (Fabric's loggers log on rank 0). Not collective.

    Returns:
        How many records were handed to ``fabric.log_dict`` (0 when the strategy is not a ``dcp_*`` one).
    """
    checkpointer = getattr(fabric.strategy, "checkpointer", None)
    saves = getattr(checkpointer, "saves", None)
    if saves is None:
        return 0
    records = checkpointer.finished_saves()
    restore, saves.restore = saves.restore, None
    for record in records:
        fabric.log_dict(save_metrics(record), step=record.step if record.step is not None else step)
    if restore is not None:
        fabric.log_dict({"checkpoint/restore_s": restore.restore_s}, step=step)
    return len(records) + (restore is not None)
