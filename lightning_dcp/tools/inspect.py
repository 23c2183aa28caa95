"""What a checkpoint holds, from DCP's ``.metadata`` and the small non-tensor state only (no tensor data).

The command line is :mod:`lightning_dcp.inspect`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from lightning_dcp.engine import Location, Source, designated, layout

__all__ = ["inspect_checkpoint"]

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def inspect_checkpoint(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Describe the checkpoint directory at ``path`` from its metadata.

    Args:
        path: A lightning_dcp checkpoint, a Lightning sharded checkpoint (with ``meta.pt``) or any DCP directory;
            local path or fsspec URL.
        storage_options: fsspec options (credentials, endpoint).

    Returns:
        A JSON-serializable dict: ``path``, ``format`` (``"lightning_dcp"``, ``"lightning_sharded"`` or ``"dcp"``),
        ``world_size`` (ranks at save: recorded by lightning_dcp; otherwise the number of ranks that wrote data files, a
        lower bound), ``strategy``, ``global_step`` and ``epoch`` (``None`` when not recorded), ``versions`` (what wrote
        it, as recorded by lightning_dcp: ``torch``, ``lightning``, ``lightning_dcp`` and ``lightning_dcp_commit``, each
        ``None`` when not recorded), ``num_tensors``, ``total_bytes`` and ``weight_bytes`` (bytes of the full, unsharded
        tensors), ``files`` (data files), ``modules`` and ``optimizers`` (the top-level keys holding model weights and
        optimizer state: ``["state_dict"]``/``["optimizer_states"]`` for the Trainer, the state keys of ``fabric.save``
        for Fabric), ``objects`` (the other saved keys of a Fabric checkpoint), and ``tensors``: one dict per tensor
        (model weights first, by FQN, then the others by key; numbers within names compare as numbers: ``layers.2``
        before ``layers.10``) with ``key`` (flat DCP key), ``name`` (FQN for model weights), ``weight``, ``shape``,
        ``dtype`` (e.g. ``"float32"``), ``bytes`` and ``chunks`` (saved shards).

    Rank 0 only (or any single process).

    Raises:
        CheckpointNotFoundError: Nothing exists at ``path``.
        NotACheckpointError: ``path`` is not a DCP checkpoint directory.
        CheckpointError: The non-tensor state cannot be read with ``weights_only`` unpickling.
    """
    source = Source(designated(Location(path, storage_options=storage_options)))
    extra = source.read_extra()
    info = extra.get(layout.INFO_KEY, {}) if isinstance(extra.get(layout.INFO_KEY), dict) else {}
    files = sorted(
        {
            info_.relative_path
            for info_ in (source.metadata.storage_data or {}).values()
            if hasattr(info_, "relative_path")
        }
    )
    writers = {int(m.group(1)) for f in files if (m := _DATA_FILE.fullmatch(f))}
    state = source.metadata.state_dict_metadata
    tensors = [
        {
            "key": e.key,
            "name": e.name,
            "weight": e.weight,
            "shape": list(e.shape),
            "dtype": str(e.dtype).removeprefix("torch."),
            "bytes": e.nbytes,
            "chunks": len(state[e.key].chunks),
        }
        for e in source.entries
    ]
    tensors.sort(key=lambda t: (not t["weight"], _natural(t["name"] if t["weight"] else t["key"])))
    strategy = info.get("strategy") or ("lightning (sharded)" if source.kind == "lightning_sharded" else None)
    roles = source.roles
    fabric = roles is not None and not roles.trainer
    tree_keys = {e.path[0] for e in source.entries} | {source._path(k)[0] for k in source.byte_keys}
    return {
        "path": source.location.url,
        "format": source.kind,
        "front_end": None if roles is None else "trainer" if roles.trainer else info.get("front_end", "fabric"),
        "modules": list(source.module_keys),
        "optimizers": list(roles.optimizers) if roles is not None else [],
        "objects": sorted(
            [k for k in tree_keys if k not in source.module_keys and k not in roles.optimizers and k != layout.RANK_KEY]
            + [k for k in extra if k != layout.INFO_KEY]
        )
        if fabric
        else [],
        "world_size": info.get("world_size", len(writers) or None),
        "strategy": strategy,
        "global_step": extra.get("global_step"),
        "epoch": extra.get("epoch"),
        "versions": {
            "torch": info.get("torch_version"),
            "lightning": info.get("lightning_version"),
            "lightning_dcp": info.get("lightning_dcp_version"),
            "lightning_dcp_commit": info.get("lightning_dcp_commit"),
        },
        "num_tensors": len(tensors),
        "total_bytes": sum(t["bytes"] for t in tensors),
        "weight_bytes": sum(t["bytes"] for t in tensors if t["weight"]),
        "files": files,
        "tensors": tensors,
    }


def _natural(name: str) -> list[tuple[int, int | str]]:
    """Sort key of a dotted name whose numeric parts compare as numbers (``layers.2`` before ``layers.10``)."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part]
