"""Read a DCP checkpoint entry by entry: what it holds (from ``.metadata`` only) and bounded batches of tensors.

Three layouts are recognised, all plain DCP directories underneath:

- ``"lightning_dcp"``: ours (see :mod:`lightning_dcp.engine.format.layout`): ``state_dict.*``, ``optimizer_states.*``
  and the
  ``lightning`` blob with the non-tensor Trainer state, or a Fabric checkpoint's own keys (the blob's info names
  its module and optimizer keys);
- ``"lightning_sharded"``: Lightning's own sharded layout: ``state_dict.*`` (``ModelParallelStrategy``) or
  ``model.*`` (``FSDPStrategy(state_dict_type="sharded")``), ``optimizer_{i}.*`` and a ``meta.pt`` file
  (``torch.save`` of the non-tensor state);
- ``"dcp"``: any other DCP directory; every tensor is a weight named by its flat DCP key.

Tensors are read with ``dcp.load`` into a partial target built from the metadata, one bounded batch at a time,
through :func:`~lightning_dcp.engine.load.dcp_reader.storage_reader` and
:class:`~lightning_dcp.engine.format.layout.SafeLoadPlanner`;
nothing is ever unpickled with ``weights_only=False``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_dcp.engine.catalog.integrity import not_one_checkpoint
from lightning_dcp.engine.catalog.metadata import read_metadata
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.format.blob import decode_extra
from lightning_dcp.engine.format.marker import METADATA_FILE
from lightning_dcp.engine.load.dcp_reader import storage_reader
from lightning_dcp.engine.load.loading import foreign_file_at, not_a_checkpoint_file
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import CheckpointError, NotACheckpointError, checkpoint_not_found

__all__ = ["Source", "TensorEntry"]

_LIGHTNING_FSDP_MODEL_KEY = "model"
_LIGHTNING_OPTIMIZER = re.compile(r"optimizer_(\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the checkpoint, described from the metadata alone."""

    key: str
    """The flat DCP key (``state_dict.body.0.weight``)."""
    path: tuple
    """Where the tensor sits in the nested state dict DCP saved (``("state_dict", "body.0.weight")``)."""
    name: str
    """The exported name: the FQN for model weights, the flat DCP key otherwise."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    weight: bool
    """Whether this is a model weight (as opposed to optimizer state or other tensors)."""

    @property
    def nbytes(self) -> int:
        """Size of the full tensor in bytes."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


class Source:
    """A committed DCP checkpoint directory opened for streaming reads.

    Args:
        location: The checkpoint directory.

    Rank 0 only (or any single process): reads run without collectives (``no_dist``).

    Raises:
        CheckpointNotFoundError: Nothing exists at the location.
        NotACheckpointError: It is not a directory with DCP's ``.metadata``, or the metadata is unreadable.
    """

    def __init__(self, location: Location) -> None:
        self.location = location
        if not location.exists():
            raise checkpoint_not_found(location.url)
        if not location.isdir() or not location.has_metadata():
            if location.isdir() and (folder := not_one_checkpoint(location)) is not None:
                raise folder  # a run's dirpath rather than one of its checkpoints
            if (kind := foreign_file_at(location)) is not None:
                raise not_a_checkpoint_file(location.url, kind)
            raise NotACheckpointError(
                f"{location.url!r} is not a DCP checkpoint directory (no {METADATA_FILE!r} file in it); pass a"
                " directory written by lightning_dcp, by Lightning's sharded strategies or by `dcp.save`."
            )
        self.metadata: Metadata = read_metadata(self.location)
        keys = self.metadata.state_dict_metadata
        if layout.EXTRA_KEY in keys:
            self.kind = "lightning_dcp"
        elif location.is_lightning_sharded():
            self.kind = "lightning_sharded"
        else:
            self.kind = "dcp"
        self._extra: dict[str, Any] | None = None
        self.model_key = layout.MODEL_KEY
        """The top-level key of the model weights (``"model"`` in Lightning's FSDPStrategy layout)."""
        if self.kind == "lightning_sharded" and not any(self._path(k)[0] == layout.MODEL_KEY for k in keys):
            self.model_key = _LIGHTNING_FSDP_MODEL_KEY
        self.roles = layout.tree_roles(self._info()) if self.kind == "lightning_dcp" else None
        """Which top-level keys hold modules and optimizers (lightning_dcp checkpoints; ``None`` otherwise)."""
        self.module_keys = self.roles.modules if self.roles is not None else (self.model_key,)
        """The top-level keys of model weights; a Fabric checkpoint may hold several modules."""
        self.entries = [self._entry(k, m) for k, m in keys.items() if isinstance(m, TensorStorageMetadata)]
        self.byte_keys = [k for k, m in keys.items() if isinstance(m, BytesStorageMetadata) and k != layout.EXTRA_KEY]

    def _path(self, key: str) -> tuple:
        return tuple((self.metadata.planner_data or {}).get(key, (key,)))

    def _info(self) -> dict[str, Any]:
        try:
            info = self.read_extra().get(layout.INFO_KEY)
        except CheckpointError:  # unreadable with weights_only: the tools that need the blob report it themselves
            return {}
        return info if isinstance(info, dict) else {}

    def _entry(self, key: str, meta: TensorStorageMetadata) -> TensorEntry:
        path = self._path(key)
        weight = path[0] in self.module_keys and len(path) == 2 if self.kind != "dcp" else True
        name = key
        if weight and self.kind != "dcp":  # an FQN; prefixed by its module's key when there are several modules
            name = str(path[1]) if len(self.module_keys) == 1 else f"{path[0]}.{path[1]}"
        return TensorEntry(key, path, name, meta.properties.dtype, tuple(meta.size), weight)

    # ------------------------------------------------------------------------------------------ small state
    def optimizer_index(self, entry_path: tuple) -> int | None:
        """The optimizer an entry belongs to (``None``: not optimizer state)."""
        head = entry_path[0]
        if self.roles is not None:
            return self.roles.optimizer_index(tuple(entry_path))
        if self.kind == "lightning_sharded" and isinstance(head, str):
            match = _LIGHTNING_OPTIMIZER.fullmatch(head)
            return int(match.group(1)) if match else None
        return None

    def read_extra(self, *, weights_only: bool = True) -> dict[str, Any]:
        """The non-tensor Trainer state: our ``lightning`` blob, Lightning's ``meta.pt``, or ``{}`` for plain DCP.

        Raises:
            CheckpointError: It cannot be read with ``weights_only`` unpickling, or is corrupt (the file is named).
        """
        if self.kind == "lightning_dcp":
            if weights_only and self._extra is not None:
                return dict(self._extra)
            blob = self.read_values([layout.EXTRA_KEY], weights_only=weights_only)[layout.EXTRA_KEY]
            extra = decode_extra(blob, path=self.location.url, entry=layout.EXTRA_KEY, weights_only=weights_only)
            if weights_only:
                self._extra = extra
            return dict(extra)
        if self.kind == "lightning_sharded":
            meta = self.location.lightning_meta()
            try:
                with meta.open() as f:
                    return dict(torch.load(f, map_location="cpu", weights_only=weights_only))
            except Exception as err:
                raise CheckpointError(f"Cannot read {meta.url}: {err}") from err
        return {}

    def read_rank_objects(self, rank: int = 0) -> dict[str, Any]:
        """The state rank ``rank`` saved as its own (``rank_states.{rank}``: RNG states, Fabric's stateful loaders).

        ``{}`` when the checkpoint holds none for that rank (not ours, or saved at a smaller world size).

        Raises:
            CheckpointError: It cannot be read with ``weights_only`` unpickling, or is corrupt (the file is named).
        """
        key = f"{layout.RANK_KEY}.{rank}"
        if self.kind != "lightning_dcp" or key not in self.metadata.state_dict_metadata:
            return {}
        return decode_extra(self.read_values([key])[key], path=self.location.url, entry=key)

    def read_values(self, keys: Iterable[str], *, weights_only: bool = True) -> dict[str, Any]:
        """Load the non-tensor (bytes) entries ``keys`` (small: param_groups, the ``lightning`` blob)."""
        keys = list(keys)
        target: dict[str, Any] = {k: b"" for k in keys}
        if keys:
            self._load(target, weights_only=weights_only)
        return target

    # ---------------------------------------------------------------------------------------------- tensors
    def iter_tensors(self, entries: Iterable[TensorEntry], *, batch_bytes: int) -> Iterator[tuple[TensorEntry, Any]]:
        """Yield ``(entry, tensor)`` for ``entries`` in order, reading at most ``batch_bytes`` per ``dcp.load``.

        A tensor larger than ``batch_bytes`` is read alone; a yielded tensor is released by this generator
        before the next batch is read, so the caller holds the memory of one batch at a time.
        """
        for batch in _batches(list(entries), batch_bytes):
            target = {e.key: torch.empty(e.shape, dtype=e.dtype) for e in batch}
            self._load(target, weights_only=True)
            for entry in batch:
                yield entry, target.pop(entry.key)
            del target

    def files_of(self, key: str) -> list[str]:
        """The data files that hold ``key`` (to name them in errors)."""
        names = {
            info.relative_path
            for index, info in (self.metadata.storage_data or {}).items()
            if getattr(index, "fqn", None) == key and hasattr(info, "relative_path")
        }
        return sorted(names)

    def _load(self, target: dict[str, Any], *, weights_only: bool) -> None:
        try:
            with _quiet():
                dcp.load(
                    target,
                    storage_reader=storage_reader(self.location),
                    planner=layout.SafeLoadPlanner(weights_only=weights_only),
                    no_dist=True,
                )
        except (Exception, dcp.CheckpointException) as err:  # DCP's exception derives from BaseException
            cause = _root_cause(err)
            if isinstance(cause, CheckpointError):
                raise cause from err
            files = sorted({f for key in target for f in self.files_of(key)})
            where = ", ".join(f"{self.location.url.rstrip('/')}/{f}" for f in files) or self.location.url
            raise NotACheckpointError(
                f"Reading {len(target)} entr{'y' if len(target) == 1 else 'ies'} ({_preview(target)}) from {where}"
                f" failed; the file is truncated or corrupt ({type(cause).__name__}: {cause})."
            ) from err


def _batches(entries: list[TensorEntry], batch_bytes: int) -> Iterator[list[TensorEntry]]:
    batch: list[TensorEntry] = []
    size = 0
    for entry in entries:
        if batch and size + entry.nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += entry.nbytes
    if batch:
        yield batch


def _root_cause(err: BaseException) -> BaseException:
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, BaseException):
            return _root_cause(first)
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):  # (exception, traceback)
            return _root_cause(first[0])
    return err


def _preview(keys: Iterable[str]) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
