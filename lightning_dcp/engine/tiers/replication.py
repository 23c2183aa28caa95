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
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_dcp.engine.agreement import RankFailure, agree
from lightning_dcp.engine.storage.localfs import remove_path
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
    transfers: list[Transfer],
    *,
    rank: int,
    sources: dict[str, str],
    into: str | Callable[[Transfer], str],
    group: dist.ProcessGroup | None,
    failed: BaseException | None = None,
) -> list[str]:
    """Map this rank's files of ``transfers``, agree that every rank could, then send and receive them all.

    Each rank first maps the files it sends and creates the files it receives with their memory reserved
    (``posix_fallocate``: a full area fails here with ``ENOSPC``, never with SIGBUS mid-transfer); one exchange
    then tells every rank whether any rank failed, before any message is posted, so a rank that cannot take part
    never leaves a peer waiting for its messages. Sends and receives are then posted in the list's order (gloo
    matches a pair's messages in order) and waited for.

    Args:
        transfers: The whole list, the same on every rank.
        rank: This process's global rank.
        sources: Local paths of the files this rank sends, by name.
        into: The directory where received files are written (created when needed), or a function giving it for
            each transfer.
        group: The gloo group (``None``: a single process, which has nothing to send).
        failed: This rank's failure before the transfers (e.g. a directory it could not create): it fails them
            on every rank, in the same exchange.

    Collective: call on all ranks of ``group``, with the same ``transfers``, whether a rank takes part or not.

    Returns:
        The names of the files received.

    Raises:
        RankFailure: Some rank could not map or create its files (or came with ``failed``); on every rank, with
            the lowest such rank's error. Files this rank created for the transfers are removed.
    """
    keep: list[tuple[Transfer, torch.Tensor, mmap.mmap | None]] = []
    created: list[str] = []
    error = failed
    if error is None:
        try:
            for transfer in transfers:
                if transfer.src == transfer.dst or rank not in (transfer.src, transfer.dst):
                    continue
                if transfer.src == rank:
                    buffer, mapped = _map(sources[transfer.file], transfer.size, create=False)
                else:
                    directory = into if isinstance(into, str) else into(transfer)
                    os.makedirs(directory, exist_ok=True)
                    created.append(os.path.join(directory, transfer.file))
                    buffer, mapped = _map(created[-1], transfer.size, create=True)
                keep.append((transfer, buffer, mapped))
        except Exception as err:
            error = err
    try:
        agree(error, group=group, distributed=group is not None)  # no group: one process, nothing to exchange
        pending = []
        for transfer, buffer, _ in keep:
            for begin in range(0, transfer.size, _PIECE):
                piece = buffer[begin : begin + _PIECE]
                if transfer.src == rank:
                    pending.append(dist.isend(piece, transfer.dst, group=group))
                else:
                    pending.append(dist.irecv(piece, transfer.src, group=group))
        for request in pending:
            request.wait()
    except BaseException:
        _unmap(keep)
        for path in created:
            _remove(path)
        raise
    _unmap(keep)
    return [os.path.basename(path) for path in created]


def _unmap(keep: list[tuple[Transfer, torch.Tensor, mmap.mmap | None]]) -> None:
    while keep:
        _, buffer, mapped = keep.pop()
        del buffer
        if mapped is not None:
            mapped.close()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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
    run: str | None = None,
) -> None:
    """Copy each node's part of the checkpoint ``name`` to ``replicas`` other nodes and commit the replicas there.

    A replica part is committed (by its node's leader) only once every rank of that node received all of it, so a
    node never holds a torn replica. Collective over ``group``.

    Raises:
        RankFailure: A rank failed to make room for, send, receive or commit a replica (every rank raises, with the
            lowest such rank's error); the staging directories are removed, and a replica of ``name`` committed on
            another node by then is left for the caller to drop.
    """
    transfers = replica_transfers(topology, files, replicas)
    staging = {j: store.staging(name, j, token) for j in range(topology.nodes)}
    sources = {f: os.path.join(own_dir, f) for f in files if os.path.exists(os.path.join(own_dir, f))}
    incoming = [j for j in range(topology.nodes) if topology.node in topology.replica_nodes(j, replicas)]
    error = None
    try:
        for j in incoming:  # the staging directory of each incoming part (even one this rank gets nothing of: its
            os.makedirs(staging[j], exist_ok=True)  # leader commits it), then the transfers
    except Exception as err:
        error = err
    try:
        into = lambda t: staging[topology.node_of(t.src)]  # noqa: E731
        run_transfers(transfers, rank=topology.rank, sources=sources, into=into, group=group, failed=error)
        error = None
        if topology.leader:
            try:
                for j in incoming:
                    store.commit(
                        staging[j],
                        name=name,
                        node=j,
                        nodes=topology.nodes,
                        files=node_files[j],
                        metadata=metadata,
                        marker=marker,
                        run=run,
                    )
            except Exception as err:
                error = err
        agree(error, group=group, distributed=True)
    except RankFailure:
        if topology.leader:
            for j in incoming:
                remove_path(staging[j])
        raise


def _map(path: str, size: int, *, create: bool) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A uint8 tensor over the first ``size`` bytes of ``path`` (created with that size when ``create``)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8), None
    flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)  # a full area: ENOSPC now, not SIGBUS when the bytes arrive
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8), mapped
