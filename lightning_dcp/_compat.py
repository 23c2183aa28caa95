"""Every private torch / Lightning API that lightning_dcp touches, and every version gate, in one place.

When torch or Lightning move one of these, this is the only module to change.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.imports import compare_version

# DCP's own nested-dict helpers: the exact flattening DCP applies when it saves, so that the keys we validate
# and the keys DCP writes cannot drift apart.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element

__all__ = [
    "StorageInfo",
    "TORCH_GREATER_EQUAL_2_9",
    "narrow_tensor_by_index",
    "TrainerFn",
    "flatten_state_dict",
    "set_element",
    "unflatten_state_dict",
    "unwrap_checkpoint_io",
]

TORCH_GREATER_EQUAL_2_9 = compare_version("torch", lambda a, b: a >= b, "2.9.0")
"""``DefaultStager`` / ``StagingOptions`` and ``async_stager=`` exist from torch 2.9 on."""


def unwrap_checkpoint_io(checkpoint_io: object) -> object:
    """Return the innermost CheckpointIO of Lightning's wrappers (``AsyncCheckpointIO``)."""
    while isinstance(checkpoint_io, _WrappingCheckpointIO) and checkpoint_io.checkpoint_io is not None:
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io


def cuda_available() -> bool:
    """Whether a CUDA device can be used (kept here so tests and code agree on one check)."""
    return torch.cuda.is_available()


# DCP's per-entry storage record and its tensor-narrowing helper: our storage writer/reader produce and consume
# exactly what DCP's FileSystemWriter/FileSystemReader do, so checkpoints stay readable by any DCP reader.
from torch.distributed._shard._utils import narrow_tensor_by_index  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo  # noqa: E402
