"""Sharded torch.distributed.checkpoint (DCP) checkpoints for the PyTorch Lightning Trainer and Lightning Fabric.

Importing the package registers the ``dcp_*`` strategy names in the Trainer's and in Fabric's strategy registries,
and installs the Lightning hooks of :mod:`lightning_dcp.trainer.hooks` (``load_from_checkpoint`` on checkpoint
directories, ...) unless the environment variable ``LIGHTNING_DCP_LIGHTNING_HOOKS=0`` is set. The Fabric strategies
live in :mod:`lightning_dcp.fabric` (the names here are the Trainer's).

The package's loggers (``lightning_dcp.*``) report at INFO as Lightning's own do: the ``lightning_dcp`` logger is set
to INFO and, when the root logger has no handlers at import, prints to stderr itself (and does not propagate). One
line per save and per resume, on rank 0 (see ``docs/metrics.md``); silence them with
``logging.getLogger("lightning_dcp").setLevel(logging.WARNING)``.
"""

import logging

from lightning_dcp._compat import lightning_hooks, package_version
from lightning_dcp.engine import add_safe_globals, verify_checkpoint
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.errors import (
    BucketNotFoundError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidPathError,
    NotACheckpointError,
    OutputExistsError,
    StateDictMismatchError,
    StorageAccessError,
    StorageUnavailableError,
)
from lightning_dcp.fabric import register_strategies as register_fabric_strategies
from lightning_dcp.tools.checkpoint_dict import load_checkpoint
from lightning_dcp.tools.consolidate import consolidate
from lightning_dcp.tools.inspect import inspect_checkpoint
from lightning_dcp.tools.weights import LoadReport, load_model_weights
from lightning_dcp.trainer.callbacks import ElasticResume
from lightning_dcp.trainer.checkpoint_io import DCPCheckpointIO
from lightning_dcp.trainer.export import ExportCallback
from lightning_dcp.trainer.hooks import install_lightning_hooks, uninstall_lightning_hooks
from lightning_dcp.trainer.memory import MemoryCheckpoint
from lightning_dcp.trainer.model_checkpoint import DCPModelCheckpoint
from lightning_dcp.trainer.preemption import Preemption
from lightning_dcp.trainer.strategies import (
    DCPDDPStrategy,
    DCPFSDPStrategy,
    DCPModelParallelStrategy,
    DCPSingleDeviceStrategy,
    DCPStrategyMixin,
    register_strategies,
)

__version__ = package_version.version()
"""The version the build derived from git (setuptools-scm): a release tag's, or ``X.Y.devN+gHASH`` after one."""

__all__ = [
    "BucketNotFoundError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DCPCheckpointIO",
    "DCPDDPStrategy",
    "DCPFSDPStrategy",
    "DCPModelCheckpoint",
    "DCPModelParallelStrategy",
    "DCPSingleDeviceStrategy",
    "DCPStrategyMixin",
    "ElasticResume",
    "ExportCallback",
    "InvalidPathError",
    "LoadReport",
    "MemoryCheckpoint",
    "MemoryTier",
    "NotACheckpointError",
    "OutputExistsError",
    "Preemption",
    "StateDictMismatchError",
    "StorageAccessError",
    "StorageUnavailableError",
    "add_safe_globals",
    "consolidate",
    "inspect_checkpoint",
    "install_lightning_hooks",
    "load_checkpoint",
    "load_model_weights",
    "uninstall_lightning_hooks",
    "verify_checkpoint",
]

_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as `lightning.pytorch` does: a configured root logger takes our records
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

register_strategies()
register_fabric_strategies()
if lightning_hooks.hooks_enabled_by_env():
    install_lightning_hooks()
