"""Sharded torch.distributed.checkpoint (DCP) checkpoints for the PyTorch Lightning Trainer.

Importing the package registers the ``dcp_*`` strategy names in Lightning's strategy registry.
"""

from lightning_dcp._consolidate import consolidate
from lightning_dcp.checkpoint_io import DCPCheckpointIO
from lightning_dcp.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
    StateDictMismatchError,
)
from lightning_dcp.strategies import (
    DCPDDPStrategy,
    DCPFSDPStrategy,
    DCPModelParallelStrategy,
    DCPSingleDeviceStrategy,
    DCPStrategyMixin,
    register_strategies,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "DCPCheckpointIO",
    "DCPDDPStrategy",
    "DCPFSDPStrategy",
    "DCPModelParallelStrategy",
    "DCPSingleDeviceStrategy",
    "DCPStrategyMixin",
    "NotACheckpointError",
    "StateDictMismatchError",
    "consolidate",
]

register_strategies()
