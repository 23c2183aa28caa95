"""The Trainer's multi-process strategies under torchrun: each attempt with keys of its own, a failed one ended soon.

See :mod:`lightning_dcp.engine.elastic` for why (a restarted worker otherwise meets the previous attempt's keys in the
agent's store: "Gloo connectFullMesh failed ... Connection refused", or a hang) and a reproduction without Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning_dcp.engine import init_strategy_attempt_group

__all__ = ["FAILED_SAVE_WAIT_S", "ElasticAttempt"]

FAILED_SAVE_WAIT_S = 10.0
"""Seconds a failed run's teardown waits for the memory tier's save in flight before leaving it unfinished."""


class ElasticAttempt:
    """Mixin for the Trainer's multi-process strategies: set up the process group in a store of this attempt.

    Outside torchelastic (Lightning's own launcher, SLURM, a spawned group) it changes nothing.
    """

    def setup_distributed(self) -> None:
        """Join the default group through this attempt's keys (under an elastic agent), then Lightning's set-up.

        Collective: call on all ranks (Lightning does, in ``setup_environment``).
        """
        strategy: Any = self
        if strategy.cluster_environment is not None:
            strategy.set_world_ranks()
        init_strategy_attempt_group(strategy)
        super().setup_distributed()  # type: ignore[misc]

    def on_exception(self, exception: BaseException) -> None:
        """Lightning's hook for a failed run, before its teardown: bound the wait for the memory tier's save in flight.

        When a peer dies during a save's replication, this rank's transfer waits for good and the teardown with it;
        torchelastic's agent then stops the worker with SIGTERM (which the ``dcp_*`` strategies only record) and
        SIGKILLs it 30 s later. Here the save gets :data:`FAILED_SAVE_WAIT_S` seconds, then is left unfinished
        (:meth:`~lightning_dcp.engine.tiers.memory.MemoryTier.give_up`) and the worker fails at once; its exit is the
        interpreter's own, as a stock Lightning worker's.
        """
        super().on_exception(exception)  # type: ignore[misc]
        strategy: Any = self
        if getattr(strategy, "_dcp_sharded", False):
            strategy._dcp_io.checkpointer.give_up(after=FAILED_SAVE_WAIT_S)
