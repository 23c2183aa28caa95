"""The Trainer's process group under torchrun's elastic agent: each restarted attempt with keys of its own.

See :mod:`lightning_dcp.engine.elastic` for why (a restarted worker otherwise meets the previous attempt's keys in the
agent's store: "Gloo connectFullMesh failed ... Connection refused", or a hang) and a reproduction without Lightning.
"""

from __future__ import annotations

from typing import Any

from lightning_dcp.engine import init_strategy_attempt_group

__all__ = ["ElasticAttempt"]


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
