"""Restoring from the memory tier: which checkpoint the areas can restore, and assembling it on every node.

:func:`restorable` gathers what every node's area holds (its own parts and the replicas of its peers' parts), and the
parts persisted on its disk when the durable directory is node-local (:mod:`~lightning_dcp.engine.tiers.node_disks`),
and lists the checkpoints whose every part is held somewhere, newest first. :func:`assemble` then gives every node the
whole checkpoint in a hidden directory of its area (``.load-{token}``): hard links to the files it holds, and the
files it lacks fetched from the nodes that hold them (:func:`~lightning_dcp.engine.tiers.replication.run_transfers`),
so a replacement node with an empty area receives its part from a peer (from its memory area, else its disk). A file
held in memory is taken from there; a node that holds the checkpoint on its disk only assembles it there (hard links,
no copy). Each node then loads its own copy (DCP reshards to the current world size, and every record read is checked
against its checksum in ``.commit``); :func:`release` removes the directories. Nothing here reads a shared durable
directory.

Every function is collective over the memory tier's group.
"""

from __future__ import annotations

import os
import shutil
import socket
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_dcp.engine.catalog.integrity import check_checkpoint
from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE, parse_commit
from lightning_dcp.engine.storage.localfs import new_token, remove_path
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import runs
from lightning_dcp.engine.tiers.node_disks import everywhere
from lightning_dcp.engine.tiers.parts import LOAD_PREFIX, Part, PartStore, complete
from lightning_dcp.engine.tiers.persist import Persistence
from lightning_dcp.engine.tiers.replication import Transfer, run_transfers
from lightning_dcp.errors import CheckpointError

if TYPE_CHECKING:
    from lightning_dcp.engine.tiers.memory import MemoryTier

__all__ = ["assemble", "release", "restorable", "shared_path"]

_SLIM = ("committed_at", "metadata", "order")


def restorable(tier: MemoryTier) -> list[tuple[tuple, str, tuple]]:
    """``(order key, name, identity)`` of every checkpoint the areas (and node-local disks) can restore, newest first.

    Every rank gets the same list. The tier's :attr:`~lightning_dcp.engine.tiers.memory.MemoryTier.highest` grows to
    the largest save counter listed, so that saves made after a restore count on from there.
    """
    own = []
    if tier.topology.leader:
        for store in _stores(tier):
            for part in _ours(tier, store):
                slim = {k: part.marker[k] for k in _SLIM if k in part.marker}
                own.append((part.name, part.node, part.nodes, part.files, slim))
    parts = [
        (i, Part(name=n, node=j, nodes=count, files=files, marker=slim, path=""))
        for i, held in enumerate(tier.gather(own))
        for n, j, count, files, slim in held
    ]
    tier.highest = max([tier.highest, *(part.key[0] for _, part in parts)])
    return complete(parts)


def _ours(tier: MemoryTier, store: PartStore) -> list[Part]:
    """The parts of ``store`` that this run may restore; another run's, in the memory area, are ignored with a warning.

    Parts on a node's disk lie in this run's durable directory and are always its own.
    """
    parts = store.parts()
    if store is not tier.store or not tier.run_known:
        return parts  # no durable directory bound: the area's parts are taken as they are
    ours = [p for p in parts if tier.run is not None and p.run == tier.run]
    others = sorted({p.name for p in parts if p not in ours})
    if others and not tier.warned_foreign:
        tier.warned_foreign = True
        foreign = sorted({p.run or "none recorded" for p in parts if p not in ours})
        mine = tier.run or "none yet: no token in its durable directory"
        how = (
            "the job's identity (torchrun's run id, SLURM's job id)"
            if tier.run and tier.run.startswith(("torchelastic", "torchrun", "slurm"))
            else f"the token in its durable directory (`{runs.RUN_FILE}` in `dirpath`; no launcher job id was found)"
        )
        warnings.warn(
            f"lightning_dcp: the memory area {tier.store.root!r} holds checkpoints of another run ({others}; run(s)"
            f" {', '.join(foreign)}), not of this run ({mine}, from {how}): they are ignored, not resumed, and left in"
            " place. A restarted job resumes its own memory checkpoints; a new job, or a `dirpath` emptied or"
            " changed outside a launcher, is a new run. To resume them, run under the same job (torchrun"
            " `--rdzv-id`, the same SLURM job) or with the same `dirpath`; remove the area once the old run is done.",
            stacklevel=4,
        )
    return ours


def _stores(tier: MemoryTier) -> list[PartStore]:
    """Where this node holds parts: its memory area, then the parts persisted on its disk (node-local disks)."""
    stores = [tier.store]
    if isinstance(tier.persister, Persistence):
        disk = tier.persister.disk_store()
        if disk is not None:
            stores.append(disk)
    return stores


def _held(tier: MemoryTier, name: str, identity: tuple) -> dict[str, str]:
    """The files of checkpoint ``name`` this node holds (own part and replicas), with their paths, memory first."""
    held = {}
    for store in _stores(tier):
        for part in _ours(tier, store):
            if part.name == name and part.identity == identity:
                for f in [*part.files, METADATA_FILE, COMMIT_FILE]:
                    held.setdefault(f, os.path.join(part.path, f))
    return held


def assemble(tier: MemoryTier, name: str, identity: tuple) -> str:
    """Give every node the whole checkpoint ``name``; returns this node's directory holding it.

    Raises:
        CheckpointError: The areas no longer hold every part, a transfer failed, or an assembled copy fails the fast
            checks (on any node: every rank raises).
    """
    topology = tier.topology
    held = _held(tier, name, identity)
    holdings = tier.gather(sorted(held) if topology.leader else None)
    by_node = {topology.node_of(r): set(files) for r, files in enumerate(holdings) if files is not None}
    holders = [j for j in range(topology.nodes) if COMMIT_FILE in by_node.get(j, ())]
    if not holders:
        raise CheckpointError(f"No node's memory area holds {name!r} any more.")
    source = topology.ranks[holders[0]][0]
    payload = None
    if topology.rank == source:
        with open(held[METADATA_FILE], "rb") as f, open(held[COMMIT_FILE], "rb") as g:
            payload = (f.read(), g.read(), new_token())
    metadata, marker, token = tier.broadcast(payload, src=source)
    files = {f: e["size"] for f, e in parse_commit(marker)["files"].items()}
    tier.origin = _origin(tier, held, files)
    into = os.path.join(_assembly_root(tier, held), f"{LOAD_PREFIX}{token}")
    transfers = []
    for node in range(topology.nodes):
        for i, f in enumerate(sorted(files)):
            if f in by_node.get(node, ()):
                continue
            owners = [j for j in range(topology.nodes) if f in by_node.get(j, ())]
            if not owners:
                raise CheckpointError(f"No node's memory area holds {f} of {name!r} any more.")
            src_ranks, dst_ranks = topology.ranks[owners[node % len(owners)]], topology.ranks[node]
            transfers.append(Transfer(src_ranks[i % len(src_ranks)], dst_ranks[i % len(dst_ranks)], f, files[f]))

    def prepare() -> None:
        if not topology.leader:
            return
        os.makedirs(into)
        for f, path in held.items():
            if f in files or f in (METADATA_FILE, COMMIT_FILE):
                _link_or_copy(path, os.path.join(into, f))
        for f, data in ((METADATA_FILE, metadata), (COMMIT_FILE, marker)):
            if f not in held:
                with open(os.path.join(into, f), "wb") as out:
                    out.write(data)

    def check() -> None:
        if topology.leader:
            check_checkpoint(Location(into))

    try:
        _step(tier, name, prepare)  # the directory exists on every node before anything is received into it
        _step(
            tier, name, lambda: run_transfers(transfers, rank=topology.rank, sources=held, into=into, group=tier.group)
        )
        _step(tier, name, check)
    except CheckpointError:
        if topology.leader:
            remove_path(into)
        raise
    return into


def _origin(tier: MemoryTier, held: dict[str, str], files: dict[str, int]) -> str:
    """Where this node's copy comes from, in words: its area (own part, replicas), its disk, peers' areas."""
    topology, bits = tier.topology, []
    own = [f for f, path in held.items() if f in files and path.startswith(tier.store.root + os.sep)]
    mine = [f for f in own if any(f.startswith(f"__{r}_") for r in topology.ranks[topology.node])]
    if mine:
        bits.append(f"this node's own part in {tier.store.root}")
    if len(own) > len(mine):
        bits.append(f"a replica of a peer node's part in {tier.store.root}")
    if len(own) < len([f for f in held if f in files]):
        bits.append("this node's disk")
    fetched = len([f for f in files if f not in held])
    if fetched:
        bits.append(f"{fetched} file(s) fetched from peer nodes' areas or disks")
    return ", ".join(bits) or "nothing held here"


def _assembly_root(tier: MemoryTier, held: dict[str, str]) -> str:
    """Where this node assembles: its memory area, or its disk when it holds the checkpoint on its disk only.

    On the disk every file held is a hard link and only the files fetched from peers are written; a copy into the
    memory area would first read every file of the disk.
    """
    roots = {os.path.dirname(os.path.dirname(path)) for path in held.values()}
    if roots and tier.store.root not in roots:
        return roots.pop()  # a disk's store of persisted parts (the only other place parts are held)
    return tier.store.root


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link (a file of the memory area), or a copy where ``src`` is on another filesystem (a disk)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _step(tier: MemoryTier, name: str, fn: Callable[[], object]) -> None:
    """Run ``fn`` on every rank; raise on every rank if it failed on any."""
    everywhere(tier, fn, failure=f"Restoring {name!r} from the memory tier failed")


def release(tier: MemoryTier, directory: str) -> None:
    """Remove the assembled ``directory`` once every rank is done with it."""
    tier.gather(None)
    if tier.topology.leader:
        remove_path(directory)


def shared_path(tier: MemoryTier, directory: str) -> str:
    """``directory`` (this node's assembled copy), once checked to name a whole copy on every rank.

    A front end that loads by one path for all ranks (rank 0's, as Fabric's load does) reads each node's own copy
    when the copies have the same path on every machine (the same ``memory_dir`` everywhere), or rank 0's copy when
    every rank runs on one machine (simulated nodes).

    Raises:
        CheckpointError: The ranks run on several machines with different paths of the memory area.
    """
    seen = tier.gather((socket.gethostname(), directory))
    if len({path for _, path in seen}) > 1 and len({host for host, _ in seen}) > 1:
        raise CheckpointError(
            f"Loading from the memory tier by one path needs the same `memory_dir` on every machine; the ranks have"
            f" {sorted({os.path.dirname(path) for _, path in seen})}. Give every node the same path (e.g."
            " `/dev/shm/<user>-<run>`)."
        )
    return directory
