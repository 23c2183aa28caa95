"""torch and DCP private APIs and version gates, in one place: the engine may import this module.

When torch moves one of these, this is the module to change; each block says what it is for and the versions it
was checked against (torch 2.13).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.imports import compare_version

# How ``torch.save`` pickles a tensor (``_rebuild_tensor_v2`` over a typed storage named by its legacy storage
# class): the streaming ``.ckpt`` writer emits exactly these references so ``torch.load(weights_only=True)`` reads them.
from torch._utils import _rebuild_tensor_v2 as rebuild_tensor

# ... and dtypes without a legacy storage class (float8, uint16, ...): ``_rebuild_tensor_v3`` over an untyped storage.
from torch._utils import _rebuild_tensor_v3 as rebuild_tensor_v3

# DCP's per-entry storage record and tensor-narrowing helper: our storage writer/reader produce and consume exactly
# what DCP's FileSystemWriter/FileSystemReader do, so checkpoints stay readable by any DCP reader.
from torch.distributed._shard._utils import narrow_tensor_by_index

# FSDP1's sharded state dict holds ShardedTensors: async staging rebuilds them around CPU buffers.
from torch.distributed._shard.sharded_tensor import ShardedTensor

# DCP's fsspec adapter inside FsspecWriter/FsspecReader (``.fs``): ``reset(checkpoint_id)`` calls its ``init_path``
# without the storage options; lightning_dcp.engine.save.dcp_io subclasses it to keep them.
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as DCPFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

# DCP's own nested-dict helpers: the exact flattening DCP applies when it saves, so that the keys we validate and
# the keys DCP writes cannot drift apart.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo

# The format version FileSystemWriter.finish stamps into ``.metadata``; our writer writes ``.metadata`` itself.
try:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as DCP_METADATA_VERSION
except ImportError:  # older DCP stamps none
    DCP_METADATA_VERSION = None

__all__ = [
    "DCPFsspecFileSystem",
    "DCP_METADATA_VERSION",
    "FsspecReader",
    "FsspecWriter",
    "ShardedTensor",
    "StorageInfo",
    "TORCH_GREATER_EQUAL_2_9",
    "dtensor_over",
    "flatten_state_dict",
    "foreach_copy",
    "loads_only_own_keys",
    "narrow_tensor_by_index",
    "optimizer_load_hooked",
    "own_state_tensors",
    "parameter_fqns",
    "rebuild_tensor",
    "rebuild_tensor_v3",
    "set_element",
    "sharded_tensor_over",
    "storage_type_name",
    "tensor_version",
    "unflatten_state_dict",
]

TORCH_GREATER_EQUAL_2_9 = compare_version("torch", lambda a, b: a >= b, "2.9.0")
"""``DefaultStager`` / ``StagingOptions`` and ``async_stager=`` exist from torch 2.9 on."""


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place version counter of ``tensor`` (shared by its views; bumped by every in-place change)."""
    return tensor._version


def foreach_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for every ``i``, in one call (``torch._foreach_copy_``)."""
    torch._foreach_copy_(destinations, sources)


def dtensor_over(dtensor: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``dtensor``'s mesh, placements and global shape whose local tensor is ``local`` as it is.

    ``DTensor.from_local`` moves a local tensor to the mesh's device (a CPU staging buffer would go back to the
    GPU); the constructor keeps it where it is. ``local`` must have the local tensor's shape and dtype.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, dtensor._spec, requires_grad=False)


def sharded_tensor_over(sharded: Any, tensors: list[torch.Tensor]) -> Any:
    """A ShardedTensor with ``sharded``'s global metadata whose local shards are ``tensors`` (CPU, in order).

    The shards' placements say ``cpu`` (DCP reads only offsets and sizes from them); no communication.
    """
    import copy as _copy

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard

    metadata = _copy.deepcopy(sharded.metadata())
    metadata.shards_metadata = [
        ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), f"rank:{m.placement.rank()}/cpu")
        for m in metadata.shards_metadata
    ]
    pinned = bool(tensors) and tensors[0].is_pinned()
    metadata.tensor_properties.pin_memory = pinned
    metadata.tensor_properties.requires_grad = False
    local = []
    for tensor, shard in zip(tensors, sharded.local_shards(), strict=True):
        meta = shard.metadata
        placement = f"rank:{meta.placement.rank()}/cpu"
        local.append(Shard(tensor, ShardMetadata(list(meta.shard_offsets), list(meta.shard_sizes), placement)))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=sharded._process_group
    )


_PLAIN_STATE_LOADERS = (
    torch.nn.Module._load_from_state_dict,
    torch.nn.modules.batchnorm._NormBase._load_from_state_dict,
    torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict,
)


def loads_only_own_keys(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` does nothing but copy its own keys (no load hooks, a stock loader).

    Reads ``torch.nn.Module``'s private loader and hook registries (torch 2.x names).
    """
    if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
        return False
    return type(module)._load_from_state_dict in _PLAIN_STATE_LOADERS


def own_state_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]] | None:
    """The ``(key, tensor)`` pairs of ``module.state_dict()`` in its order, the tensors themselves (not detached).

    One walk over the modules' parameter and buffer registries instead of ``state_dict()``, which detaches every
    tensor and calls per-module hooks (~10 ms for 800 modules). ``None`` when some module could make
    ``state_dict()`` or ``load_state_dict()`` give or take anything else: state dict or load hooks, its own
    ``state_dict``, ``_save_to_state_dict`` or ``get_extra_state``, a loader :func:`loads_only_own_keys` refuses.

    Reads ``torch.nn.Module``'s private registries (``_modules``, ``_parameters``, ``_buffers``,
    ``_non_persistent_buffers_set`` and the hook dicts; torch 2.x names).
    """
    out: list[tuple[str, torch.Tensor]] = []
    stack: list[tuple[str, torch.nn.Module]] = [("", module)]
    base = torch.nn.Module
    while stack:
        prefix, current = stack.pop()
        kind = type(current)
        if (
            current._state_dict_hooks
            or current._state_dict_pre_hooks
            or kind.state_dict is not base.state_dict
            or kind._save_to_state_dict is not base._save_to_state_dict
            or kind.get_extra_state is not base.get_extra_state
            or not loads_only_own_keys(current)
        ):
            return None
        for name, param in current._parameters.items():
            if param is not None:
                out.append((prefix + name, param))
        skipped = current._non_persistent_buffers_set
        for name, buffer in current._buffers.items():
            if buffer is not None and name not in skipped:
                out.append((prefix + name, buffer))
        children = [(prefix + name + ".", child) for name, child in current._modules.items() if child is not None]
        stack.extend(reversed(children))  # depth first, in registration order, as state_dict() recurses
    return out


def storage_type_name(dtype: torch.dtype) -> str:
    """The legacy storage class name ``torch.save`` records for ``dtype`` (``torch.float32`` -> ``"FloatStorage"``)."""
    return torch.storage._dtype_to_storage_type_map()[dtype]


def optimizer_load_hooked(optimizer: Any) -> bool:
    """Whether ``optimizer.load_state_dict`` runs hooks (``register_load_state_dict_pre_hook`` / ``post_hook``).

    torch keeps them in private dicts (``_optimizer_load_state_dict_pre_hooks`` / ``_post_hooks``, torch >= 2.2);
    where those are missing this answers True, so that callers take ``load_state_dict`` itself.
    """
    pre = getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_load_state_dict_post_hooks", None)
    if not isinstance(pre, dict) or not isinstance(post, dict):
        return True
    return bool(pre) or bool(post)


def sync_module_states(module: torch.nn.Module, *, process_group: Any, skip: frozenset[str]) -> None:
    """What ``DistributedDataParallel`` does at wrapping when ``init_sync=True`` (torch 2.13), minus ``skip``.

    Checks that every rank's parameters have the same shapes, then broadcasts from rank 0, in buckets of 250 MiB as
    DDP does, every parameter and buffer (non-persistent ones included) whose name is not in ``skip``.
    Collective: call on all ranks of ``process_group``.
    """
    from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes

    _verify_param_shape_across_processes(process_group, list(module.parameters()))
    _sync_module_states(
        module=module,
        process_group=process_group,
        broadcast_bucket_size=250 * 1024 * 1024,
        src=0,
        params_and_buffers_to_ignore=skip,
    )


def parameter_fqns(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` under each of its DCP FQNs (``get_optimizer_state_dict``'s names).

    The names ``module.named_parameters(remove_duplicate=False)`` gives, with DCP's ``_get_fqns`` applied: the DDP
    ``module.`` prefix, ``torch.compile``'s ``_orig_mod.`` and activation-checkpoint wrappers' prefixes removed, a
    module's ``_fqn_modifiers`` honoured (torch 2.13's private helper). A tied parameter is listed under each name.
    FSDP1's flat parameters are not resolved here (DCP maps them through FSDP's own optimizer state API).
    """
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        for fqn in _get_fqns(module, name):
            out.setdefault(fqn, param)
    return out
