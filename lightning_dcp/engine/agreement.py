"""One cross-rank agreement on the first failure: an error on any rank is raised on every rank, naming the rank."""

from __future__ import annotations

import pickle
from typing import Any

import torch.distributed as dist

from lightning_dcp.engine.dist import all_true, distributed
from lightning_dcp.errors import CheckpointError


class RankFailure(RuntimeError):
    """A save failed on some rank; raised on every rank.

    ``failures`` maps the lowest failing rank to its error, as DCP's ``CheckpointException`` does (so
    :func:`lightning_dcp.errors.checkpoint_failure` names the rank and explains the error).
    """

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank}: {type(error).__name__}: {error}")
        self.failures = {rank: error}


def agree(error: BaseException | None, *, group: dist.ProcessGroup | None, distributed: bool) -> None:
    """Raise on every rank when any rank passes an error (one small exchange). Collective when ``distributed``.

    Raises:
        RankFailure: Some rank's ``error`` (the lowest such rank's), on every rank.
    """
    if not distributed:
        _raise_first([error])
        return
    if all_true(error is None, group=group):  # the common case: one small all-reduce, no pickling
        return
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, _portable(error), group=group)
    _raise_first(errors)


def _raise_first(errors: list[BaseException | None]) -> None:
    for rank, error in enumerate(errors):
        if error is not None:
            raise RankFailure(rank, error)


def _portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it can be pickled to the other ranks, else a ``RuntimeError`` with its text."""
    if error is None:
        return None
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def first_failure(failure: CheckpointError | None, collective: bool) -> CheckpointError | None:
    """The failure of the lowest failing rank (``None`` when every rank succeeded). Collective when ``collective``."""
    if not distributed(collective):
        return failure
    if all_true(failure is None):  # the common case: one small all-reduce, no pickling
        return None
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f is not None), None)
