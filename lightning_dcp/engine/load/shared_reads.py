"""Restores of replicated state that read each record once across the ranks, then broadcast it.

Under DDP every rank restores the same model and optimizer state: read rank by rank, every byte of the checkpoint
is read ``world_size`` times (from an object store, ``world_size`` times the bytes over the network; on a local disk,
``world_size`` times the per-record work). Here, when every rank's load plan reads the same tensor records (the
*shared* records), they are cut into *units* (a run of small records read with one call, or one large record), the
units into rounds of bounded bytes, and each round into contiguous byte ranges, one per rank. In each round, each
rank reads and verifies its own units into its own targets, the ranks agree on which units failed, and each owner
broadcasts its units to the others over the process group (a CPU backend: gloo):

- a *span* unit (small records, or a record that is not a plain tensor) travels as its raw file bytes, and every
  receiver checks each record against ``.commit`` and applies it as if it had read the bytes itself;
- a *tensor* unit (one large tensor record) travels as the tensor's bytes, from the owner's target straight into
  each receiver's target (a staging copy only where a target cannot take the chunk as it is: a reshard, a GPU or
  non-contiguous target).

A unit that fails on its owner (unreadable, corrupt, not in the expected layout) is read by every rank itself after
the last round, so every rank reaches the same error or the same bytes; nothing here raises while a collective is
pending. Other records (each rank's own state, pickled objects) are read by the ranks that need them, as before.

:func:`agree` decides, collectively, whether a load shares its reads; the storage reader
(:mod:`~lightning_dcp.engine.load.dcp_reader`) supplies the units and what reading, receiving and applying one means.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from lightning_dcp.engine.format.records import tensor_record
from lightning_dcp.engine.load.reading import SMALL_RECORD, Source, read_raw, runs
from lightning_dcp.engine.load.record_checks import _chunk_sizes, _destination
from lightning_dcp.engine.storage.fileout import PIECE

__all__ = ["MIN_SHARED_BYTES", "ROUND_BYTES", "Sharing", "Unit", "agree", "exchange", "owners", "rounds"]

MIN_SHARED_BYTES = 8 << 20
"""Below this many shared bytes a load reads everything on every rank (the exchanges would cost more)."""
ROUND_BYTES = 256 << 20
"""Bytes each rank reads per round at most (one unit may be larger alone). Until a round is applied a rank holds at
most the round's span bytes (every owner's, this x world size) and the staging copies of its own tensor units whose
targets cannot take them directly; a tensor unit landing in its target holds nothing."""


@dataclasses.dataclass(frozen=True)
class Sharing:
    """How a load shares its reads: the process group and the record keys every rank's plan holds once."""

    group: Any
    rank: int
    world_size: int
    keys: frozenset


@dataclasses.dataclass
class Unit:
    """What one owner reads and broadcasts: ``nbytes`` travelling as file bytes (``span``) or a tensor's bytes."""

    nbytes: int
    span: bool


def agree(keys: Sequence[Hashable] | None, *, group: Any = None, min_bytes: int | None = None) -> Sharing | None:
    """Collectively decide whether a load shares its reads; the same answer on every rank.

    The ranks share when every rank's plan reads the same tensor records (DDP's replicated state): each rank sends
    a digest of its sorted keys, not the keys (a small exchange at any world size).

    Collective: call on all ranks of ``group`` (one ``all_gather_object`` of a few bytes per rank).

    Args:
        keys: This rank's tensor record keys ``(file, offset, length)`` in its load plan, or ``None`` when this rank
            cannot share (its planning failed, or its reader does not share).
        group: The process group of the load (default group when ``None``); its backend must carry CPU tensors.
        min_bytes: Shared bytes below which sharing is not worth its exchanges (:data:`MIN_SHARED_BYTES`).

    Returns:
        A :class:`Sharing` with the keys each plan holds exactly once, or ``None`` (every rank reads alone).
    """
    world_size = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    if world_size < 2 or "gloo" not in backend:  # NCCL carries no CPU tensors: each rank reads its own
        return None
    ordered = None if keys is None else sorted(keys)
    digest = None if ordered is None else (len(ordered), xxhash.xxh3_128_hexdigest(repr(ordered).encode()))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, digest, group=group)
    if digest is None or any(other != digest for other in gathered):
        return None
    counts: dict = {}
    for key in ordered:
        counts[key] = counts.get(key, 0) + 1
    once = frozenset(key for key, n in counts.items() if n == 1)
    if sum(key[2] for key in once) < (MIN_SHARED_BYTES if min_bytes is None else min_bytes):
        return None
    return Sharing(group=group, rank=dist.get_rank(group), world_size=world_size, keys=once)


def rounds(units: Sequence[Unit], *, world_size: int, round_bytes: int | None = None) -> list[range]:
    """Consecutive unit ranges of at most ``round_bytes`` (:data:`ROUND_BYTES`) x ``world_size`` bytes each.

    A unit larger than that is a round alone.
    """
    limit = (ROUND_BYTES if round_bytes is None else round_bytes) * world_size
    found, begin, held = [], 0, 0
    for i, unit in enumerate(units):
        if i > begin and held + unit.nbytes > limit:
            found.append(range(begin, i))
            begin, held = i, 0
        held += unit.nbytes
    if begin < len(units):
        found.append(range(begin, len(units)))
    return found


def owners(units: Sequence[Unit], world_size: int) -> list[int]:
    """The rank that reads each unit: contiguous ranges of about equal bytes, in order (rank 0 first)."""
    total = sum(unit.nbytes for unit in units) or 1
    found, before = [], 0
    for unit in units:
        middle = before + unit.nbytes / 2
        found.append(min(world_size - 1, int(middle * world_size / total)))
        before += unit.nbytes
    return found


def exchange(
    units: Sequence[Unit],
    sharing: Sharing,
    *,
    read: Callable[[int, memoryview, int], torch.Tensor | None],
    receive: Callable[[int], torch.Tensor],
    apply: Callable[[int, memoryview | None, int], None],
    round_bytes: int | None = None,
) -> tuple[list[int], list[BaseException]]:
    """Read this rank's units, broadcast them, apply the others'; every rank takes part in every collective.

    Per round (:func:`rounds`), each rank reads its contiguous share of the round's bytes (:func:`owners`), the
    ranks exchange which units failed (and whether a rank could not take part: then the whole round fails), then
    every owner broadcasts its units and every rank applies the others'. Nothing that may raise runs between two
    collectives of a round without being caught: a rank never leaves the sequence of collectives early.

    Collective: call on all ranks of ``sharing.group`` with the same ``units``.

    Args:
        units: The shared units, in the same order on every rank.
        sharing: From :func:`agree`.
        read: ``read(i, view, address)`` reads unit ``i`` on its owner and applies it to the owner's targets; a span
            unit's bytes go into ``view`` (``nbytes`` long, at memory ``address``), a tensor unit returns the tensor
            to broadcast (contiguous, ``nbytes`` bytes). Raises when the unit cannot be read or verified.
        receive: ``receive(i)``, on the other ranks, the contiguous tensor of ``nbytes`` bytes a tensor unit lands in.
        apply: ``apply(i, view, address)`` applies a received unit (a span's bytes in ``view``; ``None`` for a tensor
            unit, already landed).
        round_bytes: Bytes each rank reads per round at most (:data:`ROUND_BYTES`).

    Returns:
        ``(failed, errors)``: units that failed on their owner (every rank reads them itself afterwards), and the
        errors this rank met applying received units (raise the first once every collective is done).
    """
    group, rank, world_size = sharing.group, sharing.rank, sharing.world_size
    failed: list[int] = []
    errors: list[BaseException] = []
    for span in rounds(units, world_size=world_size, round_bytes=round_bytes):
        owner = dict(zip(span, owners([units[i] for i in span], world_size), strict=True))
        spans = {r: [i for i in span if owner[i] == r and units[i].span] for r in range(world_size)}
        offsets: dict[int, int] = {}
        buffers: dict[int, torch.Tensor] = {}
        held: dict[int, torch.Tensor] = {}
        mine_failed: list[int] = []
        try:  # this rank's part of the round: a failure here fails the round on every rank, not the collectives
            for r, ids in spans.items():
                position = 0
                for i in ids:
                    offsets[i] = position
                    position += units[i].nbytes
                buffers[r] = torch.empty(position, dtype=torch.uint8)
            buffer = buffers[rank]
            view = memoryview(buffer.numpy()) if buffer.numel() else memoryview(b"")
            ready = True
        except Exception:  # noqa: BLE001 - e.g. out of memory: this round is read alone by every rank
            ready = False
        for i in span if ready else ():
            if owner[i] != rank:
                continue
            try:
                if units[i].span:
                    start = offsets[i]
                    read(i, view[start : start + units[i].nbytes], buffer.data_ptr() + start)
                else:
                    held[i] = read(i, memoryview(b""), 0)
            except Exception:  # noqa: BLE001 - every rank reads it itself after the rounds and meets the error
                mine_failed.append(i)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (ready, mine_failed), group=group)
        if not all(ok for ok, _ in gathered):
            failed += list(span)
            continue
        round_failed = {i for _, ids in gathered for i in ids}
        failed += sorted(round_failed)
        for src in range(world_size):  # every broadcast first, then the applying: ranks apply side by side
            root = _global(group, src)
            if buffers[src].numel():
                dist.broadcast(buffers[src], root, group=group)
            for i in span:
                if owner[i] == src and not units[i].span and i not in round_failed and units[i].nbytes:
                    _tensor_unit(i, units[i].nbytes, src == rank, root, group, held, receive, apply, errors)
        for src in range(world_size):
            data = buffers[src]
            if src == rank or not data.numel():
                continue
            whole = memoryview(data.numpy())
            for i in spans[src]:
                if i not in round_failed:
                    start = offsets[i]
                    _guard(errors, apply, i, whole[start : start + units[i].nbytes], data.data_ptr() + start)
    return failed, errors


def _global(group: Any, rank: int) -> int:
    """The global rank of ``group``'s rank ``rank`` (what ``dist.broadcast``'s ``src`` names)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _tensor_unit(
    i: int,
    nbytes: int,
    mine: bool,
    root: int,
    group: Any,
    held: dict[int, torch.Tensor],
    receive: Callable[[int], torch.Tensor],
    apply: Callable[[int, memoryview | None, int], None],
    errors: list[BaseException],
) -> None:
    """Broadcast tensor unit ``i`` from its owner (global rank ``root``) into each receiver's landing tensor."""
    if mine:
        dist.broadcast(_bytes_of(held.pop(i)), root, group=group)
        return
    try:
        landing = receive(i)
    except Exception as err:  # noqa: BLE001 - still take part in the broadcast
        errors.append(err)
        landing = None
    ok = landing is not None and landing.is_contiguous() and _nbytes(landing) == nbytes
    if landing is not None and not ok:
        errors.append(ValueError(f"shared read unit {i}: the target does not hold {nbytes} bytes"))
    dist.broadcast(_bytes_of(landing) if ok else torch.empty(nbytes, dtype=torch.uint8), root, group=group)
    if ok:
        _guard(errors, apply, i, None, 0)


def _guard(errors: list[BaseException], fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - raised after the collectives
        errors.append(err)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat ``uint8`` tensor (a view)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


# ------------------------------------------------------------------------ the verifying reader's shared reads
class SharedRecordReads:
    """The verifying reader's shared reads (mixed into it): what several ranks' plans hold, read once and broadcast."""

    def _read_shared(self, plan: LoadPlan, planner: LoadPlanner, sharing: Sharing) -> LoadPlan:
        """Read what every rank's plan holds once across the ranks (see :mod:`~lightning_dcp.engine.load.shared_reads`).

        Collective: every rank of ``sharing.group`` calls it with its own plan. Returns the plan of what this rank
        still reads alone: its own records, and the shared units that failed on their owner.
        """
        storage_data, keys = self.storage_data, sharing.keys
        shared, alone = [], []
        for item in plan.items:
            info = storage_data[item.storage_index]
            (shared if (info.relative_path, info.offset, info.length) in keys else alone).append(item)
        per_file, _ = self._per_file(LoadPlan(shared))
        units: list[Unit] = []
        jobs: list[tuple] = []  # (file, start, checked, tensor layout or None)
        for name in sorted(per_file):
            size = self.sizes.get(name, 0)
            for run, start, end, part in _runs(per_file[name]):
                checked = self._checked(name, size, part)
                item = checked[0][2]
                tensor = not run and item.type == LoadItemType.TENSOR
                meta = self._tensor_meta.get(item.storage_index.fqn) if tensor else None
                sizes = None if meta is None else _chunk_sizes(meta, item.storage_index)
                if sizes is None:  # file bytes: small records, or one record that is not a plain tensor chunk
                    units.append(Unit(end - start, span=True))
                    jobs.append((name, start, checked, None))
                else:
                    layout = tensor_record(meta.properties.dtype, sizes)
                    units.append(Unit(layout.nbytes, span=False))
                    jobs.append((name, start, checked, (meta.properties.dtype, sizes, layout)))
        sources: dict[str, Source] = {}
        landed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        streams = contextlib.ExitStack()

        def source(name: str) -> Source:
            if name not in sources:
                stream = streams.enter_context(self.fs.create_stream(self.fs.concat_path(self.path, name), "rb"))
                sources[name] = Source(stream)
                streams.callback(sources[name].close)
            return sources[name]

        def read(i: int, view: memoryview, address: int) -> torch.Tensor | None:
            name, start, checked, tensor = jobs[i]
            if tensor is None:
                got = source(name).read_into(view, start)
                self._take_run(name, checked, start, view[:got], address, planner)
                return None
            _, info, item, expected = checked[0]
            dtype, sizes, layout = tensor
            target, into = _destination(item, dtype, sizes, planner)
            digest = read_raw(source(name), info.offset, info.length, layout, into)
            if digest is None or (expected is not None and digest != expected):
                raise self._corrupt(name, item)  # every rank reads it itself next, and says what is wrong
            self._land(item, target, into, planner)
            return into

        def receive(i: int) -> torch.Tensor:
            name, _, checked, (dtype, sizes, _) = jobs[i]
            item = checked[0][2]
            landed[i] = self._guarded_value(name, item, _destination, item, dtype, sizes, planner)
            return landed[i][1]

        def apply(i: int, view: memoryview | None, address: int) -> None:
            name, start, checked, tensor = jobs[i]
            if tensor is None:
                self._take_run(name, checked, start, view, address, planner)
            else:
                target, into = landed.pop(i)
                self._guarded(name, checked[0][2], self._land, checked[0][2], target, into, planner)

        with streams:
            failed, errors = exchange(units, sharing, read=read, receive=receive, apply=apply)
        if errors:
            raise errors[0]
        return LoadPlan(alone + [entry[2] for i in failed for entry in jobs[i][2]])


def _runs(entries: list) -> Iterator[tuple[bool, int, int, list]]:
    """``(run, start, end, entries)`` of the DCP reader's ``(offset, storage info, read item)`` entries of one file.

    Grouped by :func:`~lightning_dcp.engine.load.reading.runs` into reads of at most ``PIECE`` bytes; ``run`` is False
    for a record read alone (larger than ``SMALL_RECORD``).
    """
    offsets, lengths = [entry[0] for entry in entries], [entry[1].length for entry in entries]
    for i, j, end in runs(offsets, lengths, span=PIECE):
        yield lengths[i] <= SMALL_RECORD, offsets[i], end, entries[i:j]
