"""Moving data files between nodes over a gloo group: replicas of each node's part, and parts fetched at restore.

Both are a list of :class:`Transfer` that every rank computes alike from what every rank knows (the checkpoint's
``.commit`` and the topology, or the gathered inventory); each rank then posts its sends and receives in that one
order (gloo matches the messages of a pair of ranks in order) and waits for all of them. A file is sent from the
sender's mapping of its tmpfs file into the receiver's mapping of a new file, in pieces of at most 512 MiB: no copy
through Python, no serialization.

What is received lands under a hidden staging name; the caller commits it (a replica part) or checks it (a restore)
only once every rank of its node has received everything (:func:`replicate` and the memory tier's restore).
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import torch
import torch.distributed as dist

from lightning_dcp.engine.tiers.nodes import Topology
from lightning_dcp.engine.tiers.parts import PartStore

__all__ = ["Transfer", "replica_transfers", "replicate", "run_transfers"]

_PIECE = 512 << 20


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One file sent by global rank ``src`` to global rank ``dst``: ``size`` bytes, by its name in the checkpoint."""

    src: int
    dst: int
    file: str
    size: int


def replica_transfers(topology: Topology, files: dict[str, int], replicas: int) -> list[Transfer]:
    """Every file of every node's part to the ``replicas`` nodes after it (cyclically).

    Args:
        topology: The nodes.
        files: Every data file of the checkpoint with its size (from ``.commit``); ``__{rank}_*`` was written by
            ``rank``, whose node's part holds it.
        replicas: K, the number of other nodes that hold each part.

    The rank with local index ``l`` of a node sends its own files to the rank with local index ``l`` (modulo the
    receiving node's ranks) of each replica node, so the ranks of a node share the sending.
    """
    transfers = []
    for node, ranks in enumerate(topology.ranks):
        for peer in topology.replica_nodes(node, replicas):
            for local, rank in enumerate(ranks):
                dst = topology.ranks[peer][local % len(topology.ranks[peer])]
                for name in sorted(files):
                    if name.startswith(f"__{rank}_"):
                        transfers.append(Transfer(rank, dst, name, files[name]))
    return transfers


def run_transfers(
    transfers: list[Transfer], *, rank: int, sources: dict[str, str], into: str, group: dist.ProcessGroup
) -> list[str]:
    """Post this rank's sends and receives of ``transfers`` (in that order), then wait for all of them.

    Args:
        transfers: The whole list, the same on every rank.
        rank: This process's global rank.
        sources: Local paths of the files this rank sends, by name.
        into: The directory where received files are written (created when needed).
        group: The gloo group (every rank of it calls this).

    Returns:
        The names of the files received.
    """
    pending, keep, received = [], [], []
    for transfer in transfers:
        if transfer.src == rank and transfer.dst == rank:
            continue
        if transfer.src == rank:
            buffer, mapped = _map(sources[transfer.file], transfer.size, create=False)
        elif transfer.dst == rank:
            os.makedirs(into, exist_ok=True)
            buffer, mapped = _map(os.path.join(into, transfer.file), transfer.size, create=True)
            received.append(transfer.file)
        else:
            continue
        keep.append((buffer, mapped))
        for begin in range(0, transfer.size, _PIECE):
            piece = buffer[begin : begin + _PIECE]
            if transfer.src == rank:
                pending.append(dist.isend(piece, transfer.dst, group=group))
            else:
                pending.append(dist.irecv(piece, transfer.src, group=group))
    try:
        for request in pending:
            request.wait()
    finally:
        for buffer, mapped in keep:
            del buffer
            if mapped is not None:
                mapped.close()
        keep.clear()
    return received


def replicate(
    store: PartStore,
    topology: Topology,
    *,
    name: str,
    files: dict[str, int],
    node_files: dict[int, list[str]],
    replicas: int,
    own_dir: str,
    metadata: bytes,
    marker: bytes,
    token: str,
    group: dist.ProcessGroup,
) -> None:
    """Copy each node's part of the checkpoint ``name`` to ``replicas`` other nodes and commit the replicas there.

    A replica part is committed (by its node's leader) only once every rank of that node received all of it, so a
    node never holds a torn replica. Collective over ``group``.

    Raises:
        RuntimeError: A rank failed to send or receive (every rank raises); no replica was committed by then on a
            node whose receptions failed.
    """
    transfers = replica_transfers(topology, files, replicas)
    staging = {j: store.staging(name, j, token) for j in range(topology.nodes)}
    sources = {f: os.path.join(own_dir, f) for f in files if os.path.exists(os.path.join(own_dir, f))}
    error = None
    try:
        for j in range(topology.nodes):  # the staging directory of each incoming part (even one this rank gets
            if topology.node in topology.replica_nodes(j, replicas):  # nothing of: its leader commits it), then
                os.makedirs(staging[j], exist_ok=True)  # the transfers
        mine = [t for t in transfers if topology.rank in (t.src, t.dst)]
        for source_node in range(topology.nodes):
            part = [t for t in mine if topology.node_of(t.src) == source_node]
            if part:
                run_transfers(part, rank=topology.rank, sources=sources, into=staging[source_node], group=group)
    except Exception as err:
        error = f"rank {topology.rank}: {type(err).__name__}: {err}"
    errors: list = [None] * topology.world_size
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e is not None]
    if not failed and topology.leader:
        for j in range(topology.nodes):
            if topology.node in topology.replica_nodes(j, replicas):
                store.commit(
                    staging[j],
                    name=name,
                    node=j,
                    nodes=topology.nodes,
                    files=node_files[j],
                    metadata=metadata,
                    marker=marker,
                )
    if failed:
        raise RuntimeError(f"Replicating {name!r} failed: {'; '.join(failed)}")


def _map(path: str, size: int, *, create: bool) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A uint8 tensor over the first ``size`` bytes of ``path`` (created with that size when ``create``)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8), None
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8), mapped
