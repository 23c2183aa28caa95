"""Persisting a memory checkpoint to the durable tiers: the same files, byte for byte, committed globally.

Run by the memory tier's background thread on every rank (collective over its group), for every ``persist_every``-th
memory checkpoint, on a time schedule, and at SIGTERM. Each rank copies the data file it wrote from its node's memory
area (the size ``.commit`` records) to the durable target; once every rank is done, rank 0 writes ``.metadata`` and
``.commit`` (the marker of the memory checkpoint: both copies are recognisably the same checkpoint, with the same
order) and commits:

- a local ``dirpath`` (one filesystem every node reaches): into a hidden staging directory, synced, renamed into place;
- a remote ``dirpath`` with ``local_dir``: the same into ``local_dir``, then the local tier's uploader takes it to
  the remote store (:mod:`~lightning_dcp.engine.tiers.local`), off the training loop and through outages;
- a remote ``dirpath`` without ``local_dir``: put to the remote prefix, sizes checked in a fresh listing, ``.commit``
  last;
- a local ``dirpath`` (or ``local_dir``) that is a disk of each node rather than one filesystem for all (found once
  per run, :func:`~lightning_dcp.engine.tiers.node_disks.layout`): each node keeps its parts on its own disk, and
  with a remote ``dirpath`` uploads its own files, rank 0 committing last
  (:mod:`~lightning_dcp.engine.tiers.node_disks`).

A kill at any moment leaves the durable copy uncommitted (never loaded, removed later) or committed whole; the memory
copy is evicted only after a newer checkpoint is committed in memory. Older checkpoints this tier persisted leave the
durable directory once ``keep`` newer ones are committed there (top-k by recency).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE
from lightning_dcp.engine.storage.localfs import fsync_dir, new_token, replace_file
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import node_disks
from lightning_dcp.engine.tiers.local import Tiers
from lightning_dcp.engine.tiers.node_disks import NodeDisks
from lightning_dcp.engine.tiers.parts import Part, PartStore
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from lightning_dcp.engine.tiers.memory import MemoryTier, Saved

__all__ = ["Persistence"]


class Persistence:
    """Where a memory tier's checkpoints go when persisted: ``directory`` (and the local tier in front of it).

    Args:
        tier: The memory tier.
        directory: The durable directory (a local path: one filesystem every node reaches, or a disk of each node;
            or a remote URL).
        tiers: The local tier (``local_dir``) in front of a remote ``directory``, or ``None``.
        keep: Checkpoints persisted by this run that stay in ``directory`` (the newest); ``0`` keeps all.
    """

    def __init__(self, tier: MemoryTier, directory: Location, *, tiers: Tiers | None, keep: int = 2) -> None:
        self.tier, self.directory, self.tiers, self.keep = tier, directory, tiers, keep
        self.persisted: list[Location] = []
        """The checkpoints this run persisted and that are still kept, oldest first (rank 0)."""
        self.disks: NodeDisks | None = None
        """The node's disk as the durable tier, when ``directory`` (or ``local_dir``) is node-local (at a persist)."""
        self.counted = False
        """Whether the save counters account for the parts on the node-local disks (set by the checkpointer)."""
        self._layout_known = False

    def disk_base(self) -> str | None:
        """The node's durable local directory: a local ``directory``, or ``local_dir`` before a remote one."""
        if self.directory.local:
            return self.directory.path
        return self.tiers.local.path if self.tiers is not None else None

    def disk_store(self) -> PartStore | None:
        """The parts persisted on this node's disk (by this run or an earlier one), if any. Any rank, no collective."""
        base = self.disk_base()
        return None if base is None else node_disks.existing_store(base)

    def __call__(self, saved: Saved, part: Part) -> None:
        """Persist ``saved`` from this node's ``part``. Collective over the memory tier's group.

        Raises:
            CheckpointError: Copying or committing failed on some rank (every rank raises); nothing was committed.
        """
        if self._node_local():
            self.disks.persist(saved)
            return
        topology = self.tier.topology
        remote = self.directory.child(saved.name)
        tiered = self.tiers is not None and self.tiers.covers(remote)
        target = self.tiers.local_twin(remote) if tiered else remote

        def decide() -> tuple[str, bool]:
            if tiered:
                self.tiers.prepare(remote)
            return new_token(), target.local or target.exists()

        token, staged = self._on_rank0(decide)
        dest = target.staging(token) if staged else target
        own = [f for f in saved.files if f.startswith(f"__{topology.rank}_")]
        self._everywhere(lambda: self._copy(part, own, saved, dest))
        if target.local:
            self._everywhere(lambda: self._check_shared(saved, dest))

        def commit() -> None:
            try:
                for name, data in ((METADATA_FILE, saved.metadata), (COMMIT_FILE, saved.marker)):
                    if name == COMMIT_FILE and not dest.local:
                        _check_sizes(dest, saved)
                    _write(dest, name, data)
                if dest is not target:
                    target.commit_from(dest)
                if target.local:
                    fsync_dir(target.parent().path)
            except BaseException:
                if tiered:
                    self.tiers.abandoned(remote)
                if dest is not target:
                    dest.remove()
                raise
            if tiered:
                self.tiers.committed(remote)
            self._prune(remote, tiered)

        self._on_rank0(commit)

    # -------------------------------------------------------------------------------------------- steps
    def _node_local(self) -> bool:
        """Whether this run persists to node-local disks (decided at its first persist). Collective."""
        if not self._layout_known:
            base = self.disk_base()
            if base is not None and node_disks.layout(self.tier, base):
                remote = None if self.directory.local else self.directory
                self.disks = NodeDisks(self.tier, base, remote=remote, keep=self.keep)
            self._layout_known = True
        return self.disks is not None

    def _copy(self, part: Part, own: list[str], saved: Saved, dest: Location) -> None:
        for name in own:
            with dest.open(name, "wb") as out:
                node_disks.copy_file(os.path.join(part.path, name), out, saved.files[name], sync=dest.local)

    def _check_shared(self, saved: Saved, dest: Location) -> None:
        """A local target must be one filesystem for every node: each file written must be visible on every rank."""
        missing = [f for f in saved.files if not os.path.exists(os.path.join(dest.path, f))]
        if missing:
            raise CheckpointError(
                f"The memory tier persists into {dest.parent().url!r}, but this rank does not see {missing[:3]}"
                " written by other nodes, though every node saw the others' probe there: a local `dirpath` (or"
                " `local_dir`) must be one filesystem that every node reaches, or a disk of each node."
            )

    def _prune(self, remote: Location, tiered: bool) -> None:
        """Rank 0: remove what this run persisted beyond the newest ``keep``."""
        self.persisted = [loc for loc in self.persisted if loc.url != remote.url] + [remote]
        if self.keep <= 0:
            return
        while len(self.persisted) > self.keep:
            old = self.persisted.pop(0)
            if tiered:
                self.tiers.remove(old, after_save=False)
            else:
                old.remove_file(COMMIT_FILE)
                old.remove()

    def _on_rank0(self, fn: Callable[[], Any]) -> Any:
        topology = self.tier.topology
        outcome = None
        if topology.rank == 0:
            try:
                outcome = (True, fn())
            except Exception as err:
                outcome = (False, CheckpointError(f"Persisting to {self.directory.url!r} failed: {err}"))
        ok, value = self.tier.broadcast(outcome)
        if not ok:
            raise value
        return value

    def _everywhere(self, fn: Callable[[], None]) -> None:
        node_disks.everywhere(self.tier, fn, failure=f"Persisting to {self.directory.url!r} failed")


def _write(location: Location, name: str, data: bytes) -> None:
    """Write one marker file; on local disks into a temporary name, synced, then renamed (never seen half written)."""
    if not location.local:
        with location.open(name, "wb") as f:
            f.write(data)
        return
    replace_file(location.join(name), data)


def _check_sizes(location: Location, saved: Saved) -> None:
    sizes = location.sizes()
    wrong = {f: sizes.get(f) for f, size in saved.files.items() if sizes.get(f) != size}
    if wrong:
        raise CorruptCheckpointError(f"{location.url!r}: files missing or of the wrong size after the copy: {wrong}.")
