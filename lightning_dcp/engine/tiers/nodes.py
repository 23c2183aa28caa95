"""Which ranks share a node: the ranks that reach the same memory area form one node of the memory tier.

A node here is what can lose its memory as a whole: the ranks of one machine, whose ``/dev/shm`` is one tmpfs.
Ranks name their area (host name and resolved path of the memory directory), every rank gathers every rank's
answer, and nodes are numbered in the order of their lowest global rank. Simulated nodes on one machine (each with
its own memory directory) are nodes like any other.

The tier's gloo group is left with :func:`leave` before the interpreter exits.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket

import torch.distributed as dist

__all__ = ["Topology", "discover", "leave", "single_process"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Topology:
    """The nodes of the run, as the memory tier sees them.

    Attributes:
        rank: This process's global rank.
        world_size: Ranks in all.
        node: This rank's node (0-based).
        ranks: The global ranks of each node, in order (``ranks[node]``).
    """

    rank: int
    world_size: int
    node: int
    ranks: tuple[tuple[int, ...], ...]

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return len(self.ranks)

    @property
    def local_rank(self) -> int:
        """The index of this rank among its node's ranks."""
        return self.ranks[self.node].index(self.rank)

    @property
    def leader(self) -> bool:
        """Whether this rank acts for its node (commits its parts): its lowest rank."""
        return self.local_rank == 0

    def node_of(self, rank: int) -> int:
        """The node of the global rank ``rank``."""
        return next(i for i, ranks in enumerate(self.ranks) if rank in ranks)

    def replica_nodes(self, node: int, replicas: int) -> list[int]:
        """The nodes holding replicas of ``node``'s part: the next ``replicas`` nodes, cyclically (fewer if few)."""
        return [(node + k) % self.nodes for k in range(1, min(replicas, self.nodes - 1) + 1)]

    def rank_at(self, node: int, local_rank: int) -> int | None:
        """The global rank with ``local_rank`` on ``node``; ``None`` when that node has fewer ranks."""
        ranks = self.ranks[node]
        return ranks[local_rank] if local_rank < len(ranks) else None


def area_key(memory_dir: str) -> tuple[str, str]:
    """What tells areas apart: the host and the resolved path of the memory directory."""
    return (socket.gethostname(), os.path.realpath(memory_dir))


def discover(memory_dir: str, *, group: dist.ProcessGroup | None) -> Topology:
    """Group the ranks into nodes by their memory area. Collective over ``group`` (the default group when None)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    keys: list = [None] * world_size
    dist.all_gather_object(keys, area_key(memory_dir), group=group)
    order: dict[tuple, list[int]] = {}
    for r, key in enumerate(keys):
        order.setdefault(tuple(key), []).append(r)
    ranks = tuple(tuple(rs) for rs in order.values())
    return Topology(
        rank=rank, world_size=world_size, node=next(i for i, rs in enumerate(ranks) if rank in rs), ranks=ranks
    )


def single_process() -> Topology:
    """The topology of a run without a process group: one node of one rank."""
    return Topology(rank=0, world_size=1, node=0, ranks=((0,),))


def leave(group: dist.ProcessGroup | None, *, timeout: float = 60.0) -> None:
    """Leave the tier's gloo group in a defined order: a barrier of every rank (at most ``timeout`` s), then destroy it.

    Gloo's worker threads keep each finished collective until they drop it, and dropping one whose tensors Python
    created (``all_gather_object``, ``broadcast_object_list``) takes the GIL. A thread that does so while the
    interpreter finalizes is ended in the middle of a destructor and the process aborts ("terminate called without an
    active exception", SIGABRT), after a run that finished correctly. Destroying the group while the interpreter is
    alive joins those threads first (the caller drops its last reference to ``group`` right after). The barrier makes
    sure no peer still waits for a message of this rank when its connections close; a peer that left or does not
    arrive in time is logged, not raised.

    Collective: call on all ranks of ``group`` (a rank that does not come delays the others by ``timeout``).
    """
    if group is None or not dist.is_available() or not dist.is_initialized():
        return  # never joined, or destroyed with the default group
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        log.warning("lightning_dcp: leaving the memory tier's group without every peer: %s", err)
    try:
        dist.destroy_process_group(group)
    except ValueError:  # already destroyed (with the default group)
        pass
