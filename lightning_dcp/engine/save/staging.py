"""Staging: copy what a background save writes off the training tensors into reused CPU buffers.

After :meth:`Stager.stage_items` (or :meth:`Stager.stage`) returns, the model and optimizer may change freely: the
background writer only sees the staged copies, so a checkpoint never mixes two steps. An async save stages only the
write items of its own rank's plan (under DDP, its share of the replicated state), not the whole state dict.
Buffers are allocated once and reused by every later save of the same shapes (``copy_`` into an existing buffer runs
at memory bandwidth; a fresh allocation is ~3x slower). On CUDA the buffers are pinned, so the device-to-host copies
run at full PCIe speed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from lightning_dcp._compat.torch_dcp import (
    ShardedTensor,
    dtensor_over,
    foreach_copy,
    sharded_tensor_over,
    tensor_version,
)
from lightning_dcp.engine.save.stream_copies import StreamCopies

__all__ = ["Deferred", "Stager", "StagingRaceError"]

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None))


class StagingRaceError(RuntimeError):
    """Tensors changed in place while their deferred staging copies were being made: the save is dropped.

    Attributes:
        names: The changed tensors' keys.
        outside_steps: Whether they changed while optimizer steps were held (so outside any step, and they are to
            be copied at the call from now on); ``False`` when steps may have run meanwhile (the save's plan changed
            after the hold was lifted early, see :mod:`lightning_dcp.engine.save.async_save`).
    """

    def __init__(self, names: list[str], outside_steps: bool = True) -> None:
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        when = (
            "outside an optimizer step (which waits for the copies)"
            if outside_steps
            else "by an optimizer step allowed to run before them (the save's plan had changed since the last save)"
        )
        super().__init__(
            f"{shown} changed in place after an async save was called and before its background staging copy was"
            f" made, {when}; the save was dropped rather than written with tensors of two different steps."
        )
        self.names = list(names)
        self.outside_steps = outside_steps

    def __reduce__(self) -> tuple:  # crosses process boundaries inside RankFailure
        return (type(self), (self.names, self.outside_steps))


@dataclasses.dataclass
class Deferred:
    """A staging copy made after the save call returned: ``buffer.copy_(source)``, valid if ``source`` is unchanged.

    Attributes:
        name: The tensor's key, for messages.
        source: The live tensor (or the row range of it this rank writes).
        buffer: The staging buffer it is copied into; ``None`` for a live write (the writer reads ``source`` itself
            while optimizer steps wait, and only the version is checked afterwards).
        version: ``source``'s in-place version counter when the save was planned.
        index: The write item's index (set by :meth:`Stager.stage_items` and :meth:`Stager.stage_deferred`).
    """

    name: str
    source: torch.Tensor
    buffer: torch.Tensor | None
    version: int
    changed: bool = False  # found changed when it was copied early (see Stager.finish's ``made``)
    index: Any = None


class Stager(AsyncStager):
    """Copy tensors into reused CPU buffers (pinned when CUDA is available); containers are rebuilt.

    A DTensor is rebuilt around its staged local tensor, and a ShardedTensor (FSDP1's sharded state dict) around its
    staged local shards, with the original's global metadata; neither is moved back to the accelerator.

    :meth:`stage_items` is what lightning_dcp's async saves call; :meth:`stage` makes it usable as DCP's
    ``async_stager`` too (``dcp.async_save`` calls it in the caller's thread before the background write).

    Args:
        pin_memory: Allocate pinned buffers (default: whether CUDA is available).
    """

    _synchronize_after_execute = False

    def __init__(self, *, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._cuda_copies = False
        self.stream_copies: StreamCopies | None = None
        """The queued CUDA copies of the last :meth:`snapshot` (:mod:`lightning_dcp.engine.save.stream_copies`)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Return a copy of ``state_dict`` whose tensors live in this stager's buffers (same structure)."""
        self._cuda_copies = False
        staged = self._copy(state_dict, ())
        if self._cuda_copies:
            torch.cuda.synchronize()  # non-blocking device-to-host copies must land before the writer reads
        return staged

    def stage_items(
        self,
        items: Iterable[WriteItem],
        resolve: Callable[[WriteItem], Any],
        *,
        defer: Callable[[WriteItem, torch.Tensor], bool] | None = None,
        live: bool = False,
    ) -> tuple[dict[Any, Any], list[Deferred]]:
        """Copies of the data of ``items`` (``resolve`` gives it: a tensor, or a blob already serialized).

        Args:
            items: The write items of this rank's plan.
            resolve: The planner's ``resolve_data``.
            defer: Which CPU tensors get their buffer now and their copy later (:meth:`finish`); ``None`` copies
                everything now.
            live: The deferred tensors are written as they are (no buffer; see :class:`Deferred`).

        Returns:
            ``({item.index: staged data}, deferred copies)``: tensors in this stager's buffers, blobs as they are.
        """
        self._cuda_copies = False
        staged: dict[Any, Any] = {}
        deferred: list[Deferred] = []
        now: list[Deferred] = []  # CPU copies made before returning, in one batched call
        for item in items:
            data = resolve(item)
            if isinstance(data, torch.Tensor):
                key = _item_key(item.index)
                source = data.detach()
                if not source.is_cpu:
                    data = self._copy_tensor(source, key)
                elif defer is not None and defer(item, source):
                    data = source if live else self._buffer(source, key)
                    version = tensor_version(source)
                    deferred.append(Deferred(item.index.fqn, source, None if live else data, version, index=item.index))
                else:
                    data = self._buffer(source, key)
                    now.append(Deferred(item.index.fqn, source, data, tensor_version(source)))
            staged[item.index] = data
        Stager.copy(now)
        if self._cuda_copies:
            torch.cuda.synchronize()
        return staged, deferred

    def snapshot(
        self, flat: dict[str, Any], *, defer: Callable[[str, torch.Tensor], bool]
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """What a save call copies of a flat state dict (plain tensors only) before returning; the rest stays live.

        Args:
            flat: Flat keys to plain tensors and other leaves (``planning.flatten``'s output).
            defer: Which CPU tensors stay live, to be copied later (:meth:`stage_deferred`).

        Returns:
            ``(snapshot, versions)``: ``flat`` with every other tensor replaced by a staging buffer holding its copy
            (the CPU ones copied in one batched call) and mutable leaves deep-copied; and the in-place version
            counter, now, of each tensor left live (by key). The copies of CUDA tensors into pinned buffers are
            queued, not waited for: :attr:`stream_copies` (``None`` when there are none) says when they land.
        """
        self._cuda_copies = False
        self.stream_copies = streams = None
        out: dict[str, Any] = {}
        versions: dict[str, int] = {}
        buffers: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                if value.is_cuda and self.pin_memory:  # queued on CUDA streams, not waited for (stream_copies)
                    source = value.detach()
                    out[key] = buffer = self._buffer(source, ("flat", key))
                    streams = streams or StreamCopies()
                    streams.add(key, source, buffer, later=defer(key, value))
                elif not value.is_cpu:
                    out[key] = self._copy_tensor(value, ("flat", key))
                elif defer(key, value):
                    versions[key] = tensor_version(value)
                    out[key] = value
                else:
                    source = value.detach()
                    out[key] = buffer = self._buffer(source, ("flat", key))
                    buffers.append(buffer)
                    sources.append(source)
            elif isinstance(value, _IMMUTABLE):
                out[key] = value
            else:
                out[key] = copy.deepcopy(value)
        if buffers:
            foreach_copy(buffers, sources)
        if streams is not None:
            streams.launch()
            self.stream_copies = streams
        if self._cuda_copies:
            torch.cuda.synchronize()
        return out, versions

    def stage_deferred(
        self,
        items: Iterable[WriteItem],
        resolve: Callable[[WriteItem], Any | None],
        versions: dict[str, int],
        *,
        live: bool = False,
    ) -> tuple[dict[Any, Any], list[Deferred]]:
        """The data of ``items`` after :meth:`snapshot`: live tensors (keys in ``versions``) get a buffer to copy into.

        ``resolve`` may return ``None`` for an item it cannot resolve (skipped). ``live``: live tensors get no
        buffer and are written as they are (see :class:`Deferred`).

        Returns:
            ``({item.index: data}, deferred copies)``: a buffer for each live tensor (its copy made by
            :meth:`finish`, checked against its version in ``versions``), the snapshot's data as it is otherwise.
        """
        staged: dict[Any, Any] = {}
        deferred: list[Deferred] = []
        for item in items:
            data = resolve(item)
            if data is None:
                continue
            fqn = item.index.fqn
            if fqn in versions and isinstance(data, torch.Tensor):
                source = data.detach()
                key = _item_key(item.index)
                data = source if live else self._buffer(source, key)
                deferred.append(Deferred(fqn, source, None if live else data, versions[fqn], index=item.index))
            staged[item.index] = data
        return staged, deferred

    @staticmethod
    def finish(deferred: Iterable[Deferred], *, made: Iterable[Deferred] = (), held: bool = True) -> None:
        """Make the deferred copies (any thread, one batched call), checking that no source changed meanwhile.

        ``made``: copies made (and checked, their ``changed`` set) earlier; a deferred copy into the same buffer from
        the same memory is neither made nor checked again. ``held``: whether optimizer steps were held until now
        (``False``: a change of a copy made here may come from a step). Every copy is made and checked before
        anything is raised, so that the error names every tensor that changed.

        Raises:
            StagingRaceError: Some source tensors were modified in place before their copy was complete.
        """
        deferred = list(deferred)
        done = {_copied(c): c.changed for c in made}
        rest = Stager.copy(c for c in deferred if _copied(c) not in done)
        early = [c.name for c in deferred if done.get(_copied(c))]
        late = [c.name for c in rest if tensor_version(c.source) != c.version]
        if early or late:
            raise StagingRaceError(early + late, outside_steps=held or not late)

    def assign_buffers(self, deferred: Iterable[Deferred]) -> None:
        """Give each copy of a live write (``buffer`` unset) its reused staging buffer, to be copied into after all."""
        for copy_ in deferred:
            copy_.buffer = self._buffer(copy_.source, _item_key(copy_.index))

    def has_buffers(self, deferred: Iterable[Deferred]) -> int:
        """Bytes of ``deferred`` whose staging buffers exist already (copies into them fault in no fresh pages)."""
        total = 0
        for copy_ in deferred:
            buffer = self._buffers.get(_item_key(copy_.index))
            source = copy_.source
            if buffer is not None and buffer.shape == source.shape and buffer.dtype == source.dtype:
                total += source.nbytes
        return total

    @staticmethod
    def copy(deferred: Iterable[Deferred], *, check: bool = False) -> list[Deferred]:
        """Make these copies now, in one batched call; returns them. ``check``: set their ``changed``."""
        deferred = list(deferred)
        if deferred:
            foreach_copy([copy_.buffer for copy_ in deferred], [copy_.source for copy_ in deferred])
        if check:
            for copy_ in deferred:
                copy_.changed = tensor_version(copy_.source) != copy_.version
        return deferred

    def synchronize_staging(self) -> None:
        """Staging is complete when :meth:`stage` returns: nothing to wait for."""

    def close(self) -> None:
        """Release the buffers."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held in staging buffers."""
        return sum(b.nbytes for b in self._buffers.values())

    def _copy(self, obj: Any, path: tuple) -> Any:
        if isinstance(obj, DTensor):  # rebuilt around the CPU buffer, which stays on the CPU
            return dtensor_over(obj, self._copy_tensor(obj.to_local(), path))
        if isinstance(obj, ShardedTensor):  # FSDP1's sharded state dict: each local shard staged
            shards = [self._copy_tensor(s.tensor, (*path, i)) for i, s in enumerate(obj.local_shards())]
            return sharded_tensor_over(obj, shards)
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path)
        if isinstance(obj, dict):
            return {k: self._copy(v, (*path, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, (*path, i)) for i, v in enumerate(obj))
        if isinstance(obj, _IMMUTABLE):
            return obj
        return copy.deepcopy(obj)

    def _buffer(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[path] = buffer
        return buffer

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffer(tensor, path)
        non_blocking = self.pin_memory and tensor.is_cuda
        self._cuda_copies |= non_blocking
        buffer.copy_(tensor, non_blocking=non_blocking)
        return buffer


def _item_key(index: Any) -> tuple:
    """The staging buffer key of a write item's data (by its ``MetadataIndex``)."""
    return "item", index.fqn, tuple(index.offset) if index.offset is not None else ()


def _copied(copy_: Deferred) -> tuple:
    """What identifies a copy: its buffer and the memory it copies."""
    return id(copy_.buffer), copy_.source.data_ptr(), copy_.source.shape, copy_.source.stride()
