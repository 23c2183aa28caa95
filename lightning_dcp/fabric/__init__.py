"""The Lightning Fabric front end: ``dcp_*`` Fabric strategies whose ``fabric.save`` / ``fabric.load`` use the engine.

It translates Fabric's state dicts (modules, optimizers, objects) into the engine's layout
(``lightning_dcp.engine``) and back. ``import lightning_dcp`` registers the strategy names in Fabric's registry.
"""

from lightning_dcp.fabric.metrics import log_checkpoint_metrics
from lightning_dcp.fabric.resume import latest_checkpoint
from lightning_dcp.fabric.strategies import (
    DCPDDPStrategy,
    DCPFSDPStrategy,
    DCPModelParallelStrategy,
    DCPSingleDeviceStrategy,
    DCPStrategyMixin,
    fully_shard_layers,
    register_strategies,
)

__all__ = [
    "DCPDDPStrategy",
    "DCPFSDPStrategy",
    "DCPModelParallelStrategy",
    "DCPSingleDeviceStrategy",
    "DCPStrategyMixin",
    "fully_shard_layers",
    "latest_checkpoint",
    "log_checkpoint_metrics",
    "register_strategies",
]
